"""Two runs side by side, size by size and collective by collective: faster, slower or the same
beyond the noise of both. One comparison serves `nccltune compare`, the upgrade gate (a new NCCL,
driver or torch against the last run of the previous versions) and its doctor finding and metric.

Each side of a run is the repeated measurements of one setting: NCCL's defaults or the published
setting, the trials `setting_trials` names (THE rule for which trials make a setting's number); a
verification's trials are all of its setting. The repeats become `select.SizeStats`, so that a
difference counts only beyond the run-to-run noise `select` measures for each side.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .errors import EXIT_CONFIG, NccltuneError
from .names import DEFAULTS_LABEL
from .store import RunRecord, Store, SweepSummary, TrialRecord, VerifySummary
from .sweep.select import SizeStats, size_stats

log = logging.getLogger(__name__)

Side = Literal["defaults", "published"]
SizeVerdict = Literal["faster", "slower", "same", "missing"]


@dataclass(frozen=True)
class SizeComparison:
    """One (collective, size): the median busbw of each run, B's change over A, the noise margin."""

    collective: str
    size_bytes: int
    a_busbw_gbps: float | None
    b_busbw_gbps: float | None
    change_pct: float | None
    noise_pct: float
    verdict: SizeVerdict


@dataclass(frozen=True)
class RunComparison:
    a_run: int
    b_run: int
    side: Side
    sizes: list[SizeComparison]

    @property
    def slower(self) -> list[SizeComparison]:
        return [s for s in self.sizes if s.verdict == "slower"]


def side_trials(run: RunRecord, trials: Sequence[TrialRecord], side: Side) -> list[TrialRecord]:
    """The ok trials of `run` that measured one setting: NCCL's defaults, or what was published."""
    ok = [t for t in trials if t.status == "ok" and t.measurements]
    if run.kind == "import":
        # One setting, measured in one or both placements: the one the import compares with
        # (out of place where the document has it) is its side.
        primary = run.import_summary.placement or "out_of_place"
        return [t for t in ok if (t.nccl or {}).get("placement", primary) == primary]
    if run.kind != "sweep":
        return ok  # a verification measures one setting only
    return setting_trials(ok, "defaults" if side == "defaults" else run.sweep_summary.chosen or "")


def trial_setting(phase: str, label: str) -> str | None:
    """THE setting whose number a sweep's trial is one of the repeats of, wherever such a number is
    shown or counted (the report's table and its #wrong, its JSON, the plot's lines, compare, the
    nccl-tests document, the metrics, the runs verify counts behind its expectation, a class
    profile's per-node numbers): NCCL's defaults (DEFAULTS_LABEL) for every run the sweep measured
    them in, from the first baseline to the defaults' run of each final round (phase "baseline");
    a candidate's label, less its " #N", for its final-round runs, the ones the choice judged;
    None for the others (screening, combining, the per-size candidates, a verification, an
    import): single runs against a fixed baseline, the screening run that picked a finalist being
    the lucky one. Only the label itself names a setting: "NCCL_ALGO=Ring" is not
    "NCCL_ALGO=Ring NCCL_PROTO=LL". Which of a setting's trials count is `setting_of`'s."""
    if phase == "baseline":
        return DEFAULTS_LABEL
    if phase == "final":
        return label.rsplit(" #", 1)[0]
    return None


def setting_name(chosen: str | None) -> str:
    """The setting a run's `chosen` names, or a side: NCCL's defaults for "defaults",
    DEFAULTS_LABEL or nothing; a candidate's label as it is."""
    if chosen is None or chosen in ("", "defaults", DEFAULTS_LABEL):
        return DEFAULTS_LABEL
    return chosen


def setting_of(trial: TrialRecord) -> str | None:
    """The setting whose number this trial's results are among: its `trial_setting` where it
    ended ok with measurements (of which the correct ones are the samples), else None."""
    if trial.status != "ok" or not trial.measurements:
        return None
    return trial_setting(trial.phase, trial.label)


