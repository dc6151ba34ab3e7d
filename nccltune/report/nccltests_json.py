"""nccl-tests' JSON document (`all_reduce_perf -J FILE.json`, format version 3), both ways.

Writing: one run of nccltune's (a trial, or one setting's trials) as the document a `*_perf`
binary would write for it, so that tools that read nccl-tests' output read nccltune's numbers.
Reading: a document from a `*_perf` run on this node, checked key by key, into the history as
a run of kind "import" (`store.RunKind`), so that `report`, `history` and `compare` show it beside
nccltune's own runs. No reader that takes a sweep's result (verify's expectations, the upgrade
gate, metrics, export, publish) asks for that kind.

The document, as nccl-tests 2.19 writes it (src/util.cu, one object, keys in this order):
  version (3), start_time and end_time ("%Y-%m-%d %H:%M:%S", local time), args (argv), env (the
  whole process environment, "NAME=VALUE"), nccl_version (NCCL's version code: 22809 is 2.28.9),
  config {nthreads, ngpus, minimum_bytes, maximum_bytes, step_factor or step_bytes, warmup_iters,
  iterations, aggregated_iterations, validation, graph, blocking_collectives, per_iter_timing,
  per_iter_skip, parallel_init, devices [{rank, group, pid, hostname, device, device_hex,
  device_info}]}, results [one per size: size (bytes, the larger of one rank's send and receive
  buffers), count (elements), type, redop, root (a 6-wide text column, "    -1" for none),
  out_of_place and in_place {time or cpu_time (us), alg_bw, bus_bw (GB/s, 1e9 B/s), nwrong (wrong
  elements; null when not checked)}, optional *_per_iter statistics, actual_iterations,
  experiment_name], out_of_bounds {count, okay}, average_bus_bandwidth {bandwidth, okay},
  errors [].
Its writer prints doubles with six decimals, NaN as the string "nan", and booleans as the
strings "true"/"false". Ranks: nthreads x ngpus x len(devices) (a `-g N` run lists its first
device only; an MPI run one device per process).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, NoReturn

from .. import __version__
from ..collectives import COLLECTIVES, NAMES, Collective, by_perf_binary
from ..collectives import get as get_collective
from ..compare import Side, side_trials
from ..errors import CheckFailed, InputError, UsageError
from ..files.inputfile import loads_strict, read_input_file
from ..names import DEMO_LABEL, VARIABLE_NAME_RE
from ..publish import PATH_VARIABLES, check_names, validate_env
from ..records import Measurement
from ..store import ImportSummary, RunBackend, RunRecord, Store, TrialRecord, VerifySummary

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
MAX_DOCUMENT_BYTES = 64 << 20  # per-iteration times of a long ladder stay far below this
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # start_time and end_time, local time as nccl-tests writes them
ELEMENT_TYPE = "float"  # nccltune's worker measures float32 only
Placement = Literal["out_of_place", "in_place"]
PLACEMENTS: tuple[Placement, ...] = ("out_of_place", "in_place")
PLACEMENT_WORDS: dict[Placement, str] = {"out_of_place": "out of place", "in_place": "in place"}
# The key of nccltune's own block in the documents it writes (provenance; nccl-tests readers skip it).
OWN_KEY = "nccltune"


# ---------------------------------------------------------------------------------------------
# NCCL's version code


def version_code(version: str | None) -> int | None:
    """"2.28.9" -> 22809, NCCL's NCCL_VERSION_CODE (major x 1000 before 2.9); None when unknown."""
    if not version:
        return None
    parts = version.split("+", 1)[0].split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    major, minor, patch = (int(p) for p in parts)
    if major > 2 or (major == 2 and minor >= 9):
        return major * 10000 + minor * 100 + patch
    return major * 1000 + minor * 100 + patch


