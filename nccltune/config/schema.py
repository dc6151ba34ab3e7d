"""The settings: one frozen dataclass per section of the config file, with every default and
range check, the values they are written in (message sizes, maintenance windows), and the
reflection the loader and the builder walk (`settings_of`, `setting_names`)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeAlias, TypeVar, Union

from ..collectives import DEFAULT as DEFAULT_COLLECTIVE

DEFAULT_CONFIG_PATH = Path("/etc/nccltune/config.yaml")
DEFAULT_STATE_DIR = "/var/lib/nccltune"

# Where errors point when the faulty value came from a command-line flag, not from a file.
OVERRIDE_SOURCE = "command line"

# Largest message size a sweep may measure. Each rank holds send and receive buffers of this
# size, so beyond it a trial risks running the GPU out of memory rather than measuring anything.
MAX_MESSAGE_BYTES = 16 * 2**30
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

Backend = Literal["auto", "nccl", "gloo"]
Engine = Literal["torch", "nccl-tests"]
Runtime = Literal["auto", "podman", "docker", "enroot"]
Strategy = Literal["staged", "exhaustive"]
TunerPlugin = Literal["auto", "nccltune", "keep"]

# One configured profile: message size -> weight (the sizes of all_reduce, the original form),
# or collective -> {message size -> weight}.
ProfileWeights: TypeAlias = dict[int, float] | dict[str, dict[int, float]]

_T = TypeVar("_T")


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
    # CDI spec nccltune.io-tuning.json (nccltune.publish.cdi); None: no CDI spec.
    cdi_dir: str | None = None
    # A Node Feature Discovery feature file to keep the node's class, published state and outlier
    # verdict in, as NFD's node labels (nccltune.delivery.nodefeatures); None: none.
    node_features_file: str | None = None


@dataclass(frozen=True)
class BenchConfig:
    """How one trial is measured."""

    # Interpreter that runs the worker; None: found automatically. Point it at the Python and
    # torch the cluster's jobs use, so that the NCCL measured is the NCCL they load.
    python: str | None = None
    # Who the benchmark ranks run as when nccltune is root (trials.credentials); None: the system
    # user nccltune that `nccltune install` creates (root, with a warning, where it does not exist).
    user: str | None = None
    # The job's image, by digest (NAME@sha256:HEX): the worker runs in it with the image's python3,
    # so the NCCL measured is the one the jobs load (trials/container.py). None: bench.python.
    image: list[str] | None = None
    # What runs bench.image: podman, docker, enroot, or auto (the first of those on PATH).
    runtime: Runtime = "auto"
    backend: Backend = "auto"
    engine: Engine = "torch"
    nccl_tests_dir: str | None = None
    min_bytes: int = _setting(65536, ge=1, le=MAX_MESSAGE_BYTES, size=True)
    max_bytes: int = _setting(2**30, ge=1, le=MAX_MESSAGE_BYTES, size=True)
    factor: int = _setting(4, ge=2, why="each size is the previous one times factor")
    warmup_iters: int = _setting(5, ge=0)
    iters: int = _setting(20, ge=1)
    trial_timeout_s: float = _setting(180.0, gt=0)
    # Fork each trial's ranks on this node from one process per sweep that has imported torch
    # (trials/rankserver.py), which saves every rank torch's import; false: start each rank by exec.
    fork_ranks: bool = True
    # Ranks that share one GPU (verify's check on a one-GPU node) run under a CUDA MPS control
    # daemon nccltune starts for them (trials/mps.py), concurrently instead of time-sliced.
    mps: bool = True
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
    # The sequential final check's ceiling: rounds are added up to this many only while a finalist
    # is undecided (below finalist_repeats: no rounds are added).
    max_finalist_repeats: int = _setting(8, ge=1)
    # The final check's trials at most (every finalist's and the defaults' runs of its rounds): the
    # rounds of a look after the first are added only when they fit. 0: no bound.
    max_final_trials: int = _setting(0, ge=0)
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

    # The secret every node of the job holds (trials.launch.sealing): `nccltune keygen` writes it,
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
    def cdi_dir(self) -> Path | None:
        """The CDI spec directory kept current after every publish, or None when that is off."""
        return self._under_state(self.publish.cdi_dir)

    @property
    def node_features_file(self) -> Path | None:
        """The NFD feature file rewritten with the metrics, or None when that is off."""
        return self._under_state(self.publish.node_features_file)

    @property
    def nccl_conf(self) -> Path | None:
        """The NCCL conf file holding a managed block, or None when that is off."""
        return self._under_state(self.publish.nccl_conf)

    @property
    def metrics_dir(self) -> Path | None:
        """The node_exporter textfile directory, or None when metrics are off."""
        return self._under_state(self.publish.metrics_dir)

    def written_dirs(self) -> tuple[Path, ...]:
        """Every directory nccltune may write in under this config: the state and publish
        directories, the topology copy's, the CDI spec directory, the NCCL conf file's (its block is
        replaced by a rename there), the metrics textfile directory and the NFD feature file's (it is
        replaced by a rename there too); one below another listed
        is left out. The one list the units' ReadWritePaths= is made from (install.py)."""
        dirs = [Path(self.state_dir), self.publish_dir, self.topology_file.parent]
        features = self.node_features_file.parent if self.node_features_file else None
        conf = self.nccl_conf.parent if self.nccl_conf else None
        dirs += [d for d in (self.cdi_dir, conf, self.metrics_dir, features) if d]
        unique = list(dict.fromkeys(dirs))
        return tuple(d for d in unique if not any(o != d and d.is_relative_to(o) for o in unique))

    @property
    def profile_path(self) -> Path | None:
        """The class profile the daemon keeps applied (profile.path), or None."""
        return None if self.profile.path is None else Path(self.profile.path)


class Spec(NamedTuple):
    hint: Any
    meta: Mapping[str, Any]
    default: object


_SCHEMAS: dict[type, dict[str, Spec]] = {}


def settings_of(cls: type) -> dict[str, Spec]:
    if cls in _SCHEMAS:
        return _SCHEMAS[cls]
    hints = typing.get_type_hints(cls)
    specs: dict[str, Spec] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        specs[f.name] = Spec(hints[f.name], f.metadata, default)
    _SCHEMAS[cls] = specs
    return specs


def split_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return len(args) < len(typing.get_args(hint)), args[0]
    return False, hint


def is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def setting_names() -> tuple[str, ...]:
    """Every dotted setting name, in file order: ("state_dir", "publish.dir", ...)."""
    names: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, spec in settings_of(cls).items():
            dotted = join_key(prefix, name)
            if is_section(spec.hint):
                walk(spec.hint, dotted)
            else:
                names.append(dotted)

    walk(Config, "")
    return tuple(names)


def join_key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
