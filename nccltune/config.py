"""The configuration file: `/etc/nccltune/config.yaml`, or the one given with `--config FILE`.

Every setting has a default, so a node without a config file works; every path the daemon
writes has a key here (and a command-line flag that goes through `with_overrides`), so that
nothing needs root in tests. The file is checked strictly: an unknown key, a value of the wrong
type or out of range, or a key written twice is an `InputError` (exit 78) naming the file, the
line and the dotted key, because a silently ignored typo in a tuning daemon's config shows up
only weeks later as a slower job.

The file is read with `yaml.compose` rather than `yaml.safe_load`: composed nodes keep their
line numbers, and a mapping node still holds both copies of a duplicated key, which
`safe_load` would silently collapse to the last one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import difflib
import functools
import logging
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, NamedTuple, NoReturn, TypeAlias, TypeVar, Union

import yaml
from yaml.constructor import ConstructorError, SafeConstructor

from .collectives import DEFAULT as DEFAULT_COLLECTIVE
from .collectives import NAMES as COLLECTIVE_NAMES
from .errors import InputError
from .inputfile import read_input_file
from .names import VARIABLE_NAME_RE, format_size

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_STATE_DIR",
    "MAX_MESSAGE_BYTES",
    "OVERRIDE_SOURCE",
    "VARIABLE_NAME_RE",
    "Backend",
    "BenchConfig",
    "Config",
    "DaemonConfig",
    "Engine",
    "ProfileConfig",
    "ProfileWeights",
    "PublishConfig",
    "Strategy",
    "SweepConfig",
    "TopologyConfig",
    "config_from_dict",
    "config_to_dict",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
    "parse_window",
    "profile_collectives",
    "setting_names",
    "with_overrides",
]

logger = logging.getLogger(__name__)

DEFAULT_CONFIG_PATH = Path("/etc/nccltune/config.yaml")
DEFAULT_STATE_DIR = "/var/lib/nccltune"

# Where errors point when the faulty value came from a command-line flag, not from a file.
OVERRIDE_SOURCE = "command line"

# Largest message size a sweep may measure. Each rank holds send and receive buffers of this
# size, so beyond it a trial risks running the GPU out of memory rather than measuring anything.
MAX_MESSAGE_BYTES = 16 * 2**30

# What the sweep's variables may be called. Whether a name is a tunable that nccltune knows is
# decided by the sweep catalogue, which can name the line thanks to Config.lines.

_PROFILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
# K/M/G/T are powers of 1024 as in nccl-tests' -b/-e arguments, the sizes users already write.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}
_AMBIGUOUS_UNITS = {"kb", "mb", "gb", "tb"}
_WINDOW_RE = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")
_PLAIN_INT_RE = re.compile(r"^[-+]?[0-9]+$")

_SIZE_HINT = 'write a byte count or a size like "64KiB", "16MiB", "1GiB"'
_WINDOW_HINT = 'write "HH:MM-HH:MM" in quotes, e.g. "01:00-05:00"; it may wrap midnight ("22:00-04:00")'
_VARIABLE_HINT = "variable names are NCCL_... or TORCH_NCCL_..., in capitals"

Backend = Literal["auto", "nccl", "gloo"]
Engine = Literal["torch", "nccl-tests"]
Strategy = Literal["staged", "exhaustive"]
TunerPlugin = Literal["auto", "nccltune", "keep"]

# One configured profile: message size -> weight (the sizes of all_reduce, the original form),
# or collective -> {message size -> weight}.
ProfileWeights: TypeAlias = dict[int, float] | dict[str, dict[int, float]]

_T = TypeVar("_T")
_S = TypeVar("_S")


# --------------------------------------------------------------------------------------------
# Sizes and windows


def parse_size(text: str | int) -> int:
    """Return the byte count of a size written as `4194304`, `"64KiB"`, `"16MiB"`, `"1GiB"`.

    Units are powers of 1024 (`KiB`, `MiB`, `GiB`, `TiB`, or `K`, `M`, `G`, `T` as nccl-tests
    writes them), case-insensitive. `KB`, `MB`, `GB` are refused because half the world reads
    them as powers of 1000. A fraction is accepted when it comes to whole bytes (`"1.5KiB"`).

    Raises:
        ValueError: the text is not a size, or it is negative or not a whole number of bytes.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size")
    number, unit = m.groups()
    key = unit.lower()
    if key in _AMBIGUOUS_UNITS:
        raise ValueError(f"{text!r} is ambiguous (1000 or 1024?): write {number}{unit[0].upper()}iB")
    if key not in _SIZE_UNITS:
        raise ValueError(f"{text!r} has an unknown unit {unit!r}")
    value = Fraction(number) * _SIZE_UNITS[key]
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def parse_window(text: str) -> tuple[_dt.time, _dt.time]:
    """Parse a maintenance window `"HH:MM-HH:MM"` into (start, end); end before start wraps midnight.

    Raises:
        ValueError: not of that form, not a time of day, or empty (start equals end).
    """
    m = _WINDOW_RE.match(text)
    if not m:
        raise ValueError(f'{text!r} is not of the form "HH:MM-HH:MM"')
    h1, m1, h2, m2 = (int(g) for g in m.groups())
    for hour, minute in ((h1, m1), (h2, m2)):
        if hour > 23 or minute > 59:
            raise ValueError(f"{hour:02d}:{minute:02d} is not a time of day")
    if (h1, m1) == (h2, m2):
        # Either "never" or "always"; neither is worth guessing. No window already means always.
        raise ValueError(f"{text!r} starts and ends at the same time")
    return _dt.time(h1, m1), _dt.time(h2, m2)