def version_of_code(code: int) -> str:
    """22809 -> "2.28.9" (codes below 10000 are the pre-2.9 form, 2708 -> "2.7.8")."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


# ---------------------------------------------------------------------------------------------
# One size of one placement


@dataclass(frozen=True)
class PerfResult:
    """One size measured in one placement: nccl-tests' time, algbw, busbw and #wrong columns.
    `nwrong` counts wrong elements; None where the result was not checked (`-c 0`)."""

    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    nwrong: int | None


def placement_of(run: RunRecord, trial: TrialRecord) -> Placement:
    """Whether a trial measured out of place or in place: an imported trial says so itself; a
    trial of nccltune's worker measures as its run's method says (out of place through NCCL, in
    place through torch.distributed, which the CPU demo uses)."""
    stored = (trial.nccl or {}).get("placement")
    if stored in PLACEMENTS:
        return "in_place" if stored == "in_place" else "out_of_place"
    method = run.outcome.method or ""
    if method:
        return "in_place" if method.startswith("in-place") else "out_of_place"
    return "in_place" if run.backend == "gloo" else "out_of_place"


def _nwrong(trial: TrialRecord, m: Measurement) -> int | None:
    """Wrong elements at a size: an imported trial kept nccl-tests' count; nccltune's worker
    records whether a size was right, so a wrong one counts as one element (at least one was)."""
    nccl = trial.nccl or {}
    if "nwrong" in nccl:
        if not nccl.get("checked", True):
            return None
        counts = nccl.get("nwrong") or {}
        return int(counts.get(str(m.size_bytes), 0)) if isinstance(counts, dict) else 0
    return 0 if m.correct else 1


def results_of(trials: Sequence[TrialRecord], collective: str) -> list[PerfResult]:
    """One result per size from the trials of one setting and placement. One trial gives its own
    numbers; several give the median busbw, algbw and time of their correct measurements (what
    `report` and `compare` show), and the wrong elements of all of them."""
    by_size: dict[int, list[tuple[Measurement, int | None]]] = {}
    for t in trials:
        for m in t.measurements:
            if m.collective == collective:
                by_size.setdefault(m.size_bytes, []).append((m, _nwrong(t, m)))
    out = []
    for size, got in sorted(by_size.items()):
        counts = [w for _m, w in got if w is not None]
        nwrong = sum(counts) if counts else None
        if len(got) == 1:
            m = got[0][0]
            out.append(PerfResult(size, m.time_us, m.algbw_gbps, m.busbw_gbps, nwrong))
            continue
        good = [m for m, _w in got if m.correct] or [m for m, _w in got]
        algbw = statistics.median(m.algbw_gbps for m in good)
        busbw = statistics.median(m.busbw_gbps for m in good)
        time_us = statistics.median(m.time_us for m in good)
        out.append(PerfResult(size, time_us, algbw, busbw, nwrong))
    return out


# ---------------------------------------------------------------------------------------------
# Writing


def _bool_text(value: bool) -> str:
    return "true" if value else "false"  # nccl-tests writes its booleans as strings


def _num(value: float) -> float:
    """A number as measured. nccl-tests prints six decimals (%lf); nccltune keeps every digit, so
    that a document read back gives the very numbers (a CPU demo's 0.0117 GB/s would lose 0.005%)."""
    return float(value)


def _local_time(iso: str | None, plus_s: float = 0.0) -> str | None:
    if not iso:
        return None
    return (datetime.fromisoformat(iso) + timedelta(seconds=plus_s)).astimezone().strftime(TIME_FORMAT)


def _iterations(run: RunRecord) -> tuple[int | None, int | None]:
    """(warm-up, timed) iterations per size of the run's trials."""
    if run.kind == "import":
        cfg = (run.config or {}).get("nccl_tests") or {}
        warm, iters = cfg.get("warmup_iters"), cfg.get("iterations")
        return (warm if isinstance(warm, int) else None, iters if isinstance(iters, int) else None)
    from ..node import DEMO_ITERS, DEMO_WARMUP

    if run.demo:
        return DEMO_WARMUP, DEMO_ITERS
    bench = (run.config or {}).get("bench") or {}
    warm, iters = bench.get("warmup_iters"), bench.get("iters")
    return (warm if isinstance(warm, int) else None, iters if isinstance(iters, int) else None)


def _step(sizes: Sequence[int]) -> dict[str, int]:
    """step_factor for a geometric ladder, step_bytes for an even one; nothing for one size or a
    ladder that is neither (nccl-tests' -f or -i could not have made it)."""
    if len(sizes) < 2 or sizes[0] <= 0:
        return {}
    if sizes[1] % sizes[0] == 0 and all(b == a * (sizes[1] // sizes[0]) for a, b in itertools.pairwise(sizes)):
        return {"step_factor": sizes[1] // sizes[0]}
    if all(b - a == sizes[1] - sizes[0] for a, b in itertools.pairwise(sizes)):
        return {"step_bytes": sizes[1] - sizes[0]}
    return {}


@dataclass(frozen=True)
class Selection:
    """The trials a document shows, and what they are in words."""

    trials: list[TrialRecord]
    what: str  # "trial 12", "the published setting (median of 3 trials)", ...


def select_trials(run: RunRecord, trials: Sequence[TrialRecord], *, trial_seq: int | None,
                  setting: Side) -> Selection:
    """One trial (`trial_seq`; an imported trial brings the other placement of its cycle), or the
    trials of one setting: NCCL's defaults or the published one, as `compare` takes them, both
    placements of an import.

    Raises:
        UsageError: no trial with that number in the run (exit 2).
        CheckFailed: the setting has no ok trial in this run (exit 1).
    """
    if trial_seq is not None:
        picked = [t for t in trials if t.seq == trial_seq]
        if not picked:
            seqs = [t.seq for t in trials]
            span = f"trials {min(seqs)}-{max(seqs)}" if seqs else "no trials"
            raise UsageError(f"run {run.id} has no trial {trial_seq} ({span})", hint=f"nccltune history --run {run.id}")
        cycle = (picked[0].nccl or {}).get("cycle")
        if run.kind == "import" and cycle is not None:
            picked += [t for t in trials if t.seq != trial_seq and (t.nccl or {}).get("cycle") == cycle]
        return Selection(picked, f"trial {trial_seq} ({picked[0].label})")
    if run.kind == "import":
        # Both placements, and cycles with wrong results too: the document shows what was imported.
        chosen = [t for t in trials if t.status in ("ok", "wrong_result") and t.measurements]
        cycles = len({(t.nccl or {}).get("cycle") for t in chosen})
        if not chosen:
            raise CheckFailed(f"import {run.id} has no trial with measurements")
        return Selection(chosen, "the imported document" + (f" (median of its {cycles} cycles)" if cycles > 1 else ""))
    chosen = side_trials(run, trials, setting)
    what = ("NCCL's defaults" if setting == "defaults" else "the published setting") if run.kind == "sweep" \
        else f"the {run.kind}'s setting"
    if not chosen:
        raise CheckFailed(f"run {run.id} has no ok trial of {what}", hint="--trial SEQ picks one trial")
    n = len(chosen)
    return Selection(chosen, what + (f" (median of {n} trials)" if n > 1 else f" (trial {chosen[0].seq})"))


def _common_env(trials: Sequence[TrialRecord]) -> dict[str, str]:
    """The variables every selected trial set alike (one setting's own variables)."""
    common = dict(trials[0].env) if trials else {}
    for t in trials[1:]:
        common = {k: v for k, v in common.items() if t.env.get(k) == v}
    return common


def run_document(run: RunRecord, trials: Sequence[TrialRecord], *, collective: str = "all_reduce",
                 trial_seq: int | None = None, setting: Side = "published") -> dict[str, Any]:
    """The nccl-tests document (format version 3) of one collective of a run: one trial, or one
    setting's trials (see `select_trials`); nccltune's provenance under OWN_KEY.

    Raises:
        UsageError: an unknown collective (the message lists the known ones) or trial.
        CheckFailed: the run did not measure that collective, or has no ok trial of the setting.
    """
    try:
        coll = get_collective(collective)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    measured = list(dict.fromkeys(m.collective for t in trials for m in t.measurements))
    if collective not in measured:
        raise CheckFailed(f"run {run.id} has no {collective} measurements (it measured "
                          f"{', '.join(measured) or 'nothing'})", hint="--collective NAME")
    selection = select_trials(run, trials, trial_seq=trial_seq, setting=setting)
    by_placement: dict[Placement, list[PerfResult]] = {}
    for placement in PLACEMENTS:
        group = [t for t in selection.trials if placement_of(run, t) == placement]
        rows = results_of(group, collective) if group else []
        if rows:
            by_placement[placement] = rows
    if not by_placement:
        raise CheckFailed(f"{selection.what} of run {run.id} has no {collective} measurements")
    recorded = run.outcome
    # An import keeps what the document said of its elements; nccltune's own run measured as its collective does.
    imported = recorded if isinstance(recorded, ImportSummary) else None
    nranks = run.nranks
    warmup, iters = _iterations(run)
    sizes = sorted({r.size_bytes for rows in by_placement.values() for r in rows})
    counts: dict[str, int] = (imported.counts if imported is not None else None) or {}
    results = []
    for size in sizes:
        if imported is not None:
            count: int | None = int(counts.get(str(size), size // 4))
        else:
            count = coll.counts(size, nranks or 1)[0] if nranks or not coll.split else None
        entry: dict[str, Any] = {
            "size": size, "count": count,
            "type": (imported.datatype or ELEMENT_TYPE) if imported is not None else ELEMENT_TYPE,
            "redop": (imported.redop or coll.perf_redop) if imported is not None else coll.perf_redop,
            "root": f"{coll.perf_root if imported is None or imported.root is None else imported.root:6d}",
        }
        for placement in PLACEMENTS:
            row = next((r for r in by_placement.get(placement, []) if r.size_bytes == size), None)
            entry[placement] = None if row is None else {
                "time": _num(row.time_us), "alg_bw": _num(row.algbw_gbps), "bus_bw": _num(row.busbw_gbps),
                "nwrong": None if row.nwrong is None else float(row.nwrong)}
        entry["actual_iterations"] = iters
        entry["experiment_name"] = ""
        results.append(entry)
    filled = [r for rows in by_placement.values() for r in rows]
    wrong = sum(1 for r in filled if r.nwrong)
    first = min(selection.trials, key=lambda t: t.started_at)
    last = max(selection.trials, key=lambda t: t.started_at)
    document: dict[str, Any] = (imported.document if imported is not None else None) or {}
    topo = run.topology or {}
    config: dict[str, Any] = {}
    if imported is not None:
        config = {k: v for k, v in ((run.config or {}).get("nccl_tests") or {}).items() if k != "devices"}
        devices = [d for d in topo.get("devices") or [] if isinstance(d, dict)]
    else:
        config = {"nthreads": 1, "ngpus": 1, "minimum_bytes": sizes[0], "maximum_bytes": sizes[-1], **_step(sizes),
                  "warmup_iters": warmup, "iterations": iters, "aggregated_iterations": 1, "validation": 1,
                  "graph": None, "blocking_collectives": None, "per_iter_timing": _bool_text(False),
                  "per_iter_skip": 0, "parallel_init": None}
        # One process per rank, as an MPI build of nccl-tests lists them (ranks = len(devices)).
        devices = [{"rank": r, "group": 0, "pid": None, "hostname": run.hostname if r == 0 or not topo.get("job")
                    else None, "device": None, "device_hex": None, "device_info": None}
                   for r in range(nranks or 0)]
    config["devices"] = devices
    args = (run.config or {}).get("args") if imported is not None else None
    return {
        "version": FORMAT_VERSION,
        "start_time": document.get("start_time") if imported is not None else _local_time(first.started_at),
        "args": list(args) if isinstance(args, list) else [coll.perf_binary],
        "env": [f"{k}={v}" for k, v in sorted(_common_env(selection.trials).items())],
        "nccl_version": version_code(run.nccl_version
                                     or (None if isinstance(recorded, VerifySummary) else recorded.nccl_version)),
        "config": config,
        "results": results,
        "out_of_bounds": {"count": wrong, "okay": _bool_text(wrong == 0)},
        "average_bus_bandwidth": {"bandwidth": _num(sum(r.busbw_gbps for r in filled) / len(filled)),
                                  "okay": "unchecked"},
        "errors": [],
        OWN_KEY: {
            "run_id": run.id, "run_kind": run.kind, "shows": selection.what,
            "trials": [t.seq for t in selection.trials], "collective": collective, "backend": run.backend,
            "demo": run.demo, "label": DEMO_LABEL if run.demo else None, "fingerprint": run.fingerprint,
            "method": recorded.method,
        },
        "end_time": (document.get("end_time") if imported is not None
                     else _local_time(last.started_at, last.wall_s or 0.0)),
    }


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class PerfDocument:
    """A checked nccl-tests document: what the history keeps of it."""

    path: str
    collective: str
    binary: str
    nranks: int
    nccl_version: str | None
    datatype: str
    redop: str
    root: int
    counts: dict[int, int]
    # One entry per cycle (`-N`: the ladder measured again), each placement's results in size order.
    cycles: list[dict[Placement, list[PerfResult]]]
    checked: bool  # config.validation != 0: #wrong was counted
    hostname: str
    devices: list[dict[str, Any]]
    env: dict[str, str]  # NCCL's and torch's NCCL variables only, never the rest of the environment
    config: dict[str, Any]
    args: list[str]
    start_time: str | None
    end_time: str | None
    out_of_bounds: dict[str, Any]
    average_bus_bandwidth: dict[str, Any]
    backend: RunBackend = "nccl-tests"
    demo: bool = False
    fingerprint: str | None = None  # a document nccltune wrote names the topology it measured
    source_run: int | None = None  # ... and the run it came from
    notes: list[str] = field(default_factory=list)

    @property
    def primary(self) -> Placement:
        """The placement compared with other runs: out of place where measured (nccl-tests'
        headline numbers), else in place."""
        return "out_of_place" if any("out_of_place" in c for c in self.cycles) else "in_place"


class _Reader:
    """Checks one parsed document, naming the file and the JSON path of the first bad element."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, message: str, hint: str | None = None) -> NoReturn:
        raise InputError(self.path, f"{where}: {message}", hint=hint)

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"expected an object, got {_kind(value)}")
        return value

    def key(self, obj: Mapping[str, Any], name: str, where: str) -> Any:
        if name not in obj:
            self.fail(where, f"missing key {name!r}")
        return obj[name]

    def int_(self, value: Any, where: str, *, minimum: int = 0, null: bool = False) -> int | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(where, f"expected a whole number of at least {minimum}, got {_kind(value)}")
        return value

    def str_(self, value: Any, where: str, *, null: bool = False) -> str | None:
        if value is None and null:
            return None
        if not isinstance(value, str):
            self.fail(where, f"expected text, got {_kind(value)}")
        return value

    def number(self, value: Any, where: str) -> float | None:
        """A finite number, or None for the "nan" nccl-tests writes where it has none."""
        if value == "nan":
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            self.fail(where, f"expected a number of at least 0, got {_kind(value)}")
        return float(value)


def _kind(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_ENV_HINT = "remove it from the document's env (or run the binary without it) and import again"


def parse_document(data: bytes, path: str, *, collective: str | None = None) -> PerfDocument:
    """Check an nccl-tests document (format version 3) and return what the history keeps.

    `collective` names the collective where args[0] is no `*_perf` binary nccltune knows (a
    renamed build); where it is one, both must agree.

    Raises:
        InputError: not JSON (with the line), another format version, or a missing or malformed
            key (named by its path, e.g. results[3].out_of_place.bus_bw), or an NCCL variable of its
            env that no setting may hold (an identity variable such as NCCL_HOSTID, one that names a
            file or a library, a value outside the safe alphabet) (exit 78).
    """
    r = _Reader(path)
    text = data.decode("utf-8", errors="replace")
    try:
        raw = loads_strict(text)
    except json.JSONDecodeError as exc:
        looks_like_table = "# nccl-tests version" in text or "# Collective test starting" in text
        raise InputError(path, f"not JSON ({exc.msg}, column {exc.colno})", line=exc.lineno,
                         hint="this is the binary's text output: run it with -J FILE.json and import that"
                         if looks_like_table else "import the document a *_perf binary wrote with -J FILE.json"
                         ) from None
    except ValueError as exc:
        raise InputError(path, f"not an nccl-tests document: {exc}") from None
    doc = r.obj(raw, "$")
    version = r.key(doc, "version", "$")
    if version != FORMAT_VERSION:
        r.fail("$.version", f"format version {_kind(version)}; nccltune reads version {FORMAT_VERSION} "
               "(nccl-tests 2.19 and later)")
    args = [r.str_(a, f"$.args[{i}]") or "" for i, a in enumerate(_list(r, doc, "args", "$"))]
    coll = _collective(r, args, collective)
    code = r.int_(r.key(doc, "nccl_version", "$"), "$.nccl_version", null=True)
    config = r.obj(r.key(doc, "config", "$"), "$.config")
    nthreads = r.int_(r.key(config, "nthreads", "$.config"), "$.config.nthreads", minimum=1) or 1
    ngpus = r.int_(r.key(config, "ngpus", "$.config"), "$.config.ngpus", minimum=1) or 1
    devices = [r.obj(d, f"$.config.devices[{i}]") for i, d in enumerate(_list(r, config, "devices", "$.config"))]
    if not devices:
        r.fail("$.config.devices", "empty: the document names no rank")
    for i, d in enumerate(devices):
        r.str_(d.get("hostname"), f"$.config.devices[{i}].hostname", null=True)
        r.str_(d.get("device_info"), f"$.config.devices[{i}].device_info", null=True)
    nranks = nthreads * ngpus * len(devices)
    validation = config.get("validation", 1)
    checked = not (isinstance(validation, int) and not isinstance(validation, bool) and validation == 0)
    env: dict[str, str] = {}
    for i, entry in enumerate(_list(r, doc, "env", "$")):
        name, sep, value = (r.str_(entry, f"$.env[{i}]") or "").partition("=")
        if sep and VARIABLE_NAME_RE.match(name):
            # Kept with the run's trials as the setting measured: held to the rules every published
            # setting meets (the allow-list of names, the value rule), and no variable that names a
            # file or loads code, which is the run's own and never a setting.
            source = f"{path}: $.env[{i}]"
            env.update(validate_env({name: value}, source=source))
            check_names({name: value}, source, hint=_ENV_HINT)
            if name in PATH_VARIABLES:
                raise InputError(source, f"{name}: names a file or a library of that run; nccltune keeps no such "
                                 "variable with a run", hint=_ENV_HINT)
    notes: list[str] = []
    group: tuple[str, str, int] | None = None
    cycles: list[dict[Placement, list[PerfResult]]] = []
    counts: dict[int, int] = {}
    last_size = -1
    for i, item in enumerate(_list(r, doc, "results", "$")):
        where = f"$.results[{i}]"
        res = r.obj(item, where)
        size = r.int_(r.key(res, "size", where), f"{where}.size") or 0
        count = r.int_(r.key(res, "count", where), f"{where}.count") or 0
        datatype = r.str_(r.key(res, "type", where), f"{where}.type") or ""
        redop = r.str_(r.key(res, "redop", where), f"{where}.redop") or ""
        root = _root(r, r.key(res, "root", where), f"{where}.root")
        if group is None:
            group = (datatype, redop, root)
        elif group != (datatype, redop, root):
            r.fail(where, f"type {datatype}, redop {redop}, root {root} after {group[0]}, {group[1]}, root {group[2]}: "
                   "the document measures several data types, operations or roots, and nccltune imports one",
                   hint="run the binary with one -d TYPE, one -o OP (and one -r ROOT for broadcast and reduce)")
        if size <= last_size or not cycles:
            cycles.append({})  # the ladder starts again: another cycle (-N)
        last_size = size
        counts[size] = count
        for placement in PLACEMENTS:
            got = _placement(r, res, placement, size, f"{where}.{placement}", checked, notes)
            if got is not None:
                cycles[-1].setdefault(placement, []).append(got)
    if not cycles or not any(cycles[0].values()):
        r.fail("$.results", "no result with numbers: nothing to import")
    assert group is not None
    _check_bus_factor(coll.name, nranks, cycles, notes)
    if not checked:
        notes.append("results were not checked (config.validation 0): every size counts as correct")
    start_time = r.str_(doc.get("start_time"), "$.start_time", null=True)
    end_time = r.str_(doc.get("end_time"), "$.end_time", null=True)
    own = doc.get(OWN_KEY)
    backend: RunBackend = "nccl-tests"
    demo, fingerprint, source_run = False, None, None
    if own is not None:
        own = r.obj(own, f"$.{OWN_KEY}")
        got_backend = own.get("backend")
        if got_backend not in ("nccl", "gloo", "nccl-tests"):
            r.fail(f"$.{OWN_KEY}.backend", f"expected nccl, gloo or nccl-tests, got {_kind(got_backend)}")
        backend = "nccl" if got_backend == "nccl" else "gloo" if got_backend == "gloo" else "nccl-tests"
        if not isinstance(own.get("demo"), bool):
            r.fail(f"$.{OWN_KEY}.demo", f"expected true or false, got {_kind(own.get('demo'))}")
        demo = bool(own["demo"])
        fingerprint = r.str_(own.get("fingerprint"), f"$.{OWN_KEY}.fingerprint", null=True)
        source_run = r.int_(own.get("run_id"), f"$.{OWN_KEY}.run_id", null=True)
    hostnames = [str(d["hostname"]) for d in devices if isinstance(d.get("hostname"), str)]
    return PerfDocument(
        path=path, collective=coll.name, binary=coll.perf_binary, nranks=nranks,
        nccl_version=version_of_code(code) if code else None, datatype=group[0], redop=group[1], root=group[2],
        counts=counts, cycles=cycles, checked=checked, hostname=hostnames[0] if hostnames else "unknown",
        devices=devices, env=env, config={k: v for k, v in config.items() if k != "devices"}, args=args,
        start_time=start_time, end_time=end_time,
        out_of_bounds=doc["out_of_bounds"] if isinstance(doc.get("out_of_bounds"), dict) else {},
        average_bus_bandwidth=doc["average_bus_bandwidth"] if isinstance(doc.get("average_bus_bandwidth"), dict)
        else {},
        backend=backend, demo=demo, fingerprint=fingerprint, source_run=source_run, notes=notes)


def _list(r: _Reader, obj: Mapping[str, Any], name: str, where: str) -> list[Any]:
    value = r.key(obj, name, where)
    if not isinstance(value, list):
        r.fail(f"{where}.{name}", f"expected a list, got {_kind(value)}")
    return value


def _collective(r: _Reader, args: Sequence[str], named: str | None) -> Collective:
    """The collective the document measured: its binary (args[0]), or `named` where that is no
    `*_perf` binary nccltune knows."""
    from_args = by_perf_binary(args[0]) if args else None
    if named is not None:
        try:
            chosen = get_collective(named)
        except ValueError as exc:
            raise UsageError(f"--collective: {exc}") from None
        if from_args is not None and from_args.name != chosen.name:
            r.fail("$.args[0]", f"{args[0]} measures {from_args.name}, not {chosen.name} (--collective)")
        return chosen
    if from_args is None:
        binaries = ", ".join(COLLECTIVES[n].perf_binary for n in NAMES)
        r.fail("$.args[0]", f"{_kind(args[0]) if args else 'no binary'} is not a *_perf binary nccltune knows "
               f"({binaries})", hint="--collective NAME says which collective a renamed binary measured")
    return from_args


def _root(r: _Reader, value: Any, where: str) -> int:
    """The root column: nccl-tests writes it as 6-wide text ("    -1"); a number is read too."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    r.fail(where, f"expected a rank number (as text), got {_kind(value)}")


def _placement(r: _Reader, res: Mapping[str, Any], placement: Placement, size: int, where: str, checked: bool,
               notes: list[str]) -> PerfResult | None:
    """One placement of one result; None where nccl-tests wrote none (null, or absent) or no number."""
    got = res.get(placement)
    if got is None:
        return None
    obj = r.obj(got, where)
    if "time" not in obj and "cpu_time" not in obj:
        r.fail(where, "missing key 'time' (or 'cpu_time', with -C 1)")
    time_key = "time" if "time" in obj else "cpu_time"
    time_us = r.number(r.key(obj, time_key, where), f"{where}.{time_key}")
    algbw = r.number(r.key(obj, "alg_bw", where), f"{where}.alg_bw")
    busbw = r.number(r.key(obj, "bus_bw", where), f"{where}.bus_bw")
    raw = r.key(obj, "nwrong", where)
    nwrong: int | None = None
    if raw is not None:
        value = r.number(raw, f"{where}.nwrong")
        if value is None or value != int(value):
            r.fail(f"{where}.nwrong", f"expected a whole count of wrong elements, got {_kind(raw)}")
        nwrong = int(value)
    if time_us is None or algbw is None or busbw is None or time_us <= 0:
        notes.append(f"{size} B {PLACEMENT_WORDS[placement]}: no time or bandwidth in the document (\"nan\" or 0); "
                     "left out")
        return None
    return PerfResult(size, time_us, algbw, busbw, nwrong if checked else None)


def _check_bus_factor(collective: str, nranks: int, cycles: Sequence[Mapping[Placement, Sequence[PerfResult]]],
                      notes: list[str]) -> None:
    """busbw / algbw is the collective's factor for the ranks the devices count; a document where
    it is not (NCCL_TESTS_SPLIT runs smaller communicators, or the binary was renamed) is imported
    with a warning, since its busbw then follows another definition."""
    factor = COLLECTIVES[collective].busbw_factor(nranks)
    for cycle in cycles:
        for rows in cycle.values():
            for row in rows:
                if row.algbw_gbps > 0 and abs(row.busbw_gbps - row.algbw_gbps * factor) > 1e-3 + 1e-3 * row.busbw_gbps:
                    text = (f"busbw/algbw is {row.busbw_gbps / row.algbw_gbps:.4f} at {row.size_bytes} B, not "
                            f"{factor:.4f} ({COLLECTIVES[collective].factor_kind} for {nranks} ranks of {collective})")
                    log.warning("%s", text)
                    notes.append(text)
                    return


def read_document(path: Path, *, collective: str | None = None) -> PerfDocument:
    """Read and check the document at `path`.

    Raises:
        InputError: unreadable, not a regular file, too large, or not a valid document (exit 78).
    """
    try:
        data = read_input_file(path, MAX_DOCUMENT_BYTES, "nccl-tests document")
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror or exc}") from None
    return parse_document(data, str(path), collective=collective)


def import_document(store: Store, doc: PerfDocument, *, fingerprint: str) -> int:
    """Store the document as a run of kind "import": one trial per cycle and placement (phase
    "import", the placement, cycle and #wrong counts under the trial's `nccl` record), a summary
    that says what it was. Returns the run's id."""
    run_id = store.start_run(
        kind="import", fingerprint=fingerprint, backend=doc.backend, demo=doc.demo, profile=None,
        nccl_version=doc.nccl_version, driver_version=None, torch_version=None, nccltune_version=__version__,
        hostname=doc.hostname, topology={"source": f"nccl-tests document {doc.path}", "nranks": doc.nranks,
                                         "devices": doc.devices},
        config={"nccl_tests": doc.config, "args": doc.args})
    seq = 0
    try:
        for k, cycle in enumerate(doc.cycles, 1):
            for placement in PLACEMENTS:
                rows = cycle.get(placement) or []
                if not rows:
                    continue
                seq += 1
                wrong = {str(row.size_bytes): row.nwrong for row in rows if row.nwrong}
                reason = (f"#wrong at {len(wrong)} size(s): " + ", ".join(f"{s} B: {n}" for s, n in wrong.items())
                          if wrong else None)
                store.add_trial(
                    run_id, seq=seq, phase="import", label=f"{doc.binary} {PLACEMENT_WORDS[placement]} #{k}",
                    env=doc.env, status="wrong_result" if wrong else "ok", reason=reason,
                    nccl={"placement": placement, "cycle": k, "nwrong": wrong, "checked": doc.checked},
                    measurements=[Measurement(size_bytes=row.size_bytes, time_us=row.time_us,
                                              algbw_gbps=row.algbw_gbps, busbw_gbps=row.busbw_gbps,
                                              correct=not row.nwrong, collective=doc.collective) for row in rows])
    except BaseException:
        store.finish_run(run_id, status="failed",
                         summary=ImportSummary(error="the import stopped before its last trial", trials=seq))
        raise
    sizes = sorted({row.size_bytes for c in doc.cycles for rows in c.values() for row in rows})
    placements = [p for p in PLACEMENTS if any(p in c for c in doc.cycles)]
    summary = ImportSummary(
        # What history shows: nccl-tests' own numbers, or a document nccltune wrote of one of its runs.
        chosen=f"{doc.binary} (nccl-tests)" if doc.source_run is None else
        f"{doc.binary} document of run {doc.source_run}",
        line=(f"imported {doc.path}: {doc.binary}, {doc.nranks} ranks, {len(sizes)} sizes, "
              f"{len(doc.cycles)} cycle(s), {' and '.join(PLACEMENT_WORDS[p] for p in placements)}"),
        source_file=doc.path, collective=doc.collective, binary=doc.binary, nranks=doc.nranks,
        placement=doc.primary, method=f"{PLACEMENT_WORDS[doc.primary].replace(' ', '-')}; {doc.binary} "
                                      "(nccl-tests document)",
        datatype=doc.datatype, redop=doc.redop, root=doc.root,
        counts={str(s): c for s, c in sorted(doc.counts.items())}, cycles=len(doc.cycles),
        nccl_version=doc.nccl_version, trials=seq, notes=tuple(doc.notes), not_measured={},
        document={"version": FORMAT_VERSION, "start_time": doc.start_time, "end_time": doc.end_time,
                  "out_of_bounds": doc.out_of_bounds, "average_bus_bandwidth": doc.average_bus_bandwidth},
    )
    store.finish_run(run_id, status="ok", summary=summary)
    log.info("imported %s as run %d", doc.path, run_id)
    return run_id