def setting_trials(trials: Iterable[TrialRecord], chosen: str | None) -> list[TrialRecord]:
    """The trials behind a sweep's number for the setting `chosen` names (`setting_name`): every
    ok run of NCCL's defaults, or the chosen candidate's final-round runs (`setting_of`)."""
    setting = setting_name(chosen)
    return [t for t in trials if setting_of(t) == setting]


def side_stats(trials: Sequence[TrialRecord]) -> dict[tuple[str, int], SizeStats]:
    """(collective, size) -> statistics of the repeats' busbw."""
    by_collective: dict[str, list[dict[int, float]]] = {}
    for t in trials:
        for coll in {m.collective for m in t.measurements}:
            by_collective.setdefault(coll, []).append(
                {m.size_bytes: m.busbw_gbps for m in t.measurements if m.collective == coll and m.correct})
    return {(coll, size): st for coll, runs in by_collective.items() for size, st in size_stats(runs).items()}


def side_times(trials: Sequence[TrialRecord]) -> dict[tuple[str, int], float]:
    """(collective, size) -> median of the measured times (us) of these trials' correct measurements."""
    times: dict[tuple[str, int], list[float]] = {}
    for t in trials:
        for m in t.measurements:
            if m.correct and m.time_us > 0:
                times.setdefault((m.collective, m.size_bytes), []).append(m.time_us)
    return {key: statistics.median(v) for key, v in times.items()}


def compare_stats(a: Mapping[tuple[str, int], SizeStats],
                  b: Mapping[tuple[str, int], SizeStats]) -> list[SizeComparison]:
    """B against A at every (collective, size) either measured. A change counts only beyond the sum
    of both sides' noise, the same margin the publish verdict uses for a regression."""
    out = []
    for key in sorted(set(a) | set(b)):
        sa, sb = a.get(key), b.get(key)
        if sa is None or sb is None or sa.median <= 0:
            out.append(SizeComparison(key[0], key[1], sa.median if sa else None, sb.median if sb else None,
                                      None, 0.0, "missing"))
            continue
        change = 100.0 * (sb.median / sa.median - 1.0)
        margin = sa.noise_pct + sb.noise_pct
        verdict: SizeVerdict = "slower" if change < -margin else "faster" if change > margin else "same"
        out.append(SizeComparison(key[0], key[1], sa.median, sb.median, change, margin, verdict))
    return out


def compare_runs(store: Store, a_id: int, b_id: int, side: Side = "published") -> RunComparison:
    """Run B against run A, one side of each.

    Raises:
        KeyError: no run with one of the ids.
    """
    stats = []
    for run_id in (a_id, b_id):
        run = store.run(run_id)
        if run is None:
            raise KeyError(run_id)
        stats.append(side_stats(side_trials(run, store.trials(run_id), side)))
    return RunComparison(a_id, b_id, side, compare_stats(stats[0], stats[1]))


class NothingComparable(NccltuneError):
    """Two runs that share no (collective, size) with a bus bandwidth on both sides: no verdict is
    possible, and a gate must not read "no size slower" as a pass (exit 78: the runs given cannot
    answer the question)."""

    exit_code = EXIT_CONFIG


def nothing_comparable(store: Store, c: RunComparison) -> str | None:
    """Why no size of comparison `c` could be compared (every row "missing"), or None when one could."""
    if any(s.verdict != "missing" for s in c.sizes):
        return None
    why = []
    for run_id, got in ((c.a_run, [s.a_busbw_gbps for s in c.sizes]), (c.b_run, [s.b_busbw_gbps for s in c.sizes])):
        run = store.run(run_id)
        if run is not None and run.nranks == 1:
            why.append(f"run {run_id} ran at one rank: busbw is 0 by definition at one rank")
        elif not any(v is not None for v in got):
            why.append(f"run {run_id} has no measurement of the {c.side} side")
        elif not any(v for v in got if v is not None):
            why.append(f"every busbw of run {run_id} is 0")
    if not why:
        why.append("the two runs measured no (collective, size) in common")
    return f"nothing to compare between run {c.a_run} and run {c.b_run}: {'; '.join(why)}"


