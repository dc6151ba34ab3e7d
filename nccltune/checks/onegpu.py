"""What `nccltune verify` checks on a node with one GPU: what NCCL runs for the job shapes N x 1
that the published tuner table holds.

Every job that spans one-GPU nodes is multi-node (N nodes x 1 rank), and a class profile for such
a shape carries a tuner table for it. This node alone cannot run such a job, but NCCL takes ranks
whose NCCL_HOSTID differ for ranks on different hosts: N rank processes on the one GPU, each its
own host id (trials/launch/hosts.py), form an N-node communicator over NCCL's socket transport.
For each shape N x 1 the table holds (N up to MAX_HOSTS), one trial of N such ranks runs with the
published environment of a job of N nodes (its plugin and table included) at sizes inside each of
the table's spans for that shape, and nccl.ran's one rule judges rank 0's NCCL log: each published
variable reached NCCL, the plugin loaded and which table it applied, NCCL's algorithm and protocol
per size equal the table's entry.

Nothing is timed: the ranks time-share one GPU, so their times are artifacts and are neither
judged nor stored. Where the table cannot be read, or the published set holds variables but no
table, one trial of FALLBACK_HOSTS ranks still shows what NCCL read and what the plugin said;
where it holds neither, nothing NCCL runs can differ from its defaults and no rank starts.

The planning (`plan_checks`) is pure; `run_shape` starts the ranks through the runner (the one
place that starts ranks) and reads rank 0's log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..collectives import COLLECTIVES, ELEMENT_BYTES, Collective, from_tuner_name
from ..names import format_size
from ..nccl.debuglog import parse_nccl_log
from ..nccl.ran import TABLE_VAR, WhatRan, what_ran
from ..records import TrialResult
from ..trials.launch.hosts import HOSTID_PREFIX, HostsOnOneGpuLaunch
from ..trials.mps import Sharing
from ..trials.nccllog import rank0_log, read_log
from ..trials.runner import Runner
from ..tuner.table import TableEntry, TunerTable

log = logging.getLogger(__name__)

# The most NCCL hosts formed on the one GPU: each rank holds its own CUDA context and NCCL buffers
# there, and 4 is what the lent one-GPU H200 ran (tests/fixtures/nccllog/h200x1-nccl-hosts).
MAX_HOSTS = 4
# The shape formed when the table names none this node can form (or cannot be read), to see what
# NCCL read and what the plugin said: the smallest job over several nodes.
FALLBACK_HOSTS = 2
# The bytes NCCL sees at the sizes a check runs: a span's low end from MIN_CHECK_BYTES, its high
# end up to MAX_CHECK_BYTES (ranks sharing one GPU move about 2 GB/s over sockets, and an LL entry
# is far slower at large sizes: a larger size proves the same entry, only later), nothing above
# SKIP_ABOVE_BYTES; --quick runs one size per span, as near QUICK_BYTES as the span allows.
MIN_CHECK_BYTES = 4096
MAX_CHECK_BYTES = 16 << 20
SKIP_ABOVE_BYTES = 1 << 30
QUICK_BYTES = 64 << 10
FALLBACK_SIZES = (MIN_CHECK_BYTES, 1 << 20)
# Iterations (warm-up, timed) per size: enough for NCCL to choose, and log, once per size.
FULL_ITERATIONS = (1, 2)
QUICK_ITERATIONS = (0, 1)
# Torch's own collectives (no CUDA graph to capture, no direct calls to attach): the shortest
# start; NCCL chooses, and the plugin is asked, all the same.
TIMING = "events"
NOT_TIMED = "not timed: ranks share one GPU"


@dataclass(frozen=True)
class ShapeCheck:
    """One trial: `nhosts` NCCL hosts on the one GPU running `collectives` at `sizes` (the
    worker's sizes: for all_gather and reduce_scatter, N times the bytes NCCL sees); `spans`: the
    table's entries for the shape that a size falls in."""

    nhosts: int
    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    spans: int = 0

    @property
    def label(self) -> str:
        return f"{self.nhosts}x1"

    def describe(self) -> str:
        what = f"{', '.join(self.collectives)} at {', '.join(format_size(s) for s in self.sizes)}"
        return f"{self.label}: {what}" + (f" ({self.spans} table span(s))" if self.spans else "")


@dataclass(frozen=True)
class OneGpuPlan:
    """What the check forms: the shapes and their sizes, the table's shapes it cannot form (each
    with why), and what the published set holds to prove."""

    shapes: tuple[ShapeCheck, ...]
    not_formed: tuple[str, ...] = ()
    table: str | None = None  # the published table's path, when there is one
    table_problem: str | None = None  # why nccltune could not read it
    holds: str = ""  # what there is to prove, in words


@dataclass
class ShapeOutcome:
    """How one shape's trial went: the trial, and the verdict on rank 0's NCCL log (None where
    there is none: the CPU demo's gloo writes none)."""

    check: ShapeCheck
    result: TrialResult
    ran: WhatRan | None

    def doc(self) -> dict[str, Any]:
        r = self.result
        return {"label": self.check.label, "nnodes": self.check.nhosts, "collectives": list(self.check.collectives),
                "sizes": list(self.check.sizes), "spans": self.check.spans, "status": r.status, "reason": r.reason,
                "wall_s": r.wall_s, "nccl_ran": self.ran.doc() if self.ran is not None else None}


@dataclass
class OneGpuReport:
    """The whole check, as `verify --json` shows it under `one_gpu`."""

    plan: OneGpuPlan
    quick: bool
    outcomes: list[ShapeOutcome] = field(default_factory=list)
    wall_s: float = 0.0
    sharing: Sharing = field(default_factory=lambda: Sharing(False, "no rank started"))

    def doc(self) -> dict[str, Any]:
        return {"timed": False, "note": NOT_TIMED, "gpu_sharing": self.sharing.doc(), "quick": self.quick,
                "max_hosts": MAX_HOSTS,
                "holds": self.plan.holds, "table": self.plan.table, "table_problem": self.plan.table_problem,
                "shapes": [o.doc() for o in self.outcomes], "not_formed": list(self.plan.not_formed),
                "wall_s": round(self.wall_s, 2)}


def _targets(lo: int, hi: int, quick: bool) -> list[int]:
    """The byte counts NCCL is to see inside the span lo..hi: its low end, a middle and its high
    end within MIN_CHECK_BYTES..MAX_CHECK_BYTES (one near QUICK_BYTES with `quick`)."""
    low = min(max(lo, MIN_CHECK_BYTES), hi)
    high = min(hi, max(MAX_CHECK_BYTES, low))
    if quick:
        return [min(max(QUICK_BYTES, low), high)]
    # The power of two nearest the geometric middle, as a size ladder would have it.
    middle = 1 << round(math.log2(math.sqrt(low * high))) if low > 0 else high // 2
    return sorted({low, min(max(middle, low), high), high})


def worker_size(c: Collective, nccl_bytes: int, nhosts: int, lo: int, hi: int) -> int | None:
    """The size the worker measures so that NCCL sees about `nccl_bytes`, inside lo..hi, for a
    communicator of `nhosts` ranks; None where no size fits (a span narrower than one block)."""
    align = ELEMENT_BYTES * 4 if c.split else ELEMENT_BYTES  # the split collectives' per-rank blocks
    seen = nccl_bytes // align * align
    if seen < lo:
        seen += align
    if seen <= 0 or not lo <= seen <= hi:
        return None
    size = seen * nhosts if c.split else seen
    return size if c.nccl_bytes(size, nhosts) == seen else None


def _shape_of(e: TableEntry) -> tuple[int | None, str | None]:
    """The number of hosts that forms the entry's shape on one GPU, or why none can."""
    label = f"{e.nnodes}x{e.ranks_per_node}"
    if e.ranks_per_node != 1 or e.nranks != e.nnodes:
        return None, f"{label}: {e.ranks_per_node} ranks per node need as many GPUs on each node"
    if e.nnodes < 2:
        return None, f"{label}: one rank has no peer"
    if e.nnodes > MAX_HOSTS:
        return None, f"{label}: above the bound of {MAX_HOSTS} NCCL hosts on one GPU"
    return e.nnodes, None


def _table_checks(table: TunerTable, quick: bool) -> tuple[list[ShapeCheck], list[str]]:
    by_hosts: dict[int, list[TableEntry]] = {}
    not_formed: dict[str, None] = {}
    for e in table.entries:
        n, why = _shape_of(e)
        if n is None:
            not_formed[why or ""] = None
        else:
            by_hosts.setdefault(n, []).append(e)
    checks = []
    for n in sorted(by_hosts):
        names: set[str] = set()
        sizes: set[int] = set()
        spans = 0
        for e in by_hosts[n]:
            c = from_tuner_name(e.collective)
            if c is None:
                not_formed[f"{n}x1: {e.collective}: no collective the check runs"] = None
                continue
            if e.min_bytes > SKIP_ABOVE_BYTES:
                not_formed[f"{n}x1: {e.collective} from {format_size(e.min_bytes)}: above "
                           f"{format_size(SKIP_ABOVE_BYTES)}, not run"] = None
                continue
            got = {s for s in (worker_size(c, t, n, e.min_bytes, e.max_bytes) for t in _targets(
                e.min_bytes, e.max_bytes, quick)) if s is not None}
            if got:
                names.add(c.name)
                sizes |= got
                spans += 1
        if names:
            order = list(COLLECTIVES)
            checks.append(ShapeCheck(n, tuple(sorted(names, key=order.index)), tuple(sorted(sizes)), spans))
    return checks, list(not_formed)


def _fallback(quick: bool) -> ShapeCheck:
    return ShapeCheck(FALLBACK_HOSTS, ("all_reduce",), (QUICK_BYTES,) if quick else FALLBACK_SIZES)


def plan_checks(env: Mapping[str, str], table: TunerTable | None, table_problem: str | None, *,
                quick: bool) -> OneGpuPlan:
    """The trials that prove what NCCL runs with `env` (a job's environment from the published
    set) and its tuner `table` (None: none named, or `table_problem` says why it was not read).

    `quick` (a prolog's check): the first shape alone, one size per table span; the shapes left
    out are named."""
    path = env.get(TABLE_VAR) or None
    variables = sorted(n for n in env if n.startswith("NCCL_"))  # the names NCCL itself logs reading
    checks: list[ShapeCheck] = []
    not_formed: list[str] = []
    if table is not None:
        checks, not_formed = _table_checks(table, quick)
        holds = f"tuner table {path} ({len(table.entries)} entries)"
    elif path:
        holds = f"tuner table {path}, which nccltune cannot read"
    elif variables:
        holds = f"no tuner table; {len(variables)} NCCL variable(s): {', '.join(variables)}"
    else:
        holds = "no tuner table and no NCCL variable for NCCL to read"
    if not checks and (path or variables or "NCCL_TUNER_PLUGIN" in env):
        checks = [_fallback(quick)]
    if quick and len(checks) > 1:
        not_formed += [f"{c.label}: left to the full check (--quick forms one shape)" for c in checks[1:]]
        checks = checks[:1]
    return OneGpuPlan(tuple(checks), tuple(not_formed), path, table_problem, holds)


def ran_from_trial(result: TrialResult | None, env: Mapping[str, str], table: TunerTable | None) -> WhatRan | None:
    """nccl.ran's verdict on rank 0's NCCL log of a good trial; None without such a log."""
    if result is None or result.log_dir is None:
        return None
    found = rank0_log(Path(result.log_dir), result.start.get("pid"))
    if found is None:
        return None
    try:
        text = read_log(found).decode(errors="replace")  # the ranks' own file: no link followed
    except OSError:
        return None
    return what_ran(parse_nccl_log(text), env, table)


@dataclass(frozen=True)
class RankSettings:
    """How the check's ranks run, as verify's other trials do (bench.* of the config)."""

    python: str
    backend: str
    base_env: Mapping[str, str]
    work_dir: Path
    timeout_s: float
    gpus: Sequence[int] | None = None
    rank_record: Path | None = None
    user: str | None = None
    abort_check: Callable[[], str | None] | None = None
    fork_ranks: bool = True


def run_shape(check: ShapeCheck, env: Mapping[str, str], table: TunerTable | None, ranks: RankSettings, *,
              quick: bool) -> ShapeOutcome:
    """One trial of `check.nhosts` NCCL hosts on the one GPU with the job environment `env`, and
    the verdict on rank 0's NCCL log. The runner starts the ranks (its timeout and kill apply);
    the launch gives each rank its own NCCL_HOSTID."""
    runner = Runner(python=ranks.python, backend=ranks.backend, nranks=check.nhosts, base_env=ranks.base_env,
                    work_dir=ranks.work_dir / check.label, timeout_s=ranks.timeout_s, gpus=ranks.gpus,
                    # NCCL's log is the whole point: read it wherever one is written.
                    nccl_debug=True, abort_check=ranks.abort_check, rank_record=ranks.rank_record,
                    launch=HostsOnOneGpuLaunch(check.nhosts), user=ranks.user, fork_ranks=ranks.fork_ranks)
    warmup, iters = QUICK_ITERATIONS if quick else FULL_ITERATIONS
    log.info("one GPU: %d NCCL hosts (%s0..%d) for %s; %s", check.nhosts, HOSTID_PREFIX, check.nhosts - 1,
             check.describe(), NOT_TIMED)
    try:
        result = runner.run(env, check.sizes, warmup=warmup, iters=iters, label=f"one GPU: {check.label}",
                            timing=TIMING, collectives=check.collectives)
    finally:
        runner.close()
    return ShapeOutcome(check, result, ran_from_trial(result, env, table) if result.ok else None)
