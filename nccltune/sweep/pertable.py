"""The per-size choice: which (algorithm, protocol, channels) candidate wins at each message size,
and the tuner table that applies those wins to communicators of the measured shape.

The candidates are measured as environment trials (NCCL_ALGO/NCCL_PROTO, NCCL_MIN_NCHANNELS and
NCCL_MAX_NCHANNELS) over every size at once, one trial each. Each size is then screened on its own
with the rules the sweep uses for a whole setting, less the bar for the number of runs, weighted
on that one size (sweep.select.screen): a candidate wins a size only where it beats NCCL's
defaults beyond that size's noise and the configured minimum gain. Where no candidate does, the
table has no entry and NCCL decides.

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

Every collective the profile measures that NCCL's tuner is asked about (broadcast, reduce,
all-gather, reduce-scatter, all-reduce; all-to-all and send/recv are point-to-point and never
reach a tuner) gets its own choice, from its own numbers in the same trials: a candidate's trial
measures every collective at once. A candidate competes only for the collectives its algorithm
runs (Tree is all-reduce only, so it never wins all-gather); when the profile measures others
besides, its algorithm and protocol are set with NCCL's per-collective syntax
(NCCL_ALGO=allreduce:Tree, NCCL 2.24 and newer), so those collectives keep NCCL's choice in that
trial instead of failing for want of an algorithm. A raised channel count changes every
collective's communicator, so it is one decision for all: when it is used every collective's
other sizes are pinned, and when any collective cannot be pinned it is used for none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ..collectives import COLLECTIVES, TUNED, from_tuner_name
from ..names import DEFAULTS_LABEL, format_size
from ..nccl.debuglog import SizeChoice, prevailing
from ..records import Measurement
from ..tuner.table import TableEntry, TunerTable
from . import decision
from .select import Key, SizeStats, screen, size_stats

# NCCL's spelling in the environment, and the table's spelling (nccltune.tuner.table), per algorithm and protocol.
ENV_ALGO = {"ring": "Ring", "tree": "Tree", "pat": "PAT", "nvls": "NVLS"}
ENV_PROTO = {"simple": "Simple", "ll": "LL", "ll128": "LL128"}

# The collectives NCCL asks a tuner about (nccltune's names, NCCL's order). Everything here names a
# collective as nccltune does; NCCL's spelling (Collective.tuner_name) is written and read only
# where NCCL_ALGO/NCCL_PROTO values and table entries are, and shown in the messages that name them.
STEERED = tuple(c.name for c in TUNED)
# The measured collectives no tuner steers, and why.
NOT_STEERED = {
    "all_to_all": "not seen by NCCL's tuner: NCCL moves all-to-all as point-to-point sends and receives, which "
                  "have no algorithm or protocol for a tuner to choose",
    "sendrecv": "not seen by NCCL's tuner: point-to-point sends and receives have no algorithm or protocol for a "
                "tuner to choose",
}
# The collectives each swept algorithm can run; the others have no such algorithm.
ALGO_RUNS = {"ring": STEERED, "tree": ("all_reduce",), "pat": ("all_gather", "reduce_scatter")}
# NCCL_ALGO/NCCL_PROTO accept `func:list` entries from this version on.
PER_COLLECTIVE_SYNTAX = (2, 24)
# How the per-size stage labels its candidates' trials in the store (and so in an export).
TRIAL_LABEL = "per size: "


def nccl_name(collective: str) -> str:
    """A steered collective (nccltune's name) as NCCL spells it (Collective.tuner_name)."""
    name = COLLECTIVES[collective].tuner_name
    if name is None:
        raise ValueError(f"{collective} is not a collective NCCL asks a tuner about")
    return name


def _nccl_names(collectives: Iterable[str]) -> str:
    return ", ".join(nccl_name(c) for c in collectives)


@dataclass(frozen=True)
class SizeCandidate:
    """One per-size candidate: an algorithm and protocol (None: NCCL's choice) and a channel count
    (0: NCCL's count). `only` names the collectives the algorithm and protocol are set for, with
    NCCL's per-collective syntax; empty: set for every collective."""

    algo: str | None = None
    proto: str | None = None
    channels: int = 0
    only: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        """The environment trial that measures this candidate at every size at once."""
        out: dict[str, str] = {}
        if self.algo:
            out["NCCL_ALGO"] = self._scoped(ENV_ALGO[self.algo])
        if self.proto:
            out["NCCL_PROTO"] = self._scoped(ENV_PROTO[self.proto])
        if self.channels:
            out["NCCL_MIN_NCHANNELS"] = out["NCCL_MAX_NCHANNELS"] = str(self.channels)
        return out

    def _scoped(self, value: str) -> str:
        return ";".join(f"{nccl_name(c)}:{value}" for c in self.only) if self.only else value

    def applies_to(self, collective: str) -> bool:
        """Whether this candidate's trial measures it for `collective`: a collective its algorithm
        cannot run, or one left to NCCL by `only`, measured NCCL's choice."""
        if self.only:
            return collective in self.only
        return self.algo is None or collective in ALGO_RUNS.get(self.algo, ())

    @property
    def label(self) -> str:
        parts = []
        if self.algo or self.proto:
            parts.append(f"{self.algo or 'auto'}/{self.proto or 'auto'}")
        if self.only:
            parts.append(f"({_nccl_names(self.only)} only)")
        if self.channels:
            parts.append(f"{self.channels} channels")
        return " ".join(parts) or DEFAULTS_LABEL


_ENV_ALGO_NAMES = {v.lower(): k for k, v in ENV_ALGO.items()}
_ENV_PROTO_NAMES = {v.lower(): k for k, v in ENV_PROTO.items()}
_SCOPED = re.compile(r"([a-z]+):([A-Za-z0-9]+)")


def _parse_scoped(value: str, names: Mapping[str, str]) -> tuple[str, tuple[str, ...]] | None:
    """'Tree' -> ('tree', ()), 'allreduce:Tree' -> ('tree', ('all_reduce',)); None for anything else."""
    if value.lower() in names:
        return names[value.lower()], ()
    got = [_SCOPED.fullmatch(part) for part in value.split(";")]
    scoped = [(from_tuner_name(m[1]), m[2]) for m in got if m is not None]
    if not got or len(scoped) != len(got) or any(c is None for c, _v in scoped):
        return None
    values = {v.lower() for _c, v in scoped}
    if len(values) != 1 or next(iter(values)) not in names:
        return None
    return names[values.pop()], tuple(c.name for c, _v in scoped if c is not None)


def candidate_of_env(env: Mapping[str, str]) -> SizeCandidate | None:
    """The per-size candidate whose env() this is (other variables ignored), or None when it is not
    one (a value env() never writes, or nothing per-size set)."""
    algo = _parse_scoped(env["NCCL_ALGO"], _ENV_ALGO_NAMES) if "NCCL_ALGO" in env else (None, ())
    proto = _parse_scoped(env["NCCL_PROTO"], _ENV_PROTO_NAMES) if "NCCL_PROTO" in env else (None, ())
    if algo is None or proto is None:
        return None
    lo, hi = env.get("NCCL_MIN_NCHANNELS"), env.get("NCCL_MAX_NCHANNELS")
    if lo != hi or (lo is not None and not lo.isdigit()):
        return None
    only = algo[1] or proto[1]
    if (algo[0] and proto[0] and algo[1] != proto[1]) or (only and not (algo[0] or proto[0])):
        return None
    cand = SizeCandidate(algo[0], proto[0], int(lo) if lo else 0, only)
    return cand if cand.env() and cand.env() == {k: env[k] for k in cand.env()} else None


@dataclass(frozen=True)
class PrunedCandidate:
    what: str
    reason: str
    code: str = ""  # stable for automation; "" takes sweep.plan's code for `what`


def _version(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m[1]), int(m[2])) if m else None


