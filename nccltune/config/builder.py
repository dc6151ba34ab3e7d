"""Validation: a tree of values (from the file, or from Python values) into a `Config`.

Every fault is an `InputError` (exit 78) naming the file, the line and the dotted key, with a
did-you-mean where a known name is close. The schema's field types and metadata drive the plain
settings; the settings that are not plain scalars (variable names and values, profiles, GPU
lists, the maintenance window, profile.path) have their own readers, and the rules that involve
more than one key run last.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn, TypeVar

from ..collectives import NAMES as COLLECTIVE_NAMES
from ..errors import InputError
from ..names import VARIABLE_NAME_RE, format_size, unpublishable
from .located import Located, Map, Scalar, Seq, describe, is_null
from .schema import (
    MAX_MESSAGE_BYTES,
    Config,
    ProfileWeights,
    Spec,
    is_section,
    join_key,
    parse_size,
    parse_window,
    setting_names,
    settings_of,
    split_optional,
)

# What the sweep's variables may be called is VARIABLE_NAME_RE; whether a name is a tunable that
# nccltune knows is decided by the sweep catalogue, which can name the line thanks to Config.lines.
_PROFILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_PLAIN_INT_RE = re.compile(r"^[-+]?[0-9]+$")

_SIZE_HINT = 'write a byte count or a size like "64KiB", "16MiB", "1GiB"'
_WINDOW_HINT = 'write "HH:MM-HH:MM" in quotes, e.g. "01:00-05:00"; it may wrap midnight ("22:00-04:00")'
_VARIABLE_HINT = "variable names are NCCL_... or TORCH_NCCL_..., in capitals"
_S = TypeVar("_S")


def _suggest(key: str, prefix: str, cls: type) -> str:
    """A 'did you mean' for an unknown key: a close name here, or the same name in another section."""
    here = list(settings_of(cls))
    # The exact name in another section first: `iters` at the top level means bench.iters, however
    # close it happens to look to a section name here.
    elsewhere = [name for name in setting_names() if name.rsplit(".", 1)[-1] == key]
    close = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    if close and not elsewhere:
        return f"did you mean {join_key(prefix, close[0])}?"
    if not elsewhere:
        leaves = {name.rsplit(".", 1)[-1]: name for name in setting_names()}
        near = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
        elsewhere = [leaves[n] for n in near]
    if elsewhere:
        return f"did you mean {elsewhere[0]}?"
    return f"known keys {'under ' + prefix if prefix else 'at the top level'}: {', '.join(here)}"


class Builder:
    def __init__(self, path: str | None, source: str) -> None:
        self.path = path
        self.source = source
        self.lines: dict[str, int] = {}

    def fail(self, line: int | None, message: str, hint: str | None = None) -> NoReturn:
        if line is not None and self.path is not None:
            raise InputError(self.path, message, line=line, hint=hint)
        raise InputError(self.source, message, hint=hint)

    def fail_at(self, dotted: str, message: str, hint: str | None = None) -> NoReturn:
        self.fail(self.lines.get(dotted), message, hint)

    def record(self, dotted: str, line: int | None) -> None:
        if line is not None:
            self.lines[dotted] = line

    def build(self, root: Located) -> Config:
        cfg = self.section(Config, root, "")
        self.check(cfg)
        return dataclasses.replace(cfg, path=self.path, lines=dict(self.lines))

    def section(self, cls: type[_S], node: Located, prefix: str) -> _S:
        if is_null(node):
            # `bench:` with every key below commented out.
            return cls()
        specs = settings_of(cls)
        if not isinstance(node, Map):
            where = prefix or "the top level"
            self.fail(
                node.line,
                f"{where}: expected a mapping of settings ({', '.join(specs)}), got {describe(node)}",
                # `profile: large` means the sweep objective, which lives in the sweep section.
                "the sweep's objective is sweep.profile; profile.path names a class profile"
                if prefix == "profile" else None,
            )
        kwargs: dict[str, object] = {}
        for entry in node.entries:
            dotted = join_key(prefix, entry.key)
            if entry.key not in specs:
                self.fail(entry.line, f"unknown key {dotted}", _suggest(entry.key, prefix, cls))
            self.record(dotted, entry.line)
            kwargs[entry.key] = self.value(dotted, specs[entry.key], entry.value)
        return cls(**kwargs)

    def value(self, dotted: str, spec: Spec, node: Located) -> object:
        special = _SPECIAL.get(dotted)
        if special is not None:
            return special(self, dotted, node)
        optional, base = split_optional(spec.hint)
        if is_section(base):
            return self.section(base, node, dotted)
        if is_null(node):
            if optional:
                return None
            default = "null" if spec.default is None else str(spec.default).lower()
            self.fail(node.line, f"{dotted}: needs a value", f"leave the key out for the default ({default})")
        if base is bool:
            return self.boolean(dotted, node)
        if base is int:
            result: float = self.integer(dotted, node, size=bool(spec.meta.get("size")))
        elif base is float:
            result = self.number(dotted, node)
        elif base is str:
            return self.string(dotted, node)
        elif typing.get_origin(base) is Literal:
            return self.choice(dotted, node, typing.get_args(base))
        else:  # pragma: no cover - a schema type without a converter is a programming error
            raise TypeError(f"no converter for {dotted}: {spec.hint!r}")
        self.check_range(dotted, node, result, spec.meta)
        return result

    def check_range(self, dotted: str, node: Located, value: float, meta: Mapping[str, Any]) -> None:
        ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
        why = meta.get("why")
        shown = format_size(int(value)) if meta.get("size") else _num(value)
        if ge is not None and value < ge:
            limit = format_size(int(ge)) if meta.get("size") and ge > 1 else _num(ge)
            self.fail(node.line, f"{dotted}: must be at least {limit}, got {shown}", why)
        if gt is not None and value <= gt:
            self.fail(node.line, f"{dotted}: must be greater than {_num(gt)}, got {shown}", why)
        if le is not None and value > le:
            limit = format_size(int(le)) if meta.get("size") else _num(le)
            self.fail(node.line, f"{dotted}: must be at most {limit}, got {shown}", why)

    def boolean(self, dotted: str, node: Located) -> bool:
        if isinstance(node, Scalar) and isinstance(node.value, bool):
            return node.value
        self.fail(node.line, f"{dotted}: expected true or false, got {describe(node)}")

    def integer(self, dotted: str, node: Located, *, size: bool = False) -> int:
        if isinstance(node, Scalar):
            v = node.value
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            if size and isinstance(v, str):
                try:
                    return parse_size(v)
                except ValueError as exc:
                    self.fail(node.line, f"{dotted}: {exc}", _SIZE_HINT)
        expected = "a byte count or a size" if size else "an integer"
        self.fail(
            node.line, f"{dotted}: expected {expected}, got {describe(node)}", _SIZE_HINT if size else None
        )

    def number(self, dotted: str, node: Located) -> float:
        if isinstance(node, Scalar):
            v = node.value
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if not math.isfinite(v):
                    self.fail(node.line, f"{dotted}: must be a finite number, got {node.text}")
                return float(v)
        self.fail(node.line, f"{dotted}: expected a number, got {describe(node)}")

    def string(self, dotted: str, node: Located) -> str:
        if isinstance(node, Scalar) and isinstance(node.value, str):
            if not node.value.strip():
                self.fail(node.line, f"{dotted}: must not be empty", "leave the key out for the default")
            if "\0" in node.value or "\n" in node.value:
                self.fail(node.line, f"{dotted}: must be a single line")
            return node.value
        hint = None
        if isinstance(node, Scalar) and isinstance(node.value, bool):
            hint = "YAML reads yes/no/on/off/true/false as booleans: put the value in quotes"
        self.fail(node.line, f"{dotted}: expected a string, got {describe(node)}", hint)

    def choice(self, dotted: str, node: Located, choices: tuple[str, ...]) -> str:
        if isinstance(node, Scalar) and isinstance(node.value, str) and node.value in choices:
            return node.value
        close = (
            difflib.get_close_matches(node.value, list(choices), n=1)
            if isinstance(node, Scalar) and isinstance(node.value, str)
            else []
        )
        hint = f'did you mean "{close[0]}"?' if close else None
        self.fail(node.line, f"{dotted}: expected one of {', '.join(choices)}; got {describe(node)}", hint)

    # -- the settings that are not plain scalars ---------------------------------------------

    def variable_name(self, dotted: str, line: int | None, name: str) -> str:
        if VARIABLE_NAME_RE.match(name):
            return name
        hint = f"did you mean {name.upper()}?" if VARIABLE_NAME_RE.match(name.upper()) else _VARIABLE_HINT
        self.fail(line, f"{dotted}: {name!r} is not an NCCL variable name", hint)

    def set_variable(self, dotted: str, line: int | None, name: str) -> str:
        """A variable the config sets (a pin, a swept one): its name, which must also be on the
        allow-list of what may be published (names.unpublishable: not one of NCCL's identity
        variables), since a pin and a winning value are published.
        """
        name = self.variable_name(dotted, line, name)
        why = unpublishable(name)
        if why is not None:
            self.fail(line, f"{dotted}: {why}")
        return name

    def env_value(self, dotted: str, node: Located) -> str:
        """A value that will be exported to NCCL's environment: a string, or an int as written."""
        if isinstance(node, Scalar):
            v = node.value
            if isinstance(v, str):
                if not v:
                    self.fail(node.line, f"{dotted}: must not be empty")
                if "\0" in v or "\n" in v:
                    self.fail(node.line, f"{dotted}: must be a single line")
                return v
            if isinstance(v, int) and not isinstance(v, bool):
                if _PLAIN_INT_RE.match(node.text):
                    return node.text
                # YAML 1.1 reads 0x10, 0o7, 1_000 and 1:30 as integers; NCCL would get the
                # reprinted number, not what was written, so ask for quotes instead of guessing.
                self.fail(
                    node.line,
                    f"{dotted}: YAML reads {node.text} as the number {v}",
                    f'put the value in quotes: "{node.text}"',
                )
        self.fail(
            node.line,
            f"{dotted}: expected a string, got {describe(node)}",
            (
                f'put the value in quotes: "{node.text}"'
                if isinstance(node, Scalar) and node.value is not None
                else "NCCL variables take string values"
            ),
        )

    def var_list(self, dotted: str, node: Located) -> list[str]:
        if is_null(node):
            return []
        if not isinstance(node, Seq):
            self.fail(node.line, f"{dotted}: expected a list of variable names, got {describe(node)}")
        names: list[str] = []
        for i, item in enumerate(node.items):
            item_key = f"{dotted}[{i}]"
            if not (isinstance(item, Scalar) and isinstance(item.value, str)):
                self.fail(item.line, f"{item_key}: expected a variable name, got {describe(item)}")
            name = self.variable_name(item_key, item.line, item.value)
            if name in names:
                first = self.lines.get(f"{dotted}.{name}")
                self.fail(
                    item.line,
                    f"{dotted}: {name} is listed twice" + (f" (first at line {first})" if first else ""),
                )
            self.record(item_key, item.line)
            self.record(f"{dotted}.{name}", item.line)
            names.append(name)
        return names

    def pin(self, dotted: str, node: Located) -> dict[str, str]:
        if is_null(node):
            return {}
        if not isinstance(node, Map):
            self.fail(node.line, f"{dotted}: expected a mapping of variable: value, got {describe(node)}")
        pins: dict[str, str] = {}
        for entry in node.entries:
            child = join_key(dotted, entry.key)
            name = self.set_variable(child, entry.line, entry.key)
            self.record(child, entry.line)
            pins[name] = self.env_value(child, entry.value)
        return pins

    def variables(self, dotted: str, node: Located) -> dict[str, list[str]]:
        if is_null(node):
            return {}
        if not isinstance(node, Map):
            self.fail(node.line, f"{dotted}: expected a mapping of variable: [values], got {describe(node)}")
        result: dict[str, list[str]] = {}
        for entry in node.entries:
            child = join_key(dotted, entry.key)
            name = self.set_variable(child, entry.line, entry.key)
            self.record(child, entry.line)
            values_node = entry.value
            if not isinstance(values_node, Seq):
                self.fail(
                    values_node.line, f"{child}: expected a list of values, got {describe(values_node)}"
                )
            if not values_node.items:
                self.fail(
                    values_node.line,
                    f"{child}: the list of values is empty",
                    f"to skip {name}, list it in sweep.exclude",
                )
            values: list[str] = []
            for i, item in enumerate(values_node.items):
                item_key = f"{child}[{i}]"
                value = self.env_value(item_key, item)
                if value in values:
                    self.fail(item.line, f"{child}: the value {value!r} is listed twice")
                self.record(item_key, item.line)
                values.append(value)
            result[name] = values
        return result

    def profiles(self, dotted: str, node: Located) -> dict[str, ProfileWeights]:
        if is_null(node):
            return {}
        if not isinstance(node, Map):
            self.fail(
                node.line, f"{dotted}: expected a mapping of profile name: sizes, got {describe(node)}"
            )
        result: dict[str, ProfileWeights] = {}
        for entry in node.entries:
            child = join_key(dotted, entry.key)
            if not _PROFILE_NAME_RE.match(entry.key):
                self.fail(
                    entry.line,
                    f"{child}: {entry.key!r} is not a profile name",
                    "use letters, digits, - and _",
                )
            self.record(child, entry.line)
            weights_node = entry.value
            if not isinstance(weights_node, Map) or not weights_node.entries:
                self.fail(
                    weights_node.line,
                    f"{child}: expected a mapping of message size: weight, got {describe(weights_node)}",
                    'e.g. {"64KiB": 1, "16MiB": 2}, or per collective: {all_gather: {"16MiB": 1}}',
                )
            # Two forms: message size -> weight (all-reduce sizes), or collective -> {size: weight}.
            per_collective = any(
                w.key in COLLECTIVE_NAMES or isinstance(w.value, Map) for w in weights_node.entries
            )
            profile: ProfileWeights
            if per_collective:
                by_collective: dict[str, dict[int, float]] = {}
                for c in weights_node.entries:
                    c_key = f"{child}.{c.key}"
                    if c.key not in COLLECTIVE_NAMES:
                        close = difflib.get_close_matches(c.key, list(COLLECTIVE_NAMES), n=1)
                        self.fail(
                            c.line,
                            f"{c_key}: {c.key!r} is not a collective (known: {', '.join(COLLECTIVE_NAMES)})",
                            f'did you mean "{close[0]}"?' if close
                            else "a profile maps either sizes or collectives to weights, not both",
                        )
                    if not isinstance(c.value, Map) or not c.value.entries:
                        self.fail(
                            c.value.line,
                            f"{c_key}: expected a mapping of message size: weight, got {describe(c.value)}",
                            'e.g. {"1MiB": 1, "64MiB": 2}',
                        )
                    self.record(c_key, c.line)
                    by_collective[c.key] = self.size_weights(c_key, c.value)
                zero = not any(w for sizes in by_collective.values() for w in sizes.values())
                profile = by_collective
            else:
                sizes_only = self.size_weights(child, weights_node)
                zero = not any(sizes_only.values())
                profile = sizes_only
            if zero:
                self.fail(
                    weights_node.line,
                    f"{child}: every weight is zero",
                    "give at least one size a positive weight",
                )
            result[entry.key] = profile
        return result

    def size_weights(self, child: str, weights_node: Map) -> dict[int, float]:
        """message size -> weight, one mapping of a profile (`child` is its dotted key)."""
        weights: dict[int, float] = {}
        first_line: dict[int, int | None] = {}
        for w in weights_node.entries:
            try:
                size = parse_size(w.key)
            except ValueError as exc:
                self.fail(w.line, f"{child}: {exc}", _SIZE_HINT)
            size_key = f"{child}.{size}"
            if not 1 <= size <= MAX_MESSAGE_BYTES:
                self.fail(
                    w.line, f"{size_key}: sizes run from 1 byte to {format_size(MAX_MESSAGE_BYTES)}"
                )
            if size in weights:
                first = first_line[size]
                self.fail(
                    w.line,
                    f"{child}: {w.key} is the same size as an earlier key"
                    + (f" (line {first})" if first is not None else ""),
                )
            weight = self.number(size_key, w.value)
            self.check_range(size_key, w.value, weight, {"ge": 0})
            self.record(size_key, w.line)
            first_line[size] = w.line
            weights[size] = weight
        return weights

    def images(self, dotted: str, node: Located) -> list[str] | None:
        """bench.image: one image (a string, or a list of one), each by digest."""
        from ..errors import InputError
        from ..images import parse_image

        if is_null(node):
            return None
        items = node.items if isinstance(node, Seq) else [node]
        if len(items) != 1:
            self.fail(node.line, f"{dotted}: lists {len(items)} images; a sweep measures in one",
                      "sweep once per image, each with a config of its own")
        result = []
        for i, item in enumerate(items):
            ref = self.string(f"{dotted}[{i}]" if isinstance(node, Seq) else dotted, item)
            try:
                parse_image(ref, dotted)
            except InputError as exc:
                self.fail(item.line, exc.message, exc.hint)
            result.append(ref)
        return result

    def gpus(self, dotted: str, node: Located) -> list[int] | None:
        if is_null(node):
            return None
        if not isinstance(node, Seq):
            self.fail(node.line, f"{dotted}: expected a list of GPU indices, got {describe(node)}")
        if len(node.items) < 2:
            self.fail(
                node.line, f"{dotted}: needs at least two GPUs", "an all-reduce needs at least two ranks"
            )
        result: list[int] = []
        for i, item in enumerate(node.items):
            item_key = f"{dotted}[{i}]"
            index = self.integer(item_key, item)
            self.check_range(item_key, item, index, {"ge": 0})
            if index in result:
                self.fail(item.line, f"{dotted}: GPU {index} is listed twice")
            self.record(item_key, item.line)
            result.append(index)
        return result

    def absolute_path(self, dotted: str, node: Located) -> str | None:
        """A path that must not depend on the working or state directory (profile.path)."""
        if is_null(node):
            return None
        text = self.string(dotted, node)
        if not os.path.isabs(text):
            self.fail(node.line, f"{dotted}: must be an absolute path, got {text!r}",
                      "a class profile file, or a directory of <class id>.json profiles, e.g. "
                      "/etc/nccltune/profile/profile.json")
        return text

    def window(self, dotted: str, node: Located) -> str | None:
        if is_null(node):
            return None
        if not (isinstance(node, Scalar) and isinstance(node.value, str)):
            # An unquoted 22:00 is a YAML 1.1 base-60 integer (1320).
            self.fail(node.line, f"{dotted}: expected a time range, got {describe(node)}", _WINDOW_HINT)
        try:
            start, end = parse_window(node.value)
        except ValueError as exc:
            self.fail(node.line, f"{dotted}: {exc}", _WINDOW_HINT)
        return f"{start:%H:%M}-{end:%H:%M}"

    # -- rules that involve more than one key --------------------------------------------------

    def check(self, cfg: Config) -> None:
        b, s = cfg.bench, cfg.sweep
        if b.min_bytes > b.max_bytes:
            key = "bench.min_bytes" if "bench.min_bytes" in self.lines else "bench.max_bytes"
            self.fail_at(
                key,
                f"bench.min_bytes ({format_size(b.min_bytes)}) is larger than bench.max_bytes "
                f"({format_size(b.max_bytes)})",
            )
        if b.nranks is not None and b.gpus is not None and b.nranks > len(b.gpus):
            self.fail_at(
                "bench.nranks", f"bench.nranks is {b.nranks} but bench.gpus lists only {len(b.gpus)} GPUs"
            )
        # Each pair below asks for two different things for the same variable.
        conflicts = (
            ("pin", set(s.pin), "unpin", set(s.unpin)),
            ("pin", set(s.pin), "variables", set(s.variables)),
            ("pin", set(s.pin), "exclude", set(s.exclude)),
            ("exclude", set(s.exclude), "variables", set(s.variables)),
        )
        from ..sweep.space import CATALOGUE, unknown_variable_hint

        for name in s.exclude:
            if name not in CATALOGUE:
                # A typo here would sweep the variable the user meant to leave alone.
                self.fail_at(f"sweep.exclude.{name}", f"sweep.exclude: {name} is not a variable nccltune sweeps, "
                             "so excluding it changes nothing", unknown_variable_hint(name))
        for first, first_names, second, second_names in conflicts:
            for name in sorted(first_names & second_names):
                where = f"sweep.{second}.{name}"
                self.fail_at(
                    where if where in self.lines else f"sweep.{first}.{name}",
                    f"{name} is in both sweep.{first} and sweep.{second}",
                    "keep it in one of them",
                )


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


_SPECIAL: dict[str, Callable[[Builder, str, Located], object]] = {
    "bench.gpus": Builder.gpus,
    "bench.image": Builder.images,
    "sweep.profiles": Builder.profiles,
    "sweep.pin": Builder.pin,
    "sweep.unpin": Builder.var_list,
    "sweep.variables": Builder.variables,
    "sweep.exclude": Builder.var_list,
    "daemon.maintenance_window": Builder.window,
    "profile.path": Builder.absolute_path,
}
