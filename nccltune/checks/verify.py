"""`nccltune verify`: a quick run of the profile's collectives with the published environment
against expectations.

Every collective of sweep.profile that the backend can measure is run at a few sizes, in one
trial per repeat. Expectations come from a floor given on the command line (GB/s busbw at the
largest size measured, for every collective) or from the last sweep of this node's topology
(the medians it measured for the published setting, per collective and size). A size counts as
degraded when the best of the verify runs is below expectation by more than the largest of: the
drift threshold, twice the noise that sweep measured at that size, and the drop that runs of an
unchanged node show by chance one time in a hundred, given how few runs are behind each number
(`allowed_drift_pct`). Usable from a Slurm prolog or a health check: two short trials, exit 1 on
failure.

With a class profile in force (the published set came from `nccltune apply` or the daemon's
profile.path), the published setting is the class's, and the expectation is the class's
measured distribution in the profile's evidence: a node below it beyond noise fails with code
`below_class` (the rule is nccltune.fleet.outlier.judge_node). Sizes the profile has no
per-node numbers for are compared with this node's own last sweep, where it has one.

On GPU nodes the check also proves what NCCL ran (nccl/ran.py), from NCCL's own log of the last
good trial: each published variable as NCCL read it, the tuner plugin NCCL bound and the table it
applied, and NCCL's choice per size against the table's entries for the check's communicator. A
mismatch fails the check with that finding's code, measured bandwidth or not.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..compare import baseline_slower, setting_trials
from ..config import Config
from ..errors import BusyError, CheckFailed, UsageError
from ..files.lock import SweepLock
from ..files.trust import ensure_dir
from ..fleet.apply import profile_in_force
from ..fleet.outlier import ClassReference, ClassVerdict, class_reference, judge_node
from ..fleet.upgrade import SAFE_PART
from ..names import DEFAULTS_LABEL, format_size
from ..nccl.ran import WhatRan, combined, published_table
from ..node import Node, busy_gpus, load_node, size_ladder
from ..pipeline.planning import check_profile, workload
from ..publish import PublishedSet, job_env, read_set
from ..records import TrialResult
from ..store import Store, TrialRecord, VerifyRow, VerifySummary
from ..sweep.select import Key, d2, key_label, t_quantile
from ..trials.credentials import rank_user
from ..trials.launch.hosts import HOSTID_VAR
from ..trials.mps import shared_gpu
from ..trials.runner import RANK_RECORD, Runner, find_worker_python, reap_leftover_ranks
from ..trials.session import TrialSession, remove_leftover_temps, resolve_engine, start_run
from ..tuner.table import TunerTable
from .onegpu import NOT_TIMED, OneGpuReport, RankSettings, plan_checks, ran_from_trial, run_shape

log = logging.getLogger(__name__)

GPU_VERIFY_SIZES = (16 << 20, 256 << 20, 1 << 30)
DEMO_VERIFY_SIZES = (262144, 1 << 20, 4 << 20)
# How often an unchanged node may fail verify by chance: a false alarm drains it from the scheduler.
FALSE_ALARM = 0.01
# A size whose allowed drop is this (percent) or more cannot fail: no measurement is 100% below
# its expectation. It is left out of the verdict and named, not passed.
UNVERIFIABLE_PCT = 100.0


@dataclass(frozen=True)
class SampleCounts:
    """Runs behind a sweep's numbers: its spread (the defaults') and its expected medians."""

    noise_runs: int
    expected_runs: int


def _bound_log(noise_pct: float, noise_runs: int, expected_runs: int, logs: Sequence[float]) -> float | None:
    """How far below the expected ln(busbw) the best of the runs `logs` falls by chance with
    probability FALSE_ALARM; None when nothing is known about the spread."""
    m = len(logs)
    dof = 0
    acc = 0.0
    h = min(noise_pct / 100.0, 0.99)
    if noise_runs >= 2 and h > 0:
        sigma_sweep = math.log((1.0 + h) / (1.0 - h)) / d2(noise_runs)
        dof += noise_runs - 1
        acc += (noise_runs - 1) * sigma_sweep ** 2
    if m >= 2:
        dof += m - 1
        acc += (m - 1) * statistics.variance(logs)
    if m == 0 or dof == 0 or acc <= 0:
        return None
    sigma = math.sqrt(acc / dof)
    expected_var = 0.0 if expected_runs <= 0 else (1.0 if expected_runs <= 2 else math.pi / 2.0) / expected_runs
    p = max(0.5, 1.0 - FALSE_ALARM ** (1.0 / m))
    return t_quantile(p, dof) * sigma * math.sqrt(1.0 + expected_var)


def allowed_drift_pct(threshold_pct: float, noise_pct: float, counts: SampleCounts,
                      verify_busbw: Sequence[float], *, expected_gbps: float | None = None,
                      defaults_gbps: float | None = None) -> float:
    """How far (percent) the best of the verify runs at one size may fall below expectation.

    The largest of the drift threshold, twice the sweep's noise there (`noise_pct`: half the
    relative range of its `counts.noise_runs` runs) and a bound from the runs themselves. For
    that bound the spread sigma of ln(busbw) pools the sweep's range (ln(high/low) / d2(n),
    n - 1 degrees of freedom) with the verify runs' own standard deviation (m - 1), so that a
    verify whose runs disagree widely, as on a loaded machine, allows for it. An unchanged node
    fails only when all m runs land that low: each with probability a^(1/m) for a false-alarm
    rate a, so the bound is t(1 - a^(1/m), df) * sigma * sqrt(1 + c / n_e), the last factor
    for the expected median's own error (n_e runs, c = pi/2 for a median of 3 or more; nothing
    for a floor). With a = 1% and the sweep's n = 3: one verify run allows 6.96 * 1.41 sigma
    (with an expectation from one finalist run), two allow t(0.90, 3) = 1.64 * 1.41 sigma:
    the fewer runs, the wider the bar. Nothing known about the spread leaves the threshold.

    An expectation from a single finalist run says nothing of that run's own luck (the same
    reason a sweep refuses to publish a gain from one run): where it lies above the defaults'
    median (`defaults_gbps`, n runs), a size fails only when it is also below the defaults'
    level by the bound computed for an expectation of n runs.
    """
    base = max(threshold_pct, 2.0 * noise_pct)
    logs = [math.log(v) for v in verify_busbw if v > 0]
    if not logs or len(logs) < len(verify_busbw):
        return base
    allowed = base
    bound = _bound_log(noise_pct, counts.noise_runs, counts.expected_runs, logs)
    if bound is not None:
        allowed = max(allowed, 100.0 * (1.0 - math.exp(-bound)))
    if (counts.expected_runs < 2 and counts.noise_runs >= 2 and expected_gbps and defaults_gbps
            and 0 < defaults_gbps < expected_gbps):
        bound_d = _bound_log(noise_pct, counts.noise_runs, counts.noise_runs, logs) or 0.0
        allowed = max(allowed, 100.0 * (1.0 - defaults_gbps / expected_gbps * math.exp(-bound_d)))
    return allowed


# The verdict as a stable word beside the prose `reason` (the verify schema lists them).
VerifyCode = Literal["passed", "all_trials_failed", "not_measured", "not_verifiable", "below_expectation",
                     "below_class",
                     "slower_than_baseline", "variable_differs", "plugin_not_loaded", "table_unreadable",
                     "table_malformed", "table_stale", "table_missing", "table_other", "table_not_applied",
                     "nccl_log_missing"]
# What the expectations came from (kept in the run's summary, for the metrics and doctor); "none"
# on a node with one GPU, where nothing is timed.
Reference = Literal["sweep", "floor", "class", "none"]


@dataclass
class VerifyResult:
    passed: bool
    reason: str
    env: dict[str, str]
    env_source: str
    rows: list[VerifyRow]
    demo: bool
    fingerprint: str
    run_id: int | None = None
    expectation: str = ""
    nccl_version: str | None = None
    notes: list[str] = field(default_factory=list)
    code: VerifyCode = "passed"
    reference: Reference = "sweep"
    # The class profile in force (nccl.json's class_profile) when the class was the expectation.
    class_profile: dict[str, object] | None = None
    # What NCCL ran, from its log (WhatRan.doc()); None where there is no NCCL log (the CPU demo).
    nccl_ran: dict[str, object] | None = None
    checked: str = ""  # what was measured: collectives, sizes, runs
    # On a node with one GPU: the shapes N x 1 formed there and what NCCL ran in each
    # (onegpu.OneGpuReport.doc()); None elsewhere.
    one_gpu: dict[str, object] | None = None

    @property
    def max_drift_pct(self) -> float | None:
        drifts = [r.drift_pct for r in self.rows if r.drift_pct is not None]
        return min(drifts) if drifts else None


def _sample_counts(trials: Sequence[TrialRecord], chosen: str | None, use_current: bool) -> SampleCounts:
    """Runs behind a sweep's rows: the trials behind each setting's number (compare.setting_trials),
    the defaults' for the noise, and for the expected medians the published setting's (`chosen`;
    the defaults' where the sweep kept them, or with --current)."""
    defaults = len(setting_trials(trials, DEFAULTS_LABEL))
    return SampleCounts(defaults, defaults if use_current else len(setting_trials(trials, chosen)))


def _expectations(store: Store, node: Node, floor_gbps: float | None, use_current: bool,
                  sizes: list[int], collectives: tuple[str, ...]
                  ) -> tuple[dict[Key, tuple[float, float, float | None]], str, SampleCounts]:
    """(collective, size) -> (expected busbw, noise pct there, the defaults' busbw there), where
    the numbers come from, and how many runs are behind them."""
    if floor_gbps is not None:
        return ({(c, max(sizes)): (floor_gbps, 0.0, None) for c in collectives},
                f"floor {floor_gbps:g} GB/s at {format_size(max(sizes))}", SampleCounts(0, 0))
    run = store.latest_run(node.fingerprint, kind="sweep", status="ok")
    if run is not None and not run.rows and run.published_generation is not None:
        # Killed between its publish and its numbers (close_dead_runs recorded it as published).
        raise CheckFailed(f"sweep {run.id} published generation {run.published_generation} but ended before "
                          "it recorded its numbers: no expectation to verify against",
                          hint="run `nccltune sweep` again, or pass --floor GBPS")
    if run is None or not run.rows:
        raise CheckFailed("no expectation to verify against: no finished sweep for this topology "
                          f"(fingerprint {node.fingerprint})", hint="run `nccltune sweep`, or pass --floor GBPS")
    out: dict[Key, tuple[float, float, float | None]] = {}
    for row in run.rows:
        if row.size_bytes in sizes and row.collective in collectives:
            expected = row.default_busbw_gbps if use_current else row.tuned_busbw_gbps
            out[(row.collective, row.size_bytes)] = (expected, row.default_noise_pct, row.default_busbw_gbps)
    if not out:
        # Without this, every row would lack an expectation and verify would pass vacuously.
        raise CheckFailed(f"sweep {run.id} measured none of the verify sizes "
                          f"({', '.join(format_size(s) for s in sizes)}) of {', '.join(collectives)}",
                          hint="re-run `nccltune sweep` with the current bench sizes, or pass --floor GBPS")
    counts = _sample_counts(store.trials(run.id), run.sweep_summary.chosen, use_current)
    return out, f"sweep {run.id} of {run.started_at[:19]}", counts


def _class_in_force(cfg: Config, published: PublishedSet | None
                    ) -> tuple[ClassReference | None, dict[str, object] | None]:
    """The class distribution to compare the node with, when the published set came from a
    class profile whose evidence has per-node numbers; and nccl.json's record of that profile."""
    if published is None:
        return None, None
    if (published.provenance.get("class_profile") or {}).get("part") == SAFE_PART:
        # Only the safe part after an upgrade: the class's numbers were measured under the old versions.
        log.info("the safe part of a class profile is published after an upgrade: verify compares this node "
                 "with its own last sweep, not with the class")
        return None, None
    loaded = profile_in_force(cfg, published.provenance)
    if loaded is None:
        return None, None
    prov = dict(published.provenance["class_profile"])
    reference = class_reference(loaded.doc, str(prov.get("file") or loaded.path.name))
    if reference is None:
        log.info("the class profile in force (%s) has no per-node numbers of two nodes or more: verify "
                 "compares this node with its own last sweep", prov.get("file"))
    return reference, prov


def _with_class(reference: ClassReference, class_keys: set[Key], keys: list[Key], store: Store, node: Node,
                sizes: list[int], collectives: tuple[str, ...]
                ) -> tuple[dict[Key, tuple[float, float, float | None]], str, SampleCounts]:
    """Expectations where the class is the reference, and this node's own sweep's for the other
    sizes where it has one (a node that only ever applied profiles has none)."""
    own: dict[Key, tuple[float, float, float | None]] = {}
    counts = SampleCounts(0, 0)
    expectation = reference.describe()
    if set(keys) - class_keys:
        try:
            own, own_text, counts = _expectations(store, node, None, False, sizes, collectives)
            expectation += f"; other sizes: {own_text}"
        except CheckFailed as exc:
            log.info("no expectation for the sizes the class profile lacks: %s", exc.message)
    for key in class_keys:
        ref = reference.sizes[key]
        own[key] = (ref.median_gbps, ref.noise_pct, None)
    return own, expectation, counts


def _published_table(env: dict[str, str]) -> TunerTable | None:
    """The tuner table the published set names, None when it names none or it cannot be read (the
    plugin's own line in NCCL's log then says why)."""
    table, problem = published_table(env)
    if problem:
        log.debug("published tuner table unreadable: %s", problem)
    return table


def _what_ran(result: TrialResult | None, env: dict[str, str]) -> WhatRan | None:
    """The proof of what NCCL ran, from rank 0's log of a good trial; None without such a log."""
    return ran_from_trial(result, env, _published_table(env))


def verify_sizes(cfg: Config, node: Node) -> list[int]:
    if node.demo:
        return list(DEMO_VERIFY_SIZES)
    ladder = size_ladder(cfg, False)
    chosen = [s for s in GPU_VERIFY_SIZES if s in ladder]
    return chosen or ladder[-3:]


def _scope(cfg: Config, node: Node, repeats: int, quick: bool) -> tuple[list[int], tuple[str, ...], int, str]:
    """What verify measures: its sizes, the profile's collectives, how many runs, and the line
    that says so."""
    sizes = verify_sizes(cfg, node)
    collectives = workload(cfg, node, sizes).collectives
    if quick:
        # For a per-job prolog: the profile's first collective at the smallest and largest verify
        # size, one run (the allowed drift widens for it); NCCL's log is read all the same.
        sizes, collectives, repeats = sorted({sizes[0], sizes[-1]}), collectives[:1], 1
    checked = (f"{'quick: ' if quick else ''}{', '.join(collectives)} at "
               f"{', '.join(format_size(s) for s in sizes)}, {repeats} run(s)")
    return sizes, collectives, repeats, checked


def _published_env(cfg: Config, use_current: bool) -> tuple[dict[str, str], str, PublishedSet | None]:
    """The environment verify runs with, where it comes from, and the published set it is
    (None with `use_current`: the calling environment alone)."""
    if use_current:
        return {}, "current environment", None
    got = read_set(cfg.publish_dir)
    if got is None:
        raise CheckFailed(f"nothing is published in {cfg.publish_dir}",
                          hint="run `nccltune sweep`, or pass --current to check the calling environment")
    # Verify runs a job on this one node: it gets both parts, as such a job does.
    return job_env(got, nnodes=1), f"published in {cfg.publish_dir}", got


def _measure(session: TrialSession, runner: Runner, env: dict[str, str], repeats: int
             ) -> tuple[dict[Key, float], dict[Key, list[float]], TrialResult | None]:
    """`repeats` trials of `env`: the best bus bandwidth of each key, every sample of it, and the
    last trial that ran to the end (whose NCCL log tells what ran)."""
    best: dict[Key, float] = {}
    samples: dict[Key, list[float]] = {}
    last_good: TrialResult | None = None
    try:
        for i in range(repeats):
            res = session.trial(env, "verify", f"verify #{i + 1}")
            if not res.ok:
                continue
            last_good = res
            for s in res.sizes:
                # The better of the repeats: a degraded link is slow every time, noise is not.
                key = (s.collective, s.size_bytes)
                best[key] = max(best.get(key, 0.0), s.busbw_gbps)
                samples.setdefault(key, []).append(s.busbw_gbps)
    except BaseException:
        session.abandon("interrupted", VerifySummary(error="interrupted"))
        raise
    finally:
        runner.close()
    return best, samples, last_good


def _rows(keys: list[Key], expected: dict[Key, tuple[float, float, float | None]], counts: SampleCounts,
          best: dict[Key, float], samples: dict[Key, list[float]], class_keys: set[Key],
          reference: ClassReference | None, threshold: float) -> tuple[list[VerifyRow], list[tuple[Key, ClassVerdict]]]:
    """One row per key against its expectation (the class's distribution for `class_keys`, else
    the node's own numbers or the floor), and the keys below their class."""
    rows = []
    below_class: list[tuple[Key, ClassVerdict]] = []
    for key in keys:
        exp = expected.get(key)
        if key in class_keys and reference is not None and samples.get(key):
            verdict = judge_node(samples[key], reference.sizes[key], threshold)
            # As against the node's own numbers: a size whose allowed drop is 100% or more (a class
            # whose lowest node was at 0) cannot fail; it is named and left out, never passed.
            class_ok = verdict.allowed_pct < UNVERIFIABLE_PCT
            rows.append(VerifyRow(key[1], verdict.measured_gbps, verdict.class_median_gbps, verdict.allowed_pct,
                                  verdict.drift_pct, not verdict.below or not class_ok, key[0], class_ok))
            if verdict.below and class_ok:
                below_class.append((key, verdict))
            continue
        got_bw = best.get(key)
        allowed = allowed_drift_pct(threshold, exp[1], counts, samples.get(key, []), expected_gbps=exp[0],
                                    defaults_gbps=exp[2]) if exp else threshold
        drift = (100.0 * (got_bw - exp[0]) / exp[0]) if exp and got_bw is not None and exp[0] > 0 else None
        verifiable = exp is None or allowed < UNVERIFIABLE_PCT
        ok = got_bw is not None and (drift is None or drift >= -allowed or not verifiable)
        rows.append(VerifyRow(key[1], got_bw, exp[0] if exp else None, allowed, drift, ok, key[0], verifiable))
    return rows, below_class


def _bandwidth_verdict(rows: list[VerifyRow], measured_any: bool, failures: list[str],
                       below_class: list[tuple[Key, ClassVerdict]],
                       reference: ClassReference | None) -> tuple[VerifyCode, bool, str]:
    """The measurement's code, whether it passed, and why, from the rows."""
    unmeasured = [r for r in rows if r.expected_gbps is not None and r.measured_gbps is None]
    unverifiable = [r for r in rows if not r.verifiable]
    judged = [r for r in rows if r.verifiable and r.expected_gbps is not None]
    excluded = ("; not verifiable (the noise there allows a drop no measurement can show): "
                + ", ".join(f"{key_label((r.collective, r.size_bytes))} (allowed -{r.allowed_pct:.0f}%)"
                            for r in unverifiable)) if unverifiable else ""
    if not measured_any:
        return "all_trials_failed", False, f"every verify trial failed: {failures[0] if failures else 'unknown'}"
    if unmeasured:
        # A size the worker skipped (not enough free GPU memory) or that failed: no drift to rank.
        return "not_measured", False, (f"{', '.join(key_label((r.collective, r.size_bytes)) for r in unmeasured)}: "
                                       "not measured" + (f" ({failures[0]})" if failures else ""))
    if below_class and reference is not None:
        key, worst = min(below_class, key=lambda kv: kv[1].ratio)
        return "below_class", False, (f"{key_label(key)}: {worst.measured_gbps:.2f} GB/s is "
                                      f"{-worst.drift_pct:.1f}% below the median {worst.class_median_gbps:.2f} GB/s "
                                      f"of the {reference.sizes[key].nodes} node(s) of its class "
                                      f"{reference.class_id} (allowed {worst.allowed_pct:.1f}%)")
    if unverifiable and not judged:
        return "not_verifiable", False, ("no size can be verified" + excluded
                                         + "; sweep again on a quiet node, or verify against --floor")
    if any(not r.ok for r in rows if r.expected_gbps is not None):
        worst_row = min((r for r in rows if r.drift_pct is not None and not r.ok), key=lambda r: r.drift_pct or 0.0)
        return "below_expectation", False, (f"{key_label((worst_row.collective, worst_row.size_bytes))}: "
                                            f"{worst_row.measured_gbps:.2f} GB/s is "
                                            f"{-(worst_row.drift_pct or 0):.1f}% below the expected "
                                            f"{worst_row.expected_gbps:.2f}")
    return "passed", True, "bus bandwidth as expected" + (
        f" at {len(judged)} size(s)" + excluded if unverifiable else "")


def run_verify(cfg: Config, *, demo: str | bool | None = None, floor_gbps: float | None = None,
               use_current: bool = False, threshold_pct: float | None = None, force: bool = False,
               node: Node | None = None, repeats: int = 2, quick: bool = False,
               abort_check: Callable[[], str | None] | None = None, baseline_run: int | None = None) -> VerifyResult:
    """The worker's interpreter is bench.python (or found); `force` verifies on busy GPUs. A node
    with one GPU is checked by `verify_one_gpu` (what NCCL runs, nothing timed).

    `baseline_run` (a run id): also fail when this measurement is slower than that run's (its
    published setting, or its defaults with `use_current`) beyond the noise of both, at any size.

    Raises: InputError for a sweep.profile that names no profile (exit 78); CheckFailed when
    there is nothing to compare against; BusyError when GPUs are in use or a sweep (or another
    verify) is measuring: trials side by side would skew both; UsageError when `baseline_run` is
    not in the history."""
    check_profile(cfg)
    node = node or load_node(cfg, demo)
    if not node.demo and busy_gpus(node.snapshot) and not force:
        raise BusyError("compute processes are using the GPUs; verify would disturb them", hint="--force")
    if not node.measurable:
        if floor_gbps is not None or baseline_run is not None:
            raise UsageError(f"{'--floor' if floor_gbps is not None else '--baseline'}: this node has one GPU, where "
                             f"verify times nothing ({NOT_TIMED}): it checks what NCCL runs")
        return verify_one_gpu(cfg, node, use_current=use_current, quick=quick, abort_check=abort_check)
    sizes, collectives, repeats, checked = _scope(cfg, node, repeats, quick)
    threshold = cfg.daemon.drift_threshold_pct if threshold_pct is None else threshold_pct
    state = Path(cfg.state_dir)
    env, source, got = _published_env(cfg, use_current)
    # The published values win over the calling environment's (the runner lays the candidate on top).
    base_env = dict(os.environ)
    ensure_dir(state, "state directory")
    reference, class_prov = (None, None) if use_current or floor_gbps is not None else _class_in_force(cfg, got)
    with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
        reap_leftover_ranks(state / RANK_RECORD)
        remove_leftover_temps(cfg)
        keys = [(c, s) for c in collectives for s in sizes]
        class_keys = {k for k in keys if reference is not None and k in reference.sizes}
        if class_keys and reference is not None:
            expected, expectation, counts = _with_class(reference, class_keys, keys, store, node, sizes, collectives)
        else:
            expected, expectation, counts = _expectations(store, node, floor_gbps, use_current, sizes, collectives)
        if baseline_run is not None and store.run(baseline_run) is None:
            raise UsageError(f"--baseline {baseline_run}: no such run in the history", hint="see `nccltune history`")
        engine = resolve_engine(cfg, node, collectives)
        runner = Runner(python=engine.python, backend=node.backend, nccl_tests=engine.nccl_tests,
                        nranks=node.nranks, base_env=base_env, work_dir=state / "verify",
                        # NCCL's own log proves what it ran (GPU nodes; gloo writes none).
                        timeout_s=cfg.bench.trial_timeout_s, gpus=cfg.bench.gpus, nccl_debug=not node.demo,
                        abort_check=abort_check, rank_record=state / RANK_RECORD, user=cfg.bench.user,
                        fork_ranks=cfg.bench.fork_ranks)
        run_id = start_run(store, kind="verify", cfg=cfg, node=node, profile=None,
                           topology={"source": node.topo.source})
        session = TrialSession(store, run_id, runner, sizes, cfg=cfg, node=node, collectives=collectives)
        best, samples, last_good = _measure(session, runner, env, repeats)
        failures = [reason for _label, reason in session.failed]
        nccl_version = session.nccl_version
        rows, below_class = _rows(keys, expected, counts, best, samples, class_keys, reference, threshold)
        code, passed, reason = _bandwidth_verdict(rows, bool(best), failures, below_class, reference)
        if passed and baseline_run is not None:
            slower = baseline_slower(store, baseline_run, run_id, "defaults" if use_current else "published")
            if slower:
                code, passed, reason = "slower_than_baseline", False, slower
        ran = None if node.demo else _what_ran(last_good, env)
        if passed and ran is not None and not ran.passed:
            code, passed, reason = ran.findings[0].code, False, "; ".join(f.message for f in ran.findings)
        ref_kind: Reference = "floor" if floor_gbps is not None else "class" if class_keys else "sweep"
        session.finish("ok" if passed else "failed",
                       VerifySummary(passed=passed, code=code, reason=reason, expectation=expectation,
                                     rows=tuple(rows), env_source=source, method=session.method,
                                     reference=ref_kind, checked=checked,
                                     class_profile=class_prov if class_keys else None,
                                     nccl_ran=ran.doc() if ran else None))
    return VerifyResult(passed=passed, reason=reason, env=env, env_source=source, rows=rows, demo=node.demo,
                        fingerprint=node.fingerprint, run_id=run_id, expectation=expectation,
                        nccl_version=nccl_version, code=code, reference=ref_kind, checked=checked,
                        class_profile=class_prov if class_keys else None, nccl_ran=ran.doc() if ran else None)


def _current_env() -> dict[str, str]:
    """`--current` on a node with one GPU: the calling environment's variables a published set
    would carry (NCCL's own, less its debug log's, which the check sets, and the host id, which
    each check rank gets; the tuner table's)."""
    return {k: v for k, v in os.environ.items()
            if (k.startswith("NCCL_") and not k.startswith("NCCL_DEBUG") and k != HOSTID_VAR)
            or k.startswith("NCCLTUNE_TUNER_")}


def _one_gpu_verdict(report: OneGpuReport, demo: bool) -> tuple[bool, VerifyCode, str, WhatRan | None]:
    """Passed, its code, why, and the verdict over every shape's NCCL log (None: no log read)."""
    outcomes = report.outcomes
    if not outcomes:
        return True, "passed", f"nothing NCCL runs can differ from its defaults: the published set holds " \
                               f"{report.plan.holds}", None
    verdicts = {o.check.label: o.ran for o in outcomes if o.ran is not None}
    ran = combined(verdicts) if verdicts else None
    failed = [o for o in outcomes if not o.result.ok]
    if failed:
        code: VerifyCode = "all_trials_failed" if len(failed) == len(outcomes) else "not_measured"
        return False, code, "; ".join(f"{o.check.label}: {o.result.reason or o.result.status}" for o in failed), ran
    if demo and ran is None:
        labels = ", ".join(o.check.label for o in outcomes)
        return True, "passed", (f"CPU demo (gloo): {labels} formed on the recording's one GPU and every result "
                                "correct; gloo writes no NCCL log, so nothing NCCL runs is proven here"), None
    missing = [o.check.label for o in outcomes if o.ran is None]
    if missing:
        return False, "nccl_log_missing", (f"{', '.join(missing)}: no NCCL log of rank 0 to read, so what NCCL ran "
                                           "is not proven"), ran
    assert ran is not None
    if not ran.passed:
        return False, ran.findings[0].code, "; ".join(f.message for f in ran.findings), ran
    # A table span the check ran sizes in, yet no choice compared: the proof would be empty.
    empty = [o.check.label for o in outcomes if o.check.spans and o.ran is not None and not o.ran.cells_checked]
    if empty:
        return False, "table_not_applied", (f"table not applied at sizes of {', '.join(empty)}: the plugin "
                                            "applied no table entry NCCL logged a choice for"), ran
    shapes = ", ".join(o.check.label for o in outcomes)
    return True, "passed", (f"NCCL ran as published for {shapes}: {ran.cells_checked} choice(s) equal the "
                            "table's entries" if ran.cells_checked else
                            f"NCCL ran as published for {shapes} (variables and tuner plugin)"), ran


def verify_one_gpu(cfg: Config, node: Node, *, use_current: bool = False, quick: bool = False,
                   abort_check: Callable[[], str | None] | None = None) -> VerifyResult:
    """verify on a node with one GPU (checks/onegpu.py): for each shape N x 1 the published table
    holds, N rank processes on the one GPU, each its own NCCL host, with the published environment
    of a job of N nodes; what NCCL ran, from rank 0's log, by nccl.ran's rule. Nothing is timed.
    `quick`: one shape, one size per table span (a prolog's check).

    Raises:
        CheckFailed: nothing is published (and not `use_current`).
        BusyError: a sweep or another verify is measuring.
    """
    started = time.monotonic()
    got: PublishedSet | None = None
    if use_current:
        env, source = _current_env(), "current environment"
    else:
        got = read_set(cfg.publish_dir)
        if got is None:
            raise CheckFailed(f"nothing is published in {cfg.publish_dir}",
                              hint="run `nccltune sweep` or `nccltune apply`, or pass --current to check the "
                                   "calling environment")
        # A job over several nodes: the every-job part alone.
        env, source = job_env(got, nnodes=2), f"published in {cfg.publish_dir}"
    table, problem = published_table(env)
    plan = plan_checks(env, table, problem, quick=quick)
    report = OneGpuReport(plan, quick)
    state = Path(cfg.state_dir)
    ensure_dir(state, "state directory")
    with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
        reap_leftover_ranks(state / RANK_RECORD)
        remove_leftover_temps(cfg)
        run_id = start_run(store, kind="verify", cfg=cfg, node=node, profile=None,
                           topology={"source": node.topo.source})
        try:
            # The worker's interpreter is looked for only where ranks start.
            python = find_worker_python(cfg.bench.python) if plan.shapes else ""
            with shared_gpu(state / "verify", rank_user(cfg.bench.user),
                            enabled=cfg.bench.mps and bool(plan.shapes) and not node.demo) as sharing:
                report.sharing = sharing
                ranks = RankSettings(python=python, backend=node.backend, base_env={**os.environ, **sharing.env},
                                     work_dir=state / "verify", timeout_s=cfg.bench.trial_timeout_s,
                                     gpus=cfg.bench.gpus, rank_record=state / RANK_RECORD, user=cfg.bench.user,
                                     abort_check=abort_check, fork_ranks=cfg.bench.fork_ranks)
                for seq, check in enumerate(plan.shapes, 1):
                    outcome = run_shape(check, env, table, ranks, quick=quick)
                    report.outcomes.append(outcome)
                    # No measurements: times of ranks that share one GPU are artifacts, never a number.
                    store.add_trial(run_id, seq=seq, phase="verify", label=f"one GPU: {check.label} NCCL hosts",
                                    env=env, status=outcome.result.status, reason=outcome.result.reason,
                                    wall_s=outcome.result.wall_s, nccl=outcome.result.nccl)
        except BaseException:
            store.finish_run(run_id, status="interrupted", summary=VerifySummary(error="interrupted"))
            raise
        report.wall_s = time.monotonic() - started
        passed, code, reason, ran = _one_gpu_verdict(report, node.demo)
        shapes = "; ".join(c.describe() for c in plan.shapes)
        checked = (("quick: " if quick else "")
                   + (f"NCCL's log of rank 0 of N NCCL hosts on the one GPU for {shapes}" if shapes else
                      f"the published set: {plan.holds}")
                   + f"; {NOT_TIMED}; {report.sharing.label}; wall time {report.wall_s:.1f} s")
        expectation = f"what the published set holds: {plan.holds}"
        nccl_version = next((o.result.nccl_version for o in report.outcomes if o.result.nccl_version), None)
        store.finish_run(run_id, status="ok" if passed else "failed",
                         summary=VerifySummary(passed=passed, code=code, reason=reason, expectation=expectation,
                                               env_source=source, reference="none", checked=checked,
                                               nccl_ran=ran.doc() if ran else None, one_gpu=report.doc()))
    return VerifyResult(passed=passed, reason=reason, env=env, env_source=source, rows=[], demo=node.demo,
                        fingerprint=node.fingerprint, run_id=run_id, expectation=expectation,
                        nccl_version=nccl_version, code=code, reference="none", checked=checked,
                        nccl_ran=ran.doc() if ran else None, one_gpu=report.doc())