@dataclass
class Candidates:
    """The per-size candidates for a profile's collectives: which collectives the table steers
    (in the profile's order), the candidates, what is not measured and why, notes."""

    collectives: list[str]
    candidates: list[SizeCandidate]
    pruned: list[PrunedCandidate]
    notes: list[str] = field(default_factory=list)


def per_size_candidates(collectives: Sequence[str], *, ll128: bool, nranks: int, nnodes: int = 1,
                        nccl_version: str | None = None) -> Candidates:
    """The (algorithm, protocol) pairs that can differ for the measured `collectives` (nccltune's
    names) on this shape, each measured once for all of them.

    An algorithm that runs only some of the steered collectives (Tree: all-reduce) is set for those
    alone with NCCL's per-collective syntax, so that the others keep NCCL's choice in its trials.
    That syntax needs NCCL 2.24: with an older NCCL known here such a candidate is not measured;
    with the version unknown it is measured in that syntax (an older NCCL refuses it, and the
    trial counts as no result, which never wins and never forces another collective's algorithm)."""
    steered = list(dict.fromkeys(c for c in collectives if c in STEERED))
    pruned = [PrunedCandidate(c, NOT_STEERED[c], "not-steered-by-tuner")
              for c in dict.fromkeys(collectives) if c in NOT_STEERED]
    if nranks < 2:
        return Candidates(steered, [], [PrunedCandidate("*", "one rank: NCCL consults no tuner"), *pruned])
    if not steered:
        return Candidates(steered, [], pruned)
    pruned += [PrunedCandidate("nvls", "NVLS is never swept: NVLink SHARP stays as the site set it "
                               "(the environment's NCCL_NVLS_ENABLE is kept, never forced on)"),
               PrunedCandidate("collnet", "CollNet needs a CollNet network plugin and several nodes")]
    algos = ["ring"]
    if "all_reduce" in steered:
        algos.append("tree")
    else:
        pruned.append(PrunedCandidate("tree", f"NCCL runs {_nccl_names(steered)} with Ring (Tree is all-reduce only)"))
    if {"all_gather", "reduce_scatter"} & set(steered) and nnodes > 1 and nnodes == nranks:
        algos.append("pat")
    else:
        pruned.append(PrunedCandidate("pat", "PAT runs only all-gather and reduce-scatter with one rank per node"))
    protos = ["simple", "ll"] + (["ll128"] if ll128 else [])
    if not ll128:
        pruned.append(PrunedCandidate("ll128", "NCCL would not enable LL128 on this topology; forcing it bypasses "
                                      "NCCL's checks"))
    version = _version(nccl_version)
    out = Candidates(steered, [], pruned)
    for algo in algos:
        runs = tuple(c for c in steered if c in ALGO_RUNS[algo])
        only = () if runs == tuple(steered) else runs
        if only:
            syntax = (f"{ENV_ALGO[algo]} runs only {_nccl_names(runs)}: its candidates set it with NCCL's "
                      f"per-collective syntax (NCCL_ALGO={nccl_name(only[0])}:{ENV_ALGO[algo]}, NCCL 2.24 and newer), "
                      "so the "
                      "other collectives keep NCCL's choice in those trials")
            if version is not None and version < PER_COLLECTIVE_SYNTAX:
                out.pruned.append(PrunedCandidate(algo, f"NCCL {nccl_version} has no per-collective NCCL_ALGO (2.24 "
                                                  f"and newer), and {ENV_ALGO[algo]} set for every collective leaves "
                                                  "the others with no algorithm (NCCL fails them)",
                                                  "no-per-collective-algo"))
                continue
            if version is None:
                syntax += ("; NCCL's version is not known when planning: an older NCCL refuses that syntax, and those "
                           "trials then count as no result")
            out.notes.append(syntax)
        out.candidates.extend(SizeCandidate(algo, p, only=only) for p in protos)
    return out