def versions(run: RunRecord) -> tuple[str | None, str | None, str | None]:
    """(NCCL, driver, torch) as the run recorded them (the summary where the record has none)."""
    recorded = run.outcome
    nccl = run.nccl_version or (None if isinstance(recorded, VerifySummary) else recorded.nccl_version)
    torch = run.torch_version or (recorded.torch_version if isinstance(recorded, SweepSummary) else None)
    return (str(nccl) if nccl else None, run.driver_version, str(torch) if torch else None)


@dataclass(frozen=True)
class UpgradeCheck:
    """A sweep against the last ok sweep of the same topology under other versions."""

    run_id: int
    previous_run_id: int
    before: tuple[str | None, str | None, str | None]
    after: tuple[str | None, str | None, str | None]
    defaults: RunComparison
    published: RunComparison

    @property
    def regressions(self) -> list[tuple[Side, SizeComparison]]:
        return ([("defaults", s) for s in self.defaults.slower]
                + [("published", s) for s in self.published.slower])


def upgrade_check(store: Store, run: RunRecord, *, warn: bool = True) -> UpgradeCheck | None:
    """When `run` (an ok sweep) measured under other NCCL/driver/torch versions than the last ok
    sweep of its topology before it: NCCL's new defaults against the old defaults, and the new
    published result against the old one. None when there is no such earlier sweep. With `warn`,
    each regression is a warning in the log (the journal, under systemd)."""
    after = versions(run)
    earlier = [r for r in store.runs(limit=None, kind="sweep")
               if r.fingerprint == run.fingerprint and r.status == "ok" and r.id < run.id]
    for previous in sorted(earlier, key=lambda r: r.id, reverse=True):
        before = versions(previous)
        if before == after:
            return None  # the last run of these versions is the reference: nothing was upgraded since
        check = UpgradeCheck(run.id, previous.id, before, after,
                             compare_runs(store, previous.id, run.id, "defaults"),
                             compare_runs(store, previous.id, run.id, "published"))
        for side, s in check.regressions if warn else ():
            log.warning("after the upgrade (%s -> %s), %s at %d B (%s) is %.1f%% slower than run %d, beyond "
                        "the noise of %.1f%%", _names(before), _names(after), side, s.size_bytes, s.collective,
                        -(s.change_pct or 0.0), previous.id, s.noise_pct)
        return check
    return None


def upgrade_gate(store: Store, run_id: int | None) -> UpgradeCheck | None:
    """After a sweep (`nccltune sweep` or the daemon's): when it finished ok, the upgrade check
    with its warnings in the log (stderr, the journal under systemd)."""
    run = store.run(run_id) if run_id is not None else None
    if run is None or run.kind != "sweep" or run.status != "ok":
        return None
    return upgrade_check(store, run)


def _names(v: tuple[str | None, str | None, str | None]) -> str:
    return f"NCCL {v[0] or '?'}, driver {v[1] or '?'}, torch {v[2] or '?'}"


def baseline_slower(store: Store, baseline_id: int, run_id: int, side: Side) -> str | None:
    """Why run `run_id` (a verification) is slower than run `baseline_id` beyond the noise, or why
    nothing of the two could be compared; None when it is not slower."""
    comparison = compare_runs(store, baseline_id, run_id, side)
    empty = nothing_comparable(store, comparison)
    if empty is not None:
        return empty  # a gate that compared nothing has not passed
    slower = comparison.slower
    if not slower:
        return None
    worst = min(slower, key=lambda s: s.change_pct or 0.0)
    return (f"{len(slower)} size(s) slower than run {baseline_id} beyond the noise (worst {worst.size_bytes} B: "
            f"{-(worst.change_pct or 0.0):.1f}% slower, noise {worst.noise_pct:.1f}%)")