def profile_collectives(profile: Mapping[Any, Any]) -> dict[str, dict[int, float]]:
    """collective -> {size_bytes: weight} of one configured profile, in either form (a profile of
    sizes alone weighs all_reduce)."""
    out: dict[str, dict[int, float]] = {}
    for key, value in profile.items():
        if isinstance(value, Mapping):
            out[str(key)] = {int(size): float(weight) for size, weight in value.items()}
        else:
            out.setdefault(DEFAULT_COLLECTIVE, {})[int(key)] = float(value)
    return out


def _time_in_window(t: _dt.time, start: _dt.time, end: _dt.time) -> bool:
    # A time with a tzinfo cannot be compared with a naive one; the window is in local time.
    t = t.replace(tzinfo=None)
    if start < end:
        return start <= t < end
    return t >= start or t < end


# --------------------------------------------------------------------------------------------
# The schema: frozen dataclasses, one per section. Field metadata holds the range checks.


def _setting(
    default: _T,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    size: bool = False,
    why: str | None = None,
) -> _T:
    meta = {"ge": ge, "gt": gt, "le": le, "size": size, "why": why}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class PublishConfig:
    """Where the chosen settings are written. Relative paths are relative to state_dir."""

    # None: the state directory itself.
    dir: str | None = None
    # An NCCL conf file (e.g. /etc/nccl.conf) in which to keep a managed block; None: leave it alone.
    nccl_conf: str | None = None
    # node_exporter textfile collector directory; None: no metrics.
    metrics_dir: str | None = None
    # None: <state_dir>/ncclTopology.xml.
    topology_file: str | None = None
    # A CDI spec directory (/var/run/cdi on a Kubernetes node) to keep the published set in as the
    # CDI spec nccltune.io-tuning.json (nccltune.cdi); None: no CDI spec.
    cdi_dir: str | None = None


@dataclass(frozen=True)
class BenchConfig:
    """How one trial is measured."""

    # Interpreter that runs the worker; None: found automatically. Point it at the Python and
    # torch the cluster's jobs use, so that the NCCL measured is the NCCL they load.
    python: str | None = None
    # Who the benchmark ranks run as when nccltune is root (trials.credentials); None: the system
    # user nccltune that `nccltune install` creates (root, with a warning, where it does not exist).
    user: str | None = None
    backend: Backend = "auto"
    engine: Engine = "torch"
    nccl_tests_dir: str | None = None
    min_bytes: int = _setting(65536, ge=1, le=MAX_MESSAGE_BYTES, size=True)
    max_bytes: int = _setting(2**30, ge=1, le=MAX_MESSAGE_BYTES, size=True)
    factor: int = _setting(4, ge=2, why="each size is the previous one times factor")
    warmup_iters: int = _setting(5, ge=0)
    iters: int = _setting(20, ge=1)
    trial_timeout_s: float = _setting(180.0, gt=0)
    # None: every GPU (or every selected one in gpus).
    # 1: one rank per node, for sweeps over several nodes only (the sweep refuses it on one node).
    nranks: int | None = _setting(None, ge=1, why="a rank per node at least")
    gpus: list[int] | None = None


