"""`nccltune verify`: a quick all-reduce with the published environment against expectations.

Expectations come from a floor given on the command line (GB/s busbw at the largest size
measured) or from the last sweep of this node's topology (the medians it measured for the
published setting). A size counts as degraded when it is below expectation by more than the
drift threshold, or by more than twice the noise that sweep measured at that size, whichever
is larger. Usable from a Slurm prolog or a health check: two short trials, exit 1 on failure.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .config import Config, config_to_dict
from .errors import BusyError, CheckFailed
from .lock import SweepLock
from .pipeline import DEMO_ITERS, DEMO_WARMUP, Node, busy_gpus, load_node, resolve_engine
from .publish import read_published
from .store import Backend, Measurement, Store, TrialStatus
from .sweep.select import fmt_size
from .trials.runner import RANK_RECORD, Runner, find_worker_python, reap_leftover_ranks
from .trust import ensure_dir

GPU_VERIFY_SIZES = (16 << 20, 256 << 20, 1 << 30)
DEMO_VERIFY_SIZES = (262144, 1 << 20, 4 << 20)


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
        return {max(sizes): (floor_gbps, 0.0)}, f"floor {floor_gbps:g} GB/s at {fmt_size(max(sizes))}"
    run = store.latest_run(node.fingerprint, kind="sweep", status="ok")
    if run is None or not run.summary or "rows" not in run.summary:
        raise CheckFailed("no expectation to verify against: no finished sweep for this topology "
                          f"(fingerprint {node.fingerprint})", hint="run `nccltune sweep`, or pass --floor GBPS")
    key = "default_busbw_gbps" if use_current else "tuned_busbw_gbps"
    out = {}
    for row in run.summary["rows"]:
        if int(row["size_bytes"]) in sizes:
            out[int(row["size_bytes"])] = (float(row[key]), float(row.get("default_noise_pct", 0.0)))
    if not out:
        # Without this, every row would lack an expectation and verify would pass vacuously.
        raise CheckFailed(f"sweep {run.id} measured none of the verify sizes "
                          f"({', '.join(fmt_size(s) for s in sizes)})",
                          hint="re-run `nccltune sweep` with the current bench sizes, or pass --floor GBPS")
    return out, f"sweep {run.id} of {run.started_at[:19]}"


def _trial_status(status: str) -> TrialStatus:
    known: tuple[TrialStatus, ...] = ("ok", "failed", "timeout", "crashed", "wrong_result", "error")
    for k in known:
        if status == k:
            return k
    return "error"


def verify_sizes(cfg: Config, node: Node) -> list[int]:
    if node.demo:
        return list(DEMO_VERIFY_SIZES)
    from .pipeline import size_ladder

    ladder = size_ladder(cfg, False)
    chosen = [s for s in GPU_VERIFY_SIZES if s in ladder]
    return chosen or ladder[-3:]


def run_verify(cfg: Config, *, demo: str | bool | None = None, floor_gbps: float | None = None,
               use_current: bool = False, threshold_pct: float | None = None, python: str | None = None,
               force: bool = False, node: Node | None = None, repeats: int = 2,
               abort_check: Callable[[], str | None] | None = None) -> VerifyResult:
    """Raises: CheckFailed when there is nothing to compare against; BusyError when GPUs are in use
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
        got = read_published(cfg.publish_dir)
        if got is None:
            raise CheckFailed(f"nothing is published in {cfg.publish_dir}",
                              hint="run `nccltune sweep`, or pass --current to check the calling environment")
        env, _prov = got
        source = f"published in {cfg.publish_dir}"
    import os

    # The published values win over the calling environment's (the runner lays the candidate on top).
    base_env = dict(os.environ)
    ensure_dir(state, "state directory")
    with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
        reap_leftover_ranks(state / RANK_RECORD)
        expected, expectation = _expectations(store, node, floor_gbps, use_current, sizes)
        nccl_tests = resolve_engine(cfg, node)
        worker_python = (python or cfg.bench.python or sys.executable) if nccl_tests else \
            find_worker_python(python or cfg.bench.python)
        runner = Runner(python=worker_python, backend=node.backend, nccl_tests=nccl_tests,
                        nranks=node.nranks, base_env=base_env, work_dir=state / "verify",
                        timeout_s=cfg.bench.trial_timeout_s, gpus=cfg.bench.gpus, nccl_debug=False,
                        abort_check=abort_check, rank_record=state / RANK_RECORD)
        warmup, iters = (DEMO_WARMUP, DEMO_ITERS) if node.demo else (cfg.bench.warmup_iters, cfg.bench.iters)
        backend: Backend = "gloo" if node.backend == "gloo" else "nccl"
        run_id = store.start_run(
            kind="verify", fingerprint=node.fingerprint, backend=backend, demo=node.demo,
            profile=None, nccl_version=None, driver_version=node.topo.driver_version, torch_version=None,
            nccltune_version=__version__, hostname=socket.gethostname().split(".")[0],
            topology={"source": node.topo.source}, config=config_to_dict(cfg))
        best: dict[int, float] = {}
        nccl_version = None
        failures = []
        try:
            for i in range(repeats):
                res = runner.run(env, sizes, warmup=warmup, iters=iters, label=f"verify #{i + 1}")
                store.add_trial(run_id, seq=i + 1, phase="verify", label=f"verify #{i + 1}", env=env,
                                status=_trial_status(res.status), reason=res.reason,
                                wall_s=res.wall_s, nccl=res.nccl,
                                measurements=[Measurement(s.size_bytes, s.time_us, s.algbw_gbps, s.busbw_gbps,
                                                          s.algo, s.proto, s.correct) for s in res.sizes])
                nccl_version = nccl_version or res.start.get("nccl_version")
                if not res.ok:
                    failures.append(res.reason or res.status)
                    continue
                for s in res.sizes:
                    # The better of the repeats: a degraded link is slow every time, noise is not.
                    best[s.size_bytes] = max(best.get(s.size_bytes, 0.0), s.busbw_gbps)
        except BaseException:
            runner.kill()
            store.finish_run(run_id, status="interrupted", summary={"error": "interrupted"})
            raise
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
            passed, reason = False, (f"{', '.join(fmt_size(r.size_bytes) for r in unmeasured)}: not measured"
                                     + (f" ({failures[0]})" if failures else ""))
        elif any(not r.ok for r in rows if r.expected_gbps is not None):
            worst = min((r for r in rows if r.drift_pct is not None), key=lambda r: r.drift_pct or 0.0)
            passed, reason = False, (f"{fmt_size(worst.size_bytes)}: {worst.measured_gbps:.2f} GB/s is "
                                     f"{-(worst.drift_pct or 0):.1f}% below the expected {worst.expected_gbps:.2f}")
        else:
            passed, reason = True, "bus bandwidth as expected"
        store.finish_run(run_id, status="ok" if passed else "failed",
                         summary={"passed": passed, "reason": reason, "expectation": expectation,
                                  "rows": [vars(r) for r in rows], "env_source": source})
    return VerifyResult(passed=passed, reason=reason, env=env, env_source=source, rows=rows, demo=node.demo,
                        fingerprint=node.fingerprint, run_id=run_id, expectation=expectation,
                        nccl_version=nccl_version)