def algo_proto_candidates(*, ll128: bool, nranks: int, nnodes: int = 1,
                          collective: str = "all_reduce") -> tuple[list[SizeCandidate], list[PrunedCandidate]]:
    """The (algorithm, protocol) pairs that can differ for this one collective on this shape, and
    why the others are not measured."""
    got = per_size_candidates([collective], ll128=ll128, nranks=nranks, nnodes=nnodes)
    return got.candidates, got.pruned


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


# NCCL's log names (any case) -> the table's spelling.
_LOG_ALGOS = {"ring": "ring", "tree": "tree", "nvls": "nvls", "pat": "pat", "nvlstree": "nvls_tree",
              "collnetdirect": "collnet_direct", "collnetchain": "collnet_chain"}
_LOG_PROTOS = {"ll": "ll", "ll128": "ll128", "simple": "simple"}


def seen_of(algo: str, proto: str, channels: int | None = None) -> Seen | None:
    """NCCL's log names (RING/LL128, any case) in the table's spelling; None for names it has not."""
    a, p = _LOG_ALGOS.get(algo.lower().replace("_", "")), _LOG_PROTOS.get(proto.lower())
    return Seen(a, p, channels) if a and p else None


def used_in(runs: Iterable[Iterable[Measurement]], collective: str) -> dict[int, Seen]:
    """What NCCL's log showed per size of one collective (nccltune's name) over several trials
    (debuglog.prevailing decides), in the table's spelling; sizes the log did not cover are absent."""
    seen: dict[int, list[SizeChoice]] = {}
    for run in runs:
        for m in run:
            if m.collective == collective and m.algo and m.proto:
                seen.setdefault(m.size_bytes, []).append(SizeChoice(m.algo, m.proto, m.channels))
    out = {}
    for size, choices in seen.items():
        got = prevailing(choices)
        cell = seen_of(got.algo, got.proto, got.channels) if got else None
        if cell is not None:
            out[size] = cell
    return out