@dataclass(frozen=True)
class SweepConfig:
    """What is searched, and how a winner is chosen."""

    profile: str = "balanced"
    # name -> {size_bytes: weight} (all-reduce sizes), or name -> {collective: {size_bytes: weight}}:
    # how much each message size (of each collective) counts in the objective.
    profiles: dict[str, ProfileWeights] = field(default_factory=dict)
    strategy: Strategy = "staged"
    baseline_repeats: int = _setting(3, ge=2, why="the run-to-run noise needs at least two runs")
    finalist_repeats: int = _setting(3, ge=1)
    max_finalists: int = _setting(3, ge=1)
    pin: dict[str, str] = field(default_factory=dict)
    unpin: list[str] = field(default_factory=list)
    variables: dict[str, list[str]] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    min_gain_pct: float = _setting(1.0, ge=0)
    max_regression_pct: float = _setting(2.0, ge=0)
    # The TORCH_NCCL_ASYNC_ERROR_HANDLING value published with the tuning (0..3 in torch).
    async_error_handling: int = _setting(3, ge=0, le=3)
    force: bool = False


@dataclass(frozen=True)
class DaemonConfig:
    """When the service sweeps and verifies."""

    poll_interval_s: float = _setting(60.0, ge=1)
    quiet_period_s: float = _setting(300.0, ge=0)
    # "HH:MM-HH:MM" local time, may wrap midnight; None: any time.
    maintenance_window: str | None = None
    verify_interval_s: float = _setting(86400.0, ge=1)
    drift_threshold_pct: float = _setting(5.0, gt=0)
    sweep_on_start: bool = True

    @property
    def window(self) -> tuple[_dt.time, _dt.time] | None:
        """(start, end) of the maintenance window, or None when sweeps may run at any time.

        Raises:
            ValueError: a window that was not validated (a DaemonConfig built directly) is malformed.
        """
        if self.maintenance_window is None:
            return None
        return parse_window(self.maintenance_window)

    def in_window(self, t: _dt.time) -> bool:
        """Whether a sweep may start at local time t. Always true without a window."""
        window = self.window
        if window is None:
            return True
        return _time_in_window(t, *window)


@dataclass(frozen=True)
class TopologyConfig:
    # A recorded snapshot to use instead of reading NVML: for demos and tests.
    snapshot: str | None = None
    with_nics: bool = True


@dataclass(frozen=True)
class TunerConfig:
    """nccltune's NCCL tuner plugin and its per-size table."""

    # auto: use it unless NCCL_TUNER_PLUGIN is already set (a site's tuner, a net plugin's), then keep
    # that one; nccltune: replace an existing tuner (said loudly); keep: never set NCCL_TUNER_PLUGIN.
    plugin: TunerPlugin = "auto"


@dataclass(frozen=True)
class ProfileConfig:
    """A class profile (`nccltune fleet decide`) that the daemon keeps applied."""

    # An absolute path: a profile file, or a directory of profiles named <class id>.json (the
    # daemon takes the one of its own class). Config management, a shared filesystem or a
    # Kubernetes ConfigMap puts it there; the daemon applies it at start, on reload and whenever
    # the file changes. None: no class profile, the daemon publishes its own sweeps.
    path: str | None = None


@dataclass(frozen=True)
class MultinodeConfig:
    """Sweeps over several nodes (`sweep --nodes N`, `sweep --join` on the others)."""

    # The secret every node of the job holds (trials.launch.channel): `nccltune keygen` writes it,
    # the site copies it to the nodes; mode 0600, owned by root.
    key_file: str = "/etc/nccltune/multinode.key"


