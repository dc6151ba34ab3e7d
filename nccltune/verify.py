"""`nccltune verify`: a quick all-reduce with the published environment against expectations.

Expectations come from a floor given on the command line (GB/s busbw at the largest size
measured) or from the last sweep of this node's topology (the medians it measured for the
published setting). A size counts as degraded when it is below expectation by more than the
drift threshold, or by more than twice the noise that sweep measured at that size, whichever
is larger. Usable from a Slurm prolog or a health check: two short trials, exit 1 on failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config
from .errors import BusyError, CheckFailed
from .lock import SweepLock
from .names import format_size
from .node import ONE_GPU, Node, busy_gpus, load_node, size_ladder
from .publish import job_env, read_set
from .store import Store
from .trials.runner import RANK_RECORD, Runner, reap_leftover_ranks
from .trials.session import TrialSession, resolve_engine, start_run
from .trust import ensure_dir

GPU_VERIFY_SIZES = (16 << 20, 256 << 20, 1 << 30)
DEMO_VERIFY_SIZES = (262144, 1 << 20, 4 << 20)

# What verify says on a node with one GPU, where a sweep measured nothing (exit 0).
NOTHING_TO_VERIFY = f"{ONE_GPU}: nothing to verify (a sweep there publishes only what fits every job)"


@dataclass
class VerifyRow:
    size_bytes: int
    measured_gbps: float | None
    expected_gbps: float | None
    allowed_pct: float
    drift_pct: float | None
    ok: bool


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

    @property
    def max_drift_pct(self) -> float | None:
        drifts = [r.drift_pct for r in self.rows if r.drift_pct is not None]
        return min(drifts) if drifts else None


def _expectations(store: Store, node: Node, floor_gbps: float | None, use_current: bool,
                  sizes: list[int]) -> tuple[dict[int, tuple[float, float]], str]:
    """size -> (expected busbw, noise pct of that size), and where the numbers come from."""
    if floor_gbps is not None:
        return {max(sizes): (floor_gbps, 0.0)}, f"floor {floor_gbps:g} GB/s at {format_size(max(sizes))}"
    run = store.latest_run(node.fingerprint, kind="sweep", status="ok")
    if run is None or not run.rows:
        raise CheckFailed("no expectation to verify against: no finished sweep for this topology "
                          f"(fingerprint {node.fingerprint})", hint="run `nccltune sweep`, or pass --floor GBPS")
    out = {}
    for row in run.rows:
        if row.size_bytes in sizes:
            expected = row.default_busbw_gbps if use_current else row.tuned_busbw_gbps
            out[row.size_bytes] = (expected, row.default_noise_pct)
    if not out:
        # Without this, every row would lack an expectation and verify would pass vacuously.
        raise CheckFailed(f"sweep {run.id} measured none of the verify sizes "
                          f"({', '.join(format_size(s) for s in sizes)})",
                          hint="re-run `nccltune sweep` with the current bench sizes, or pass --floor GBPS")
    return out, f"sweep {run.id} of {run.started_at[:19]}"


def verify_sizes(cfg: Config, node: Node) -> list[int]:
    if node.demo:
        return list(DEMO_VERIFY_SIZES)
    ladder = size_ladder(cfg, False)
    chosen = [s for s in GPU_VERIFY_SIZES if s in ladder]
    return chosen or ladder[-3:]


def run_verify(cfg: Config, *, demo: str | bool | None = None, floor_gbps: float | None = None,
               use_current: bool = False, threshold_pct: float | None = None, force: bool = False,
               node: Node | None = None, repeats: int = 2,
               abort_check: Callable[[], str | None] | None = None) -> VerifyResult:
    """The worker's interpreter is bench.python (or found); `force` verifies on busy GPUs.

    Raises: CheckFailed when there is nothing to compare against; BusyError when GPUs are in use
    or a sweep (or another verify) is measuring: trials side by side would skew both."""
    node = node or load_node(cfg, demo)
    if not node.demo and busy_gpus(node.snapshot) and not force:
        raise BusyError("compute processes are using the GPUs; verify would disturb them", hint="--force")
    sizes = verify_sizes(cfg, node)
    threshold = cfg.daemon.drift_threshold_pct if threshold_pct is None else threshold_pct
    state = Path(cfg.state_dir)
    env: dict[str, str] = {}
    source = "current environment"
    if not use_current:
        got = read_set(cfg.publish_dir)
        if got is None:
            raise CheckFailed(f"nothing is published in {cfg.publish_dir}",
                              hint="run `nccltune sweep`, or pass --current to check the calling environment")
        # Verify runs a job on this one node: it gets both parts, as such a job does.
        env = job_env(got, nnodes=1)
        source = f"published in {cfg.publish_dir}"
    # The published values win over the calling environment's (the runner lays the candidate on top).
    base_env = dict(os.environ)
    ensure_dir(state, "state directory")
    with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
        reap_leftover_ranks(state / RANK_RECORD)
        expected, expectation = _expectations(store, node, floor_gbps, use_current, sizes)
        engine = resolve_engine(cfg, node)
        runner = Runner(python=engine.python, backend=node.backend, nccl_tests=engine.nccl_tests,
                        nranks=node.nranks, base_env=base_env, work_dir=state / "verify",
                        timeout_s=cfg.bench.trial_timeout_s, gpus=cfg.bench.gpus, nccl_debug=False,
                        abort_check=abort_check, rank_record=state / RANK_RECORD)
        run_id = start_run(store, kind="verify", cfg=cfg, node=node, profile=None,
                           topology={"source": node.topo.source})
        session = TrialSession(store, run_id, runner, sizes, cfg=cfg, node=node)
        best: dict[int, float] = {}
        try:
            for i in range(repeats):
                res = session.trial(env, "verify", f"verify #{i + 1}")
                if not res.ok:
                    continue
                for s in res.sizes:
                    # The better of the repeats: a degraded link is slow every time, noise is not.
                    best[s.size_bytes] = max(best.get(s.size_bytes, 0.0), s.busbw_gbps)
        except BaseException:
            session.abandon("interrupted", {"error": "interrupted"})
            raise
        failures = [reason for _label, reason in session.failed]
        nccl_version = session.nccl_version
        rows = []
        for size in sizes:
            exp = expected.get(size)
            got_bw = best.get(size)
            allowed = max(threshold, 2.0 * exp[1]) if exp else threshold
            drift = (100.0 * (got_bw - exp[0]) / exp[0]) if exp and got_bw is not None and exp[0] > 0 else None
            ok = got_bw is not None and (drift is None or drift >= -allowed)
            rows.append(VerifyRow(size, got_bw, exp[0] if exp else None, allowed, drift, ok))
        unmeasured = [r for r in rows if r.expected_gbps is not None and r.measured_gbps is None]
        if not best:
            passed, reason = False, f"every verify trial failed: {failures[0] if failures else 'unknown'}"
        elif unmeasured:
            # A size the worker skipped (not enough free GPU memory) or that failed: no drift to rank.
            passed, reason = False, (f"{', '.join(format_size(r.size_bytes) for r in unmeasured)}: not measured"
                                     + (f" ({failures[0]})" if failures else ""))
        elif any(not r.ok for r in rows if r.expected_gbps is not None):
            worst = min((r for r in rows if r.drift_pct is not None), key=lambda r: r.drift_pct or 0.0)
            passed, reason = False, (f"{format_size(worst.size_bytes)}: {worst.measured_gbps:.2f} GB/s is "
                                     f"{-(worst.drift_pct or 0):.1f}% below the expected {worst.expected_gbps:.2f}")
        else:
            passed, reason = True, "bus bandwidth as expected"
        session.finish("ok" if passed else "failed",
                       {"passed": passed, "reason": reason, "expectation": expectation,
                        "rows": [vars(r) for r in rows], "env_source": source})
    return VerifyResult(passed=passed, reason=reason, env=env, env_source=source, rows=rows, demo=node.demo,
                        fingerprint=node.fingerprint, run_id=run_id, expectation=expectation,
                        nccl_version=nccl_version)
