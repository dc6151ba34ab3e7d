"""The env file that nccltune's NCCL env plugin reads: tuned variables per NCCL version and job shape.

The format is defined in nccltune_env.c's header comment (and docs/nccl-versions.md); this module
renders it and parses it with the same rules, so a file nccltune renders is one the plugin accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InputError
from .table import nccl_version_code, nccl_version_text

MAGIC = "nccltune-env-table"
FORMAT_VERSION = 1
MAX_BYTES = 64 * 1024
MAX_VALUES = 1024
MAX_SECTIONS = 64
MAX_LINE_BYTES = 512
MAX_NAME = 128
MAX_VALUE = 256
SCOPES = ("all", "single", "multi")  # any job; a job on one node; on two or more

_NAME = re.compile(r"NCCL_[A-Z0-9_]+")
_VALUE = re.compile(r"[\x21-\x22\x24-\x7e]+")  # printable, no space, no '#' (a comment would start)
_BAD_CHAR = re.compile(r"[^\t\x20-\x7e]")


@dataclass(frozen=True)
class EnvValue:
    """One tuned variable: in the section of NCCL `nccl`, for jobs of `scope`."""

    nccl: str
    scope: str
    name: str
    value: str


def value_problem(v: EnvValue) -> str | None:
    """What the plugin would refuse in one value, or None."""
    if nccl_version_code(v.nccl) is None:
        return f"NCCL version {v.nccl!r} is not major.minor.patch"
    if v.scope not in SCOPES:
        return f"unknown scope {v.scope!r} (all, single or multi)"
    if (not _NAME.fullmatch(v.name) or len(v.name) > MAX_NAME or v.name.endswith("_PLUGIN")
            or v.name.endswith("_FILE")):
        return (f"{v.name!r} is not a variable the env plugin answers (NCCL_ and capitals, digits, '_'; "
                "not *_PLUGIN or *_FILE)")
    if not _VALUE.fullmatch(v.value) or len(v.value) > MAX_VALUE:
        return f"{v.name}: value {v.value!r} is not one token of printable ASCII (no space, no '#', 1 to {MAX_VALUE})"
    return None


def _check(values: tuple[EnvValue, ...]) -> None:
    if len(values) > MAX_VALUES:
        raise ValueError(f"{len(values)} values, the env plugin reads at most {MAX_VALUES}")
    seen: dict[tuple[int, str], list[str]] = {}
    for i, v in enumerate(values):
        problem = value_problem(v)
        if problem is not None:
            raise ValueError(f"value {i}: {problem}")
        scopes = seen.setdefault((nccl_version_code(v.nccl) or 0, v.name), [])
        if v.scope in scopes or (scopes and "all" in (v.scope, *scopes)):
            raise ValueError(f"value {i}: {v.name} is already given for NCCL {v.nccl} ({', '.join(scopes)})")
        scopes.append(v.scope)
    if len({nccl_version_code(v.nccl) for v in values}) > MAX_SECTIONS:
        raise ValueError(f"more than {MAX_SECTIONS} NCCL versions")


def env_values(by_version: Mapping[str, Mapping[str, Mapping[str, str]]]) -> tuple[EnvValue, ...]:
    """{nccl version: {scope: {name: value}}} as values, in that order."""
    return tuple(EnvValue(nccl, scope, name, value) for nccl, scopes in by_version.items()
                 for scope, named in scopes.items() for name, value in named.items())


def render_env_file(values: tuple[EnvValue, ...]) -> str:
    """The file as the plugin reads it: one section per NCCL version, in first-seen order.

    Raises:
        ValueError: a value the plugin would refuse (named by its index).
    """
    _check(values)
    lines = [f"{MAGIC} {FORMAT_VERSION}"]
    for version in dict.fromkeys(v.nccl for v in values):
        lines += [f"nccl {nccl_version_text(nccl_version_code(version) or 0)}", "# scope name value"]
        lines += [f"{v.scope} {v.name} {v.value}" for v in values if v.nccl == version]
    lines.append(f"end {len(values)}")
    text = "\n".join(lines) + "\n"
    if len(text) > MAX_BYTES:
        raise ValueError(f"rendered env file is larger than {MAX_BYTES} bytes")
    return text


def parse_env_file(text: str, where: str) -> tuple[EnvValue, ...]:
    """Parse a whole env file; a problem raises InputError with where:line, as the plugin refuses it."""
    if len(text) > MAX_BYTES:
        raise InputError(where, f"larger than {MAX_BYTES} bytes")
    if not text.endswith("\n"):
        raise InputError(where, "truncated: the file does not end with a newline")
    values: list[EnvValue] = []
    section: str | None = None
    sections: list[int] = []
    state = "header"
    lineno = 0
    for lineno, raw in enumerate(text[:-1].split("\n"), start=1):
        def bad(message: str, line: int = lineno) -> InputError:
            return InputError(where, message, line=line)
        if len(raw) > MAX_LINE_BYTES:
            raise bad(f"line longer than {MAX_LINE_BYTES} bytes")
        if _BAD_CHAR.search(raw):
            raise bad("not printable ASCII")
        fields = raw.split("#", 1)[0].split()
        if state == "header":
            if fields != [MAGIC, str(FORMAT_VERSION)]:
                raise bad(f"not a nccltune env file of format version {FORMAT_VERSION}")
            state = "values"
            continue
        if not fields:
            continue
        if state == "end":
            raise bad("content after the 'end' line")
        if fields[0] == "nccl":
            code = nccl_version_code(fields[1]) if len(fields) == 2 else None
            if code is None:
                raise bad("expected 'nccl <major.minor.patch>' (a section's NCCL version)")
            if code in sections:
                raise bad(f"a second section for NCCL {fields[1]}")
            if len(sections) == MAX_SECTIONS:
                raise bad(f"more than {MAX_SECTIONS} sections")
            sections.append(code)
            section = nccl_version_text(code)
            continue
        if fields[0] == "end":
            if len(fields) != 2 or not fields[1].isdigit() or int(fields[1]) != len(values):
                raise bad(f"expected 'end {len(values)}' (the number of values)")
            state = "end"
            continue
        if section is None:
            raise bad("value before the first 'nccl <version>' section line")
        if len(fields) != 3:
            raise bad(f"expected 3 fields (scope name value), got {len(fields)}")
        value = EnvValue(section, *fields)
        problem = value_problem(value)
        if problem is not None:
            raise bad(problem)
        try:
            _check((*values, value))
        except ValueError as exc:
            raise bad(str(exc).split(": ", 1)[-1]) from exc
        values.append(value)
    if state != "end":
        raise InputError(where, "truncated: no 'end' line", line=lineno)
    return tuple(values)