@dataclass(frozen=True)
class Measured:
    """One candidate's trial: per size its statistics and what NCCL's log showed it used (algorithm,
    protocol in the table's spelling; absent where the log did not say)."""

    candidate: SizeCandidate
    stats: Mapping[int, SizeStats]
    used: Mapping[int, Seen] = field(default_factory=dict)
    # Per size, the candidate's runs paired with the defaults on each node (a class decision's
    # evidence, judged by sweep.decision); empty for a node's screening runs.
    paired: Mapping[int, decision.Evidence[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class CollectiveInput:
    """One collective's evidence for the per-size choice: its defaults' statistics per size, its
    numbers in each candidate's trials, and what NCCL's log showed the defaults used."""

    baseline: Mapping[int, SizeStats]
    measured: Sequence[Measured]
    default_used: Mapping[int, Seen] = field(default_factory=dict)


Pairs = Callable[[SizeCandidate, str], Mapping[int, "decision.Evidence[int]"]]


def table_inputs(collectives: Sequence[str], baseline: Mapping[Key, SizeStats],
                 candidates: Sequence[tuple[SizeCandidate, Sequence[Sequence[Measurement]]]],
                 default_runs: Sequence[Sequence[Measurement]], *,
                 pairs: Pairs | None = None) -> dict[str, CollectiveInput]:
    """Each steered collective's evidence (collective -> input) from whole trials: the defaults'
    statistics keyed by (collective, size), each candidate's trials, the defaults' trials, and for a
    class decision `pairs(candidate, collective)`, its paired evidence per size. A candidate is
    evidence only for the collectives it applies to (SizeCandidate.applies_to)."""
    out: dict[str, CollectiveInput] = {}
    for name in collectives:
        measured = []
        for cand, runs in candidates:
            if not cand.applies_to(name):
                continue
            values = [{m.size_bytes: m.busbw_gbps for m in run if m.collective == name and m.correct}
                      for run in runs]
            stats = size_stats([v for v in values if v])
            if stats:
                measured.append(Measured(cand, stats, used_in(runs, name), pairs(cand, name) if pairs else {}))
        out[name] = CollectiveInput({s: st for (c, s), st in baseline.items() if c == name}, measured,
                                    used_in(default_runs, name))
    return out


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
    """One collective's per-size result: the wins and the cells the table holds per measured size.
    Made alone (choose_per_size) it also carries the single-node environment part (a channel
    count above the defaults') and the notes; within a TableChoice those are the table's."""

    sizes: list[int]
    wins: dict[int, SizeWin]
    cells: dict[int, Cell]
    default_channels: int | None
    single_node_env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    collective: str = "all_reduce"


@dataclass
class TableChoice:
    """The per-size result of every steered collective, and what they share: one channel raise
    (the single-node environment part) and the notes."""

    parts: list[PerSizeChoice]
    default_channels: int | None
    single_node_env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def part(self, collective: str) -> PerSizeChoice | None:
        return next((p for p in self.parts if p.collective == collective), None)


def _placeable(m: Measured, collective: str, default_channels: int | None) -> bool:
    # A channel candidate is placed only against a known count: above or below the defaults'?
    return m.candidate.applies_to(collective) and not (m.candidate.channels and not default_channels)


def _class_tests(inputs: Mapping[str, CollectiveInput], default_channels: int | None, rule: decision.Rule
                 ) -> dict[tuple[str, int, str], decision.Verdict[int]]:
    """A class decision's test per (collective, size, candidate) on its paired evidence, at alpha."""
    out: dict[tuple[str, int, str], decision.Verdict[int]] = {}
    for collective, inp in inputs.items():
        for size in sorted(inp.baseline):
            for m in inp.measured:
                ev = m.paired.get(size)
                if ev is not None and _placeable(m, collective, default_channels):
                    out[(collective, size, m.candidate.label)] = decision.judge(ev, {size: 1.0}, rule)
    return out


def _wins(inp: CollectiveInput, collective: str, default_channels: int | None, min_gain_pct: float,
          max_regression_pct: float, final: dict[tuple[str, int, str], str] | None) -> dict[int, SizeWin]:
    """Per size, the candidate valid for this collective that beats the defaults by most: beyond the
    noise of a node's screening run (select.screen; its final check judges the whole table), or,
    for a class decision (`final`: the findings that stand, (collective, size, label) -> reason),
    among those the class's paired runs show faster."""
    wins: dict[int, SizeWin] = {}
    for size in sorted(inp.baseline):
        base = inp.baseline[size]
        best: SizeWin | None = None
        for m in inp.measured:
            st = m.stats.get(size)
            if st is None or base.median <= 0 or not _placeable(m, collective, default_channels):
                continue
            if final is not None:
                reason = final.get((collective, size, m.candidate.label))
                if reason is None:
                    continue
            else:
                v = screen({size: st}, {size: base}, {size: 1.0}, min_gain_pct=min_gain_pct,
                           max_regression_pct=max_regression_pct)
                if not v.eligible:
                    continue
                reason = v.reason
            ratio = st.median / base.median
            if best is None or ratio > best.ratio:
                best = SizeWin(size, m.candidate, ratio, reason)
        if best is not None:
            wins[size] = best
    return wins


def choose_table(inputs: Mapping[str, CollectiveInput], *, default_channels: int | None, min_gain_pct: float,
                 max_regression_pct: float, allow_raise: bool = True,
                 no_raise_reason: str = "", final: bool = False) -> TableChoice:
    """Every collective's per-size choice (inputs: collective -> evidence, in the profile's
    order), with one shared channel raise. `allow_raise=False` (a decision for jobs of any shape,
    which cannot carry a single-node part) drops a raise with `no_raise_reason`. `final`: no
    final check follows (a class decision), so each win needs the bar for its number of runs."""
    multi = len(inputs) > 1
    standing: dict[tuple[str, int, str], str] | None = None
    class_notes: list[str] = []
    if final:
        # Many candidates at many sizes: Benjamini-Hochberg over every test keeps the expected share
        # of entries that are not really faster at alpha (sweep.decision).
        tests = _class_tests(inputs, default_channels, decision.Rule(min_gain_pct, max_regression_pct))
        stand = decision.false_discovery({"\0".join(map(str, k)): v.p_value if v.p_value is not None else 1.0
                                          for k, v in tests.items()})
        standing = {k: f"{v.reason} (one of {len(stand)} finding(s) standing among {len(tests)} tests, "
                       f"Benjamini-Hochberg at {100 * decision.ALPHA:g}%)"
                    for k, v in tests.items() if "\0".join(map(str, k)) in stand and v.gain_pct > 0}
        if not tests:
            class_notes.append("no per-size candidate has paired runs on two nodes or more: no entry can be judged")
    parts = [PerSizeChoice(sorted(inp.baseline),
                           _wins(inp, name, default_channels, min_gain_pct, max_regression_pct, standing), {},
                           default_channels, collective=name)
             for name, inp in inputs.items()]
    table = TableChoice(parts, default_channels, notes=class_notes)
    above = {p.collective: [s for s, w in p.wins.items()
                            if default_channels and w.candidate.channels > default_channels] for p in parts}
    raise_to = max((p.wins[s].candidate.channels for p in parts for s in above[p.collective]), default=0)
    if raise_to:
        unpinned: list[str] = []
        cells: dict[str, dict[int, Cell]] = {}
        if allow_raise:
            for p in parts:
                inp = inputs[p.collective]
                got = _cells(p, inp, raise_to=raise_to, notes=table.notes, multi=multi)
                if got is None:
                    unpinned.append(p.collective)
                else:
                    cells[p.collective] = got
        raised = _sizes_text({p.collective: above[p.collective] for p in parts}, multi)
        if allow_raise and not unpinned:
            for p in parts:
                p.cells = cells[p.collective]
            table.single_node_env = {"NCCL_MIN_NCHANNELS": str(raise_to)}
            table.notes.append(f"{raise_to} channels won at {raised}: more than the defaults' {default_channels}, "
                               "which a tuner table cannot ask for (NCCL caps it at the communicator's count): "
                               f"NCCL_MIN_NCHANNELS={raise_to} for single-node jobs, and the table holds every other "
                               f"size{' of every collective' if multi else ''} at the count it was measured with")
            return table
        if not allow_raise:
            table.notes.append(f"{raise_to} channels won at {raised}: {no_raise_reason}")
        else:
            of = f" of {_nccl_names(unpinned)}" if multi else ""
            table.notes.append(f"{raise_to} channels won at some sizes, but NCCL's log did not show what the defaults "
                               f"used at every other size{of}, so the table could not hold those sizes at the "
                               f"defaults' {default_channels} channels: the raise is not used"
                               + (" for any collective (it changes every collective's communicator)" if multi else ""))
        for p in parts:
            p.wins = {s: w for s, w in p.wins.items() if w.candidate.channels <= (default_channels or 0)}
    for p in parts:
        p.cells = _cells(p, inputs[p.collective], raise_to=0, notes=table.notes, multi=multi) or {}
    return table


def choose_per_size(baseline: Mapping[int, SizeStats], measured: Sequence[Measured], *,
                    default_used: Mapping[int, Seen], default_channels: int | None,
                    min_gain_pct: float, max_regression_pct: float, collective: str = "all_reduce") -> PerSizeChoice:
    """One collective's choice made alone (choose_table of that collective): per size, the candidate
    that beats the defaults by most beyond the noise, then the table cells and the environment part
    those wins need."""
    table = choose_table({collective: CollectiveInput(baseline, measured, default_used)},
                         default_channels=default_channels, min_gain_pct=min_gain_pct,
                         max_regression_pct=max_regression_pct)
    return replace(table.parts[0], single_node_env=dict(table.single_node_env), notes=list(table.notes))


def _cells(part: PerSizeChoice, inp: CollectiveInput, *, raise_to: int, notes: list[str],
           multi: bool) -> dict[int, Cell] | None:
    """The table's cell per size of one collective. Without a raise only won sizes get one (a
    channel-only winner needs NCCL's log to say which algorithm and protocol it ran). With a raise
    every size gets one, or None when some size cannot be pinned.

    A channel count written into the table replaces the one NCCL would pick for that size (it
    otherwise uses fewer channels for small messages than the communicator has), so a pinned count
    is the one NCCL's log showed at that size where it said, else the count the trial ran with."""
    used = {m.candidate: m.used for m in inp.measured}
    default_channels = part.default_channels
    out: dict[int, Cell] = {}
    for size in part.sizes:
        w = part.wins.get(size)
        if w is None:
            if not raise_to:
                continue
            d = inp.default_used.get(size)
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
            of = f" of {nccl_name(part.collective)}" if multi else ""
            notes.append(f"{c.label} won at {format_size(size)}{of}, but NCCL's log did not show which algorithm and "
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
    """Adjacent measured sizes of one collective with one cell: the byte range the table entry covers."""

    min_bytes: int
    max_bytes: int
    sizes: tuple[int, ...]
    cell: Cell
    collective: str = "all_reduce"
    last: bool = False  # holds the collective's largest measured size: the range ends there, inclusive


def _parts(choice: PerSizeChoice | TableChoice) -> list[PerSizeChoice]:
    return choice.parts if isinstance(choice, TableChoice) else [choice]


def spans(choice: PerSizeChoice | TableChoice) -> list[Span]:
    """The table's entries as spans, collective by collective: adjacent measured sizes with equal
    cells merged. Each collective's ranges follow its own measured sizes."""
    out: list[Span] = []
    for part in _parts(choice):
        ranges = size_ranges(part.sizes)
        mine: list[Span] = []
        prev: int | None = None
        for size in part.sizes:
            cell = part.cells.get(size)
            if cell is None:
                prev = None
                continue
            lo, hi = ranges[size]
            largest = size == part.sizes[-1]
            if mine and prev is not None and mine[-1].cell == cell:
                before = mine[-1]
                mine[-1] = Span(before.min_bytes, hi, (*before.sizes, size), cell, part.collective, largest)
            else:
                mine.append(Span(lo, hi, (size,), cell, part.collective, largest))
            prev = size
        out.extend(mine)
    return out


def _sizes_text(by_collective: Mapping[str, Iterable[int]], multi: bool) -> str:
    if not multi:
        return ", ".join(format_size(s) for v in by_collective.values() for s in sorted(v))
    return "; ".join(f"{nccl_name(c)} {', '.join(format_size(s) for s in sorted(v))}"
                     for c, v in by_collective.items() if v)


def table_entries(choice: PerSizeChoice | TableChoice, *, nranks: int, nnodes: int = 1,
                  nccl: str = "") -> tuple[TableEntry, ...]:
    """The entries for one shape (ranks per node = nranks / nnodes), in the section of NCCL `nccl`
    (the version the trials ran): one per span, its range in the
    byte counts NCCL passes to the tuner (one rank's block for all_gather and reduce_scatter: see
    collectives.Collective.nccl_bytes), not in the measured sizes."""
    rpn = nranks // nnodes
    entries = []
    for sp in spans(choice):
        lo, hi = COLLECTIVES[sp.collective].nccl_byte_range(sp.min_bytes, sp.max_bytes, nranks)
        entries.append(TableEntry(nccl_name(sp.collective), lo, hi, nnodes, nranks, rpn, sp.cell.algo, sp.cell.proto,
                                  sp.cell.channels, nccl))
    return tuple(entries)


def to_table(choice: PerSizeChoice | TableChoice, *, fingerprint: str, nranks: int, nnodes: int = 1,
             nccl: str = "") -> TunerTable:
    """The tuner table for this node's shape: every collective's entries, in NCCL `nccl`'s section."""
    return TunerTable(fingerprint, table_entries(choice, nranks=nranks, nnodes=nnodes, nccl=nccl))