@dataclass(frozen=True)
class Config:
    """The whole configuration. Build it with load_config or with_overrides, which validate it;
    constructing it directly (in tests) trusts the values given."""

    state_dir: str = DEFAULT_STATE_DIR
    publish: PublishConfig = field(default_factory=PublishConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    multinode: MultinodeConfig = field(default_factory=MultinodeConfig)
    # The file it came from (None: built-in defaults), and the line of every key written there,
    # by dotted key ("bench.iters", "sweep.pin.NCCL_PROTO", "sweep.exclude[0]" and also
    # "sweep.exclude.NCCL_ALGO"), so that checks made elsewhere can still name file:line.
    # Neither takes part in equality: the same settings from two files are the same config.
    path: str | None = field(default=None, compare=False, metadata={"internal": True})
    lines: dict[str, int] = field(
        default_factory=dict, compare=False, repr=False, metadata={"internal": True}
    )

    def state_path(self, name: str) -> Path:
        """A file in the state directory."""
        return Path(self.state_dir) / name

    def _under_state(self, value: str | None) -> Path | None:
        return None if value is None else Path(self.state_dir) / value

    @property
    def publish_dir(self) -> Path:
        """Where nccl.sh and nccl.env go: publish.dir, or the state directory."""
        return self._under_state(self.publish.dir) or Path(self.state_dir)

    @property
    def topology_file(self) -> Path:
        """Where the NCCL topology XML goes: publish.topology_file, or <state_dir>/ncclTopology.xml."""
        return self._under_state(self.publish.topology_file) or self.state_path("ncclTopology.xml")

    @property
    def nccl_conf(self) -> Path | None:
        """The NCCL conf file holding a managed block, or None when that is off."""
        return self._under_state(self.publish.nccl_conf)

    @property
    def metrics_dir(self) -> Path | None:
        """The node_exporter textfile directory, or None when metrics are off."""
        return self._under_state(self.publish.metrics_dir)

    @property
    def cdi_dir(self) -> Path | None:
        """The CDI spec directory kept current after every publish, or None when that is off."""
        return self._under_state(self.publish.cdi_dir)

    @property
    def profile_path(self) -> Path | None:
        """The class profile the daemon keeps applied (profile.path), or None."""
        return None if self.profile.path is None else Path(self.profile.path)


class _Spec(NamedTuple):
    hint: Any
    meta: Mapping[str, Any]
    default: object


_SCHEMAS: dict[type, dict[str, _Spec]] = {}


def _schema(cls: type) -> dict[str, _Spec]:
    if cls in _SCHEMAS:
        return _SCHEMAS[cls]
    hints = typing.get_type_hints(cls)
    specs: dict[str, _Spec] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        specs[f.name] = _Spec(hints[f.name], f.metadata, default)
    _SCHEMAS[cls] = specs
    return specs


def _split_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return len(args) < len(typing.get_args(hint)), args[0]
    return False, hint


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def setting_names() -> tuple[str, ...]:
    """Every dotted setting name, in file order: ("state_dir", "publish.dir", ...)."""
    names: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, spec in _schema(cls).items():
            dotted = _join(prefix, name)
            if _is_section(spec.hint):
                walk(spec.hint, dotted)
            else:
                names.append(dotted)

    walk(Config, "")
    return tuple(names)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# --------------------------------------------------------------------------------------------
# A small tree of values with their lines, made from YAML nodes (load_config) or from Python
# values (with_overrides), so that both are validated by the same code.


@dataclass
class _Scalar:
    line: int | None
    value: object
    # As written: a YAML int is published as the user spelled it, not as Python reprints it.
    text: str


@dataclass
class _Seq:
    line: int | None
    items: list[_Node]


@dataclass
class _Entry:
    key: str
    line: int | None
    value: _Node


@dataclass
class _Map:
    line: int | None
    entries: list[_Entry]


_Node: TypeAlias = "_Scalar | _Seq | _Map"

_MERGE_TAG = "tag:yaml.org,2002:merge"


# Bounds on a config document: a real one is a few KiB with a few hundred nodes, nested a few
# levels. Beyond them it is a mistake or an attack (a 472-byte alias bomb expands to billions
# of nodes), refused before it costs time or memory.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_DEPTH = 64


def _from_yaml(
    node: yaml.Node, dotted: str, path: str, constructor: SafeConstructor, active: set[int],
    budget: list[int] | None = None,
) -> _Node:
    """Convert a composed YAML node; ``budget`` holds the nodes still allowed, aliases expanded.

    Raises:
        InputError: a self-referring alias, more than MAX_CONFIG_NODES nodes once aliases are
            expanded, or deeper than MAX_CONFIG_DEPTH (exit 78).
    """
    if budget is None:
        budget = [MAX_CONFIG_NODES]
    line = node.start_mark.line + 1
    where = dotted or "the top level"
    budget[0] -= 1
    if budget[0] < 0:
        raise InputError(path, f"{where}: more than {MAX_CONFIG_NODES} values once YAML aliases are expanded",
                         line=line, hint="an alias bomb, or a document that is no nccltune config")
    if len(active) >= MAX_CONFIG_DEPTH:
        raise InputError(path, f"{where}: nested deeper than {MAX_CONFIG_DEPTH} levels", line=line)
    if id(node) in active:
        # `&a [*a]` composes to a node that contains itself.
        raise InputError(path, f"{where}: a YAML alias refers to itself", line=line)
    if isinstance(node, yaml.ScalarNode):
        try:
            value = constructor.construct_object(node, deep=True)
        except (ConstructorError, ValueError) as exc:
            problem = exc.problem if isinstance(exc, ConstructorError) else str(exc)
            raise InputError(path, f"{where}: {problem}", line=line) from exc
        return _Scalar(line, value, node.value)
    active.add(id(node))
    try:
        if isinstance(node, yaml.SequenceNode):
            items = [
                _from_yaml(item, f"{dotted}[{i}]", path, constructor, active, budget)
                for i, item in enumerate(node.value)
            ]
            return _Seq(line, items)
        assert isinstance(node, yaml.MappingNode)
        entries: list[_Entry] = []
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
                raise InputError(
                    path,
                    f"{where}: YAML merge keys (<<) are not supported",
                    line=key_line,
                    hint="write the keys out",
                )
            if not isinstance(key_node, yaml.ScalarNode):
                raise InputError(path, f"{where}: a key must be a plain name", line=key_line)
            key = str(key_node.value)
            child = _join(dotted, key)
            if key in first_line:
                raise InputError(
                    path,
                    f"duplicate key {child} (first at line {first_line[key]})",
                    line=key_line,
                    hint="YAML would keep only the last one; remove the other",
                )
            first_line[key] = key_line
            entries.append(_Entry(key, key_line, _from_yaml(value_node, child, path, constructor, active, budget)))
        return _Map(line, entries)
    finally:
        active.discard(id(node))


def _from_python(value: object, dotted: str, line_of: Callable[[str], int | None]) -> _Node:
    line = line_of(dotted)
    if isinstance(value, Mapping):
        entries = []
        for k, v in value.items():
            child = _join(dotted, str(k))
            entries.append(_Entry(str(k), line_of(child), _from_python(v, child, line_of)))
        return _Map(line, entries)
    if isinstance(value, (list, tuple)):
        return _Seq(line, [_from_python(v, f"{dotted}[{i}]", line_of) for i, v in enumerate(value)])
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return _Scalar(line, value, str(value))


def _describe(node: _Node) -> str:
    if isinstance(node, _Seq):
        return "a list"
    if isinstance(node, _Map):
        return "a mapping"
    v = node.value
    if v is None:
        return "null (no value)"
    if isinstance(v, bool):
        return f"a boolean ({node.text})"
    if isinstance(v, int):
        return f"an integer ({node.text})"
    if isinstance(v, float):
        return f"a number ({node.text})"
    if isinstance(v, str):
        return f'a string ("{v}")'
    if isinstance(v, (_dt.date, _dt.datetime)):
        return f"a date ({node.text})"
    return f"a {type(v).__name__}"


def _is_null(node: _Node) -> bool:
    return isinstance(node, _Scalar) and node.value is None


def _suggest(key: str, prefix: str, cls: type) -> str:
    """A 'did you mean' for an unknown key: a close name here, or the same name in another section."""
    here = list(_schema(cls))
    # The exact name in another section first: `iters` at the top level means bench.iters, however
    # close it happens to look to a section name here.
    elsewhere = [name for name in setting_names() if name.rsplit(".", 1)[-1] == key]
    close = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    if close and not elsewhere:
        return f"did you mean {_join(prefix, close[0])}?"
    if not elsewhere:
        leaves = {name.rsplit(".", 1)[-1]: name for name in setting_names()}
        near = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
        elsewhere = [leaves[n] for n in near]
    if elsewhere:
        return f"did you mean {elsewhere[0]}?"
    return f"known keys {'under ' + prefix if prefix else 'at the top level'}: {', '.join(here)}"


# --------------------------------------------------------------------------------------------
# Validation


class _Builder:
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

    def build(self, root: _Node) -> Config:
        cfg = self.section(Config, root, "")
        self.check(cfg)
        return dataclasses.replace(cfg, path=self.path, lines=dict(self.lines))

    def section(self, cls: type[_S], node: _Node, prefix: str) -> _S:
        if _is_null(node):
            # `bench:` with every key below commented out.
            return cls()
        specs = _schema(cls)
        if not isinstance(node, _Map):
            where = prefix or "the top level"
            self.fail(
                node.line,
                f"{where}: expected a mapping of settings ({', '.join(specs)}), got {_describe(node)}",
                # `profile: large` means the sweep objective, which lives in the sweep section.
                "the sweep's objective is sweep.profile; profile.path names a class profile"
                if prefix == "profile" else None,
            )
        kwargs: dict[str, object] = {}
        for entry in node.entries:
            dotted = _join(prefix, entry.key)
            if entry.key not in specs:
                self.fail(entry.line, f"unknown key {dotted}", _suggest(entry.key, prefix, cls))
            self.record(dotted, entry.line)
            kwargs[entry.key] = self.value(dotted, specs[entry.key], entry.value)
        return cls(**kwargs)

    def value(self, dotted: str, spec: _Spec, node: _Node) -> object:
        special = _SPECIAL.get(dotted)
        if special is not None:
            return special(self, dotted, node)
        optional, base = _split_optional(spec.hint)
        if _is_section(base):
            return self.section(base, node, dotted)
        if _is_null(node):
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

    def check_range(self, dotted: str, node: _Node, value: float, meta: Mapping[str, Any]) -> None:
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

    def boolean(self, dotted: str, node: _Node) -> bool:
        if isinstance(node, _Scalar) and isinstance(node.value, bool):
            return node.value
        self.fail(node.line, f"{dotted}: expected true or false, got {_describe(node)}")

    def integer(self, dotted: str, node: _Node, *, size: bool = False) -> int:
        if isinstance(node, _Scalar):
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
            node.line, f"{dotted}: expected {expected}, got {_describe(node)}", _SIZE_HINT if size else None
        )

    def number(self, dotted: str, node: _Node) -> float:
        if isinstance(node, _Scalar):
            v = node.value
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if not math.isfinite(v):
                    self.fail(node.line, f"{dotted}: must be a finite number, got {node.text}")
                return float(v)
        self.fail(node.line, f"{dotted}: expected a number, got {_describe(node)}")

    def string(self, dotted: str, node: _Node) -> str:
        if isinstance(node, _Scalar) and isinstance(node.value, str):
            if not node.value.strip():
                self.fail(node.line, f"{dotted}: must not be empty", "leave the key out for the default")
            if "\0" in node.value or "\n" in node.value:
                self.fail(node.line, f"{dotted}: must be a single line")
            return node.value
        hint = None
        if isinstance(node, _Scalar) and isinstance(node.value, bool):
            hint = "YAML reads yes/no/on/off/true/false as booleans: put the value in quotes"
        self.fail(node.line, f"{dotted}: expected a string, got {_describe(node)}", hint)

    def choice(self, dotted: str, node: _Node, choices: tuple[str, ...]) -> str:
        if isinstance(node, _Scalar) and isinstance(node.value, str) and node.value in choices:
            return node.value
        close = (
            difflib.get_close_matches(node.value, list(choices), n=1)
            if isinstance(node, _Scalar) and isinstance(node.value, str)
            else []
        )
        hint = f'did you mean "{close[0]}"?' if close else None
        self.fail(node.line, f"{dotted}: expected one of {', '.join(choices)}; got {_describe(node)}", hint)

    # -- the settings that are not plain scalars ---------------------------------------------

    def variable_name(self, dotted: str, line: int | None, name: str) -> str:
        if VARIABLE_NAME_RE.match(name):
            return name
        hint = f"did you mean {name.upper()}?" if VARIABLE_NAME_RE.match(name.upper()) else _VARIABLE_HINT
        self.fail(line, f"{dotted}: {name!r} is not an NCCL variable name", hint)

    def env_value(self, dotted: str, node: _Node) -> str:
        """A value that will be exported to NCCL's environment: a string, or an int as written."""
        if isinstance(node, _Scalar):
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
            f"{dotted}: expected a string, got {_describe(node)}",
            (
                f'put the value in quotes: "{node.text}"'
                if isinstance(node, _Scalar) and node.value is not None
                else "NCCL variables take string values"
            ),
        )

    def var_list(self, dotted: str, node: _Node) -> list[str]:
        if _is_null(node):
            return []
        if not isinstance(node, _Seq):
            self.fail(node.line, f"{dotted}: expected a list of variable names, got {_describe(node)}")
        names: list[str] = []
        for i, item in enumerate(node.items):
            item_key = f"{dotted}[{i}]"
            if not (isinstance(item, _Scalar) and isinstance(item.value, str)):
                self.fail(item.line, f"{item_key}: expected a variable name, got {_describe(item)}")
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

    def pin(self, dotted: str, node: _Node) -> dict[str, str]:
        if _is_null(node):
            return {}
        if not isinstance(node, _Map):
            self.fail(node.line, f"{dotted}: expected a mapping of variable: value, got {_describe(node)}")
        pins: dict[str, str] = {}
        for entry in node.entries:
            child = _join(dotted, entry.key)
            name = self.variable_name(child, entry.line, entry.key)
            self.record(child, entry.line)
            pins[name] = self.env_value(child, entry.value)
        return pins

    def variables(self, dotted: str, node: _Node) -> dict[str, list[str]]:
        if _is_null(node):
            return {}
        if not isinstance(node, _Map):
            self.fail(node.line, f"{dotted}: expected a mapping of variable: [values], got {_describe(node)}")
        result: dict[str, list[str]] = {}
        for entry in node.entries:
            child = _join(dotted, entry.key)
            name = self.variable_name(child, entry.line, entry.key)
            self.record(child, entry.line)
            values_node = entry.value
            if not isinstance(values_node, _Seq):
                self.fail(
                    values_node.line, f"{child}: expected a list of values, got {_describe(values_node)}"
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

    def profiles(self, dotted: str, node: _Node) -> dict[str, ProfileWeights]:
        if _is_null(node):
            return {}
        if not isinstance(node, _Map):
            self.fail(
                node.line, f"{dotted}: expected a mapping of profile name: sizes, got {_describe(node)}"
            )
        result: dict[str, ProfileWeights] = {}
        for entry in node.entries:
            child = _join(dotted, entry.key)
            if not _PROFILE_NAME_RE.match(entry.key):
                self.fail(
                    entry.line,
                    f"{child}: {entry.key!r} is not a profile name",
                    "use letters, digits, - and _",
                )
            self.record(child, entry.line)
            weights_node = entry.value
            if not isinstance(weights_node, _Map) or not weights_node.entries:
                self.fail(
                    weights_node.line,
                    f"{child}: expected a mapping of message size: weight, got {_describe(weights_node)}",
                    'e.g. {"64KiB": 1, "16MiB": 2}, or per collective: {all_gather: {"16MiB": 1}}',
                )
            # Two forms: message size -> weight (all-reduce sizes), or collective -> {size: weight}.
            per_collective = any(
                w.key in COLLECTIVE_NAMES or isinstance(w.value, _Map) for w in weights_node.entries
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
                    if not isinstance(c.value, _Map) or not c.value.entries:
                        self.fail(
                            c.value.line,
                            f"{c_key}: expected a mapping of message size: weight, got {_describe(c.value)}",
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

    def size_weights(self, child: str, weights_node: _Map) -> dict[int, float]:
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

    def gpus(self, dotted: str, node: _Node) -> list[int] | None:
        if _is_null(node):
            return None
        if not isinstance(node, _Seq):
            self.fail(node.line, f"{dotted}: expected a list of GPU indices, got {_describe(node)}")
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

    def absolute_path(self, dotted: str, node: _Node) -> str | None:
        """A path that must not depend on the working or state directory (profile.path)."""
        if _is_null(node):
            return None
        text = self.string(dotted, node)
        if not os.path.isabs(text):
            self.fail(node.line, f"{dotted}: must be an absolute path, got {text!r}",
                      "a class profile file, or a directory of <class id>.json profiles, e.g. "
                      "/etc/nccltune/profile/profile.json")
        return text

    def window(self, dotted: str, node: _Node) -> str | None:
        if _is_null(node):
            return None
        if not (isinstance(node, _Scalar) and isinstance(node.value, str)):
            # An unquoted 22:00 is a YAML 1.1 base-60 integer (1320).
            self.fail(node.line, f"{dotted}: expected a time range, got {_describe(node)}", _WINDOW_HINT)
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
        from .sweep.space import CATALOGUE, unknown_variable_hint

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


_SPECIAL: dict[str, Callable[[_Builder, str, _Node], object]] = {
    "bench.gpus": _Builder.gpus,
    "sweep.profiles": _Builder.profiles,
    "sweep.pin": _Builder.pin,
    "sweep.unpin": _Builder.var_list,
    "sweep.variables": _Builder.variables,
    "sweep.exclude": _Builder.var_list,
    "daemon.maintenance_window": _Builder.window,
    "profile.path": _Builder.absolute_path,
}


# --------------------------------------------------------------------------------------------
# Public entry points


def parse_config(text: str, path: str = "<config>") -> Config:
    """Parse and validate a config document; `path` names it in messages.

    Raises:
        InputError: YAML syntax error (with its line), or any fault in the settings (exit 78).
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise InputError(path, f"larger than {MAX_CONFIG_BYTES} bytes; not an nccltune config")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError as exc:
        raise InputError(path, "nested too deeply to read") from exc
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        if exc.context and exc.problem and exc.context_mark is not None:
            problem += f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise InputError(path, f"not valid YAML: {problem}", line=mark.line + 1 if mark else None) from exc
    except yaml.YAMLError as exc:
        raise InputError(path, f"not valid YAML: {exc}") from exc
    if root is None:
        return Config(path=path)
    node = _from_yaml(root, "", path, SafeConstructor(), set())
    return _Builder(path, path).build(node)


def load_config(path: Path | str | None, *, required: bool = False) -> Config:
    """Load the config file at path.

    None gives the built-in defaults. A missing file gives the defaults too, unless required
    (the user named it with --config, so its absence is a mistake, not a choice). An empty file
    is the defaults.

    Raises:
        InputError: a required file is missing, the file cannot be read, is not UTF-8 or not
            valid YAML, or a setting is unknown, duplicated, mistyped or out of range (exit 78).
    """
    if path is None:
        return Config()
    p = Path(path)
    name = str(p)
    try:
        raw = read_input_file(p, MAX_CONFIG_BYTES, "config file", trusted=True)
    except (FileNotFoundError, NotADirectoryError) as exc:
        if required:
            raise InputError(
                name,
                "config file not found",
                hint="check the --config path, or leave it out for the defaults",
            ) from exc
        logger.debug("no config file at %s; using the defaults", name)
        return Config()
    except OSError as exc:
        raise InputError(name, f"cannot read: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(name, "not UTF-8 text", line=raw[: exc.start].count(b"\n") + 1) from exc
    cfg = parse_config(text, name)
    logger.debug("loaded config %s", name)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The settings as plain JSON-able values, in file layout (no path, no lines).

    Message sizes in profiles become string keys ("65536"), as JSON requires; config_from_dict
    and the loader read them back.
    """

    def plain(value: object) -> Any:
        if _is_section(type(value)):
            return {name: plain(getattr(value, name)) for name in _schema(type(value))}
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    result: dict[str, Any] = plain(cfg)
    return result


def config_from_dict(data: Mapping[str, object], *, source: str = "<dict>") -> Config:
    """Validate plain values in file layout (what config_to_dict gives) into a Config.

    Raises:
        InputError: as for a file, naming `source` instead of a file and line (exit 78).
    """
    return _Builder(None, source).build(_from_python(data, "", lambda _dotted: None))


def with_overrides(cfg: Config, **dotted: object) -> Config:
    """cfg with some settings replaced, by dotted key, validated as the loader would.

    `with_overrides(cfg, **{"state_dir": "/tmp/x", "sweep.profile": "large"})`. A key may reach
    into a mapping setting ("sweep.pin.NCCL_PROTO") or replace a whole section ("bench"). None
    sets an optional setting back to None. Lines from the file are kept for the settings not
    overridden, so a later error about them still names file:line.

    Raises:
        InputError: an unknown key, or a value the loader would refuse; named as coming from
            the command line (exit 78).
    """
    if not dotted:
        return cfg
    data = config_to_dict(cfg)
    for key, value in dotted.items():
        _set_dotted(data, key, value)
    overridden = list(dotted)

    def line_of(name: str) -> int | None:
        for key in overridden:
            if name == key or name.startswith((key + ".", key + "[")):
                return None
        return cfg.lines.get(name)

    return _Builder(cfg.path, OVERRIDE_SOURCE).build(_from_python(data, "", line_of))


def _set_dotted(data: dict[str, Any], key: str, value: object) -> None:
    parts = key.split(".")
    cls: type | None = Config
    target = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if cls is not None:
            specs = _schema(cls)
            if part not in specs:
                near = difflib.get_close_matches(key, list(setting_names()), n=1, cutoff=0.6)
                raise InputError(
                    OVERRIDE_SOURCE,
                    f"unknown setting {key}",
                    hint=f"did you mean {near[0]}?" if near else None,
                )
            _, base = _split_optional(specs[part].hint)
            if _is_section(base):
                cls = base
            elif typing.get_origin(base) is dict:
                cls = None  # below here, keys are the user's own (variable or profile names)
            elif not last:
                raise InputError(
                    OVERRIDE_SOURCE, f"unknown setting {key}: {'.'.join(parts[: i + 1])} has no sub-keys"
                )
        if last:
            target[part] = value
            return
        child = target.get(part)
        if not isinstance(child, dict):
            child = {}
            target[part] = child
        target = child
