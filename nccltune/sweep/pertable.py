"""The per-size choice: which (algorithm, protocol, channels) candidate wins at each message size,
and the tuner table that applies those wins to communicators of the measured shape.

The candidates are measured as environment trials (NCCL_ALGO/NCCL_PROTO, NCCL_MIN_NCHANNELS and
NCCL_MAX_NCHANNELS) over every size at once, one trial each. Each size is then judged on its own
with the same rule the sweep uses for a whole setting (sweep.select.judge, weighted on that one
size): a candidate wins a size only where it beats NCCL's defaults beyond that size's noise and the
configured minimum gain. Where no candidate does, the table has no entry and NCCL decides.

Why channel counts above the defaults' cannot live in the table: NCCL caps the channel count a tuner
asks for at the communicator's channel count, fixed at init, which already includes
NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS. A table can therefore lower the channel count for a size,
never raise it. When a size's winner needed more channels than the defaults use (say
NCCL_MIN_NCHANNELS=32 won between 1 MiB and 512 MiB), that part stays an environment variable,
measured on one node and so published for single-node jobs only. The raised sizes get no entry
(NCCL with the raised count is what was measured there). Raising the communicator's count changes
every size, so the table then pins every other covered size back to what it was measured with:
the algorithm, protocol and channel count NCCL's log showed for the defaults there, or for the
candidate that won there. (A count in the table replaces the one NCCL would pick for the size, which
is below the communicator's count for small messages, so the logged count is the one pinned.) A
size whose pin cannot be written (NCCL's log did not say) makes the raise unsafe, so it is dropped
and noted. Multi-node jobs get neither the raise nor an entry: the table is for this shape only.

Size ranges: each measured size stands for the sizes up to the geometric midpoint of its
neighbours (the midpoint itself belongs to the upper size), and the table covers only the measured
range (from the smallest to the largest measured size): outside it NCCL's own model decides.
Adjacent sizes with the same choice are merged into one entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..names import format_size
from ..tuner.table import TableEntry, TunerTable
from .select import SizeStats, judge

# NCCL's spelling in the environment, and the table's spelling (nccltune.tuner.table), per algorithm and protocol.
ENV_ALGO = {"ring": "Ring", "tree": "Tree", "pat": "PAT", "nvls": "NVLS"}
ENV_PROTO = {"simple": "Simple", "ll": "LL", "ll128": "LL128"}


@dataclass(frozen=True)
class SizeCandidate:
    """One per-size candidate: an algorithm and protocol (None: NCCL's choice) and a channel count
    (0: NCCL's count)."""

    algo: str | None = None
    proto: str | None = None
    channels: int = 0

    def env(self) -> dict[str, str]:
        """The environment trial that measures this candidate at every size at once."""
        out: dict[str, str] = {}
        if self.algo:
            out["NCCL_ALGO"] = ENV_ALGO[self.algo]
        if self.proto:
            out["NCCL_PROTO"] = ENV_PROTO[self.proto]
        if self.channels:
            out["NCCL_MIN_NCHANNELS"] = out["NCCL_MAX_NCHANNELS"] = str(self.channels)
        return out

    @property
    def label(self) -> str:
        parts = []
        if self.algo or self.proto:
            parts.append(f"{self.algo or 'auto'}/{self.proto or 'auto'}")
        if self.channels:
            parts.append(f"{self.channels} channels")
        return " ".join(parts) or "NCCL defaults"


@dataclass(frozen=True)
class PrunedCandidate:
    what: str
    reason: str


def algo_proto_candidates(*, ll128: bool, nranks: int, nnodes: int = 1,
                          collective: str = "allreduce") -> tuple[list[SizeCandidate], list[PrunedCandidate]]:
    """The (algorithm, protocol) pairs that can differ for this collective on this shape, and why the
    others are not measured."""
    pruned = [PrunedCandidate("nvls", "NVLS is never swept: NVLink SHARP stays as the site set it "
                              "(the environment's NCCL_NVLS_ENABLE is kept, never forced on)"),
              PrunedCandidate("collnet", "CollNet needs a CollNet network plugin and several nodes")]
    algos = ["ring", "tree"] if collective in ("allreduce",) else ["ring"]
    if collective != "allreduce":
        pruned.append(PrunedCandidate("tree", f"NCCL runs {collective} with Ring (Tree is all-reduce only)"))
    if collective in ("allgather", "reducescatter") and nnodes > 1 and nnodes == nranks:
        algos.append("pat")
    else:
        pruned.append(PrunedCandidate("pat", "PAT runs only all-gather and reduce-scatter with one rank per node"))
    protos = ["simple", "ll"] + (["ll128"] if ll128 else [])
    if not ll128:
        pruned.append(PrunedCandidate("ll128", "NCCL would not enable LL128 on this topology; forcing it bypasses "
                                      "NCCL's checks"))
    if nranks < 2:
        return [], [PrunedCandidate("*", "one rank: NCCL consults no tuner")]
    return [SizeCandidate(a, p) for a in algos for p in protos], pruned


def channel_candidates(default_channels: int | None, max_channels: int = 64) -> list[SizeCandidate]:
    """Channel counts relative to the defaults' (from the baseline's NCCL log): half of it, and a third
    more rounded up to a multiple of 8 (24 -> 32, 16 -> 24), at most max_channels. A third more, not
    double: more channels than the ring search found cost SMs and rarely pay twice over."""
    if not default_channels:
        return []
    up = min(max_channels, math.ceil(default_channels * 4 / 3 / 8) * 8)
    counts = sorted({c for c in (default_channels // 2, up) if 1 <= c != default_channels})
    return [SizeCandidate(channels=c) for c in counts]


class Seen(NamedTuple):
    """What NCCL's log showed a trial used at one size: algorithm and protocol in the table's spelling,
    and the channel count where the log gave it."""

    algo: str
    proto: str
    channels: int | None = None


@dataclass(frozen=True)
class Measured:
    """One candidate's trial: per size its statistics and what NCCL's log showed it used (algorithm,
    protocol in the table's spelling; absent where the log did not say)."""

    candidate: SizeCandidate
    stats: Mapping[int, SizeStats]
    used: Mapping[int, Seen] = field(default_factory=dict)


@dataclass(frozen=True)
class SizeWin:
    size_bytes: int
    candidate: SizeCandidate
    ratio: float
    reason: str


@dataclass(frozen=True)
class Cell:
    """What the table asks for at one measured size."""

    algo: str
    proto: str
    channels: int


@dataclass
class PerSizeChoice:
    """The per-size result: the wins, the cells the table holds per measured size, and the
    single-node environment part (a channel count above the defaults')."""

    sizes: list[int]
    wins: dict[int, SizeWin]
    cells: dict[int, Cell]
    default_channels: int | None
    single_node_env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def choose_per_size(baseline: Mapping[int, SizeStats], measured: Sequence[Measured], *,
                    default_used: Mapping[int, Seen], default_channels: int | None,
                    min_gain_pct: float, max_regression_pct: float) -> PerSizeChoice:
    """Per size, the candidate that beats the defaults by most beyond the noise (select.judge on that
    size alone), then the table cells and the environment part those wins need."""
    sizes = sorted(baseline)
    wins: dict[int, SizeWin] = {}
    for size in sizes:
        base = baseline[size]
        best: SizeWin | None = None
        for m in measured:
            st = m.stats.get(size)
            if st is None or base.median <= 0:
                continue
            # A screening decision: one run per candidate; the final check judges the table with
            # the bar for its number of runs.
            v = judge({size: st}, {size: base}, {size: 1.0}, min_gain_pct=min_gain_pct,
                      max_regression_pct=max_regression_pct, require_support=False)
            ratio = st.median / base.median
            if v.eligible and (best is None or ratio > best.ratio):
                best = SizeWin(size, m.candidate, ratio, v.reason)
        if best is not None:
            wins[size] = best
    choice = PerSizeChoice(sizes, wins, {}, default_channels)
    used = {m.candidate: m.used for m in measured}
    raise_to = max((w.candidate.channels for w in wins.values()
                    if default_channels and w.candidate.channels > default_channels), default=0)
    if raise_to:
        cells = _cells(sizes, wins, used, default_used, default_channels, raise_to=raise_to,
                       notes=choice.notes)
        if cells is None:
            choice.notes.append(f"{raise_to} channels won at some sizes, but NCCL's log did not show what the "
                                "defaults used at every other size, so the table could not hold those sizes at "
                                f"the defaults' {default_channels} channels: the raise is not used")
            wins = {s: w for s, w in wins.items() if w.candidate.channels <= (default_channels or 0)}
            choice.wins = wins
        else:
            choice.cells = cells
            choice.single_node_env = {"NCCL_MIN_NCHANNELS": str(raise_to)}
            raised = [s for s, w in wins.items() if w.candidate.channels > (default_channels or 0)]
            choice.notes.append(f"{raise_to} channels won at {_sizes_text(raised)}: more than the defaults' "
                                f"{default_channels}, which a tuner table cannot ask for (NCCL caps it at the "
                                f"communicator's count): NCCL_MIN_NCHANNELS={raise_to} for single-node jobs, and "
                                "the table holds every other size at the count it was measured with")
            return choice
    choice.cells = _cells(sizes, wins, used, default_used, default_channels, raise_to=0,
                          notes=choice.notes) or {}
    return choice


def _cells(sizes: Sequence[int], wins: Mapping[int, SizeWin],
           used: Mapping[SizeCandidate, Mapping[int, Seen]], default_used: Mapping[int, Seen],
           default_channels: int | None, *, raise_to: int,
           notes: list[str]) -> dict[int, Cell] | None:
    """The table's cell per size. Without a raise only won sizes get one (a channel-only winner needs
    NCCL's log to say which algorithm and protocol it ran). With a raise every size gets one, or
    None when some size cannot be pinned.

    A channel count written into the table replaces the one NCCL would pick for that size (it
    otherwise uses fewer channels for small messages than the communicator has), so a pinned count
    is the one NCCL's log showed at that size where it said, else the count the trial ran with."""
    out: dict[int, Cell] = {}
    for size in sizes:
        w = wins.get(size)
        if w is None:
            if not raise_to:
                continue
            d = default_used.get(size)
            if d is None or not default_channels:
                return None
            out[size] = Cell(d.algo, d.proto, d.channels or default_channels)
            continue
        c = w.candidate
        if raise_to and c.channels == raise_to:
            # The raise's own sizes: NCCL with the raised count is what was measured there, no entry.
            continue
        seen = used.get(c, {}).get(size)
        logged = seen.channels if seen is not None else None
        if raise_to:
            # Every other size is pinned to the count it was measured with.
            channels = logged or c.channels or default_channels or 0
        else:
            channels = min(c.channels, logged) if c.channels and logged else c.channels
        if c.algo and c.proto:
            out[size] = Cell(c.algo, c.proto, channels)
            continue
        if seen is None:
            if raise_to:
                return None
            notes.append(f"{c.label} won at {format_size(size)}, but NCCL's log did not show which algorithm and "
                         "protocol it used there: no table entry for that size")
            continue
        out[size] = Cell(seen.algo, seen.proto, channels)
    return out


def size_ranges(sizes: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Each measured size's inclusive byte range: split at the geometric midpoint of neighbours
    (the midpoint goes to the upper size); the first starts at the smallest size, the last ends at
    the largest."""
    ordered = sorted(set(sizes))
    out: dict[int, tuple[int, int]] = {}
    for i, s in enumerate(ordered):
        lo = s if i == 0 else math.isqrt(ordered[i - 1] * s)
        hi = s if i == len(ordered) - 1 else math.isqrt(s * ordered[i + 1]) - 1
        out[s] = (lo, hi)
    return out


@dataclass(frozen=True)
class Span:
    """Adjacent measured sizes with one cell: the byte range the table entry covers."""

    min_bytes: int
    max_bytes: int
    sizes: tuple[int, ...]
    cell: Cell


def spans(choice: PerSizeChoice) -> list[Span]:
    """The table's entries as spans: adjacent measured sizes with equal cells merged."""
    ranges = size_ranges(choice.sizes)
    out: list[Span] = []
    prev: int | None = None
    for size in choice.sizes:
        cell = choice.cells.get(size)
        if cell is None:
            prev = None
            continue
        lo, hi = ranges[size]
        if out and prev is not None and out[-1].cell == cell:
            last = out[-1]
            out[-1] = Span(last.min_bytes, hi, (*last.sizes, size), cell)
        else:
            out.append(Span(lo, hi, (size,), cell))
        prev = size
    return out


def _sizes_text(sizes: Iterable[int]) -> str:
    return ", ".join(format_size(s) for s in sorted(sizes))


def to_table(choice: PerSizeChoice, *, fingerprint: str, nranks: int, nnodes: int = 1,
             collective: str = "allreduce") -> TunerTable:
    """The tuner table for this node's shape (ranks per node = nranks / nnodes): one entry per span."""
    rpn = nranks // nnodes
    return TunerTable(fingerprint, tuple(
        TableEntry(collective, sp.min_bytes, sp.max_bytes, nnodes, nranks, rpn, sp.cell.algo, sp.cell.proto,
                   sp.cell.channels) for sp in spans(choice)))
