"""The sweep pipeline: topology -> plan -> trials -> choice -> publish, with records kept.

Used by `nccltune sweep` and by the daemon. A failed or interrupted sweep publishes nothing:
trials use a topology file in the run's own directory, and the published files (env files,
ncclTopology.xml, the nccl.conf block) are replaced only after a choice has been made.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from . import __version__
from .config import Config, config_to_dict
from .errors import BusyError, InputError, UnavailableError, UsageError
from .hw.types import Snapshot
from .lock import SweepLock
from .publish import Provenance, PublishedFiles, atomic_write, preflight, publish, update_nccl_conf
from .store import Backend, Measurement, Phase, RunStatus, Store, TrialStatus
from .sweep.plan import Plan, build_plan
from .sweep.select import BUILTIN_PROFILES, fmt_size, profile_weights
from .sweep.space import CATALOGUE, unknown_variable_hint
from .sweep.strategy import Finalist, Search, SearchResult, Settings, label_of
from .topology.fingerprint import topology_fingerprint
from .topology.model import Topology, from_snapshot
from .topology.ncclxml import render_xml
from .topology.paths import PathMatrix, compute_paths
from .topology.snapshot import load_snapshot, record_snapshot
from .topology.source import resolve_snapshot
from .trials.runner import RANK_RECORD, Runner, TrialAborted, TrialResult, find_worker_python, reap_leftover_ranks
from .trust import ensure_dir

log = logging.getLogger(__name__)

DEMO_LABEL = "CPU DEMO (gloo backend): these are not NCCL numbers"
# The demo ladder stays small: gloo on two CPU cores moves megabytes, not gigabytes, per second.
DEMO_SIZES = (4096, 16384, 65536, 262144, 1048576, 4194304)
DEMO_WARMUP, DEMO_ITERS = 2, 5
POLICY_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@dataclass
class Node:
    """What a sweep runs on: the topology, and how ranks are started there."""

    topo: Topology
    paths: PathMatrix
    snapshot: Snapshot
    demo: bool
    backend: str
    nranks: int

    @property
    def fingerprint(self) -> str:
        return topology_fingerprint(self.topo)


def size_ladder(cfg: Config, demo: bool) -> list[int]:
    if demo:
        return list(DEMO_SIZES)
    sizes, s = [], cfg.bench.min_bytes
    while s <= cfg.bench.max_bytes:
        sizes.append(s)
        s *= cfg.bench.factor
    return sizes


def load_node(cfg: Config, demo: str | bool | None) -> Node:
    """The node to sweep: this one (NVML), or a recorded snapshot for the CPU demo.

    Raises:
        UnavailableError: no NVIDIA GPU here and no --demo (exit 69).
    """
    if demo:
        path = resolve_snapshot(demo if isinstance(demo, str) else cfg.topology.snapshot)
        snap = load_snapshot(path)
        topo = from_snapshot(snap, with_nics=cfg.topology.with_nics, source=f"snapshot:{path.name} (CPU demo)")
        return Node(topo, compute_paths(topo), snap, True, "gloo", cfg.bench.nranks or 2)
    if cfg.topology.snapshot:
        snap = load_snapshot(resolve_snapshot(cfg.topology.snapshot))
        source = f"snapshot:{cfg.topology.snapshot}"
    else:
        try:
            snap = record_snapshot()
        except UnavailableError as exc:
            raise UnavailableError(
                f"no NVIDIA GPU can be used here: {exc.message}",
                hint="run `nccltune sweep --demo` for the same pipeline on the CPU (gloo) over a recorded "
                     "topology",
            ) from exc
        source = "nvml"
    if not snap.nvml.gpus:
        raise UnavailableError("NVML sees no GPU on this node", hint="use --demo on machines without GPUs")
    topo = from_snapshot(snap, with_nics=cfg.topology.with_nics, source=source)
    backend = "gloo" if cfg.bench.backend == "gloo" else "nccl"
    gpus = cfg.bench.gpus or [g.index for g in snap.nvml.gpus]
    nranks = cfg.bench.nranks or len(gpus)
    if nranks < 2:
        raise UsageError("an all-reduce sweep needs at least two GPUs")
    return Node(topo, compute_paths(topo), snap, False, backend, nranks)


def resolve_engine(cfg: Config, node: Node) -> str | None:
    """Path of all_reduce_perf when bench.engine is nccl-tests, None for the torch worker.

    Raises:
        InputError: nccl-tests asked for in the CPU demo (exit 78).
        UnavailableError: all_reduce_perf not found (exit 69).
    """
    if cfg.bench.engine != "nccl-tests":
        return None
    from .trials.nccltests import find_binary

    if node.demo:
        raise InputError(cfg.path or "config", "bench.engine nccl-tests measures NCCL on GPUs; the CPU demo "
                         "needs the torch worker (bench.engine: torch)", line=cfg.lines.get("bench.engine"))
    binary = find_binary(cfg.bench.nccl_tests_dir)
    if binary is None:
        raise UnavailableError("all_reduce_perf (nccl-tests) not found in bench.nccl_tests_dir or on PATH",
                               hint="build nccl-tests, or set bench.engine: torch")
    return binary


def busy_gpus(snap: Snapshot) -> dict[int, tuple[int, ...]]:
    return {g.index: tuple(p.pid for p in g.processes) for g in snap.nvml.gpus if g.processes}


def check_config_variables(cfg: Config) -> None:
    """Every variable and value the config names must be known and valid (file:line on error)."""
    where = cfg.path or "config"
    for section, mapping in (("sweep.variables", cfg.sweep.variables), ("sweep.pin", cfg.sweep.pin)):
        for name, values in mapping.items():
            line = cfg.lines.get(f"{section}.{name}")
            tunable = CATALOGUE.get(name)
            if tunable is None and section == "sweep.variables":
                raise InputError(where, f"{section}.{name}: not a variable nccltune knows how to sweep",
                                 line=line, hint=unknown_variable_hint(name))
            for value in ([values] if isinstance(values, str) else values):
                problem = tunable.validate(value) if tunable else None
                if problem:
                    raise InputError(where, f"{section}.{name}: {problem}", line=line)


def make_plan(cfg: Config, node: Node, env: Mapping[str, str], unpin: list[str]) -> Plan:
    check_config_variables(cfg)
    policy = {POLICY_VAR: str(cfg.sweep.async_error_handling)}
    preflight(cfg.publish_dir, {**policy, **cfg.sweep.pin},
              {n: f"{cfg.path or 'config'}:{cfg.lines.get(f'sweep.pin.{n}')}" for n in cfg.sweep.pin})
    return build_plan(
        node.topo, node.paths, env=env, config_pins=cfg.sweep.pin, unpin=[*cfg.sweep.unpin, *unpin],
        variables=cfg.sweep.variables, exclude=cfg.sweep.exclude, policy=policy,
        sizes=size_ladder(cfg, node.demo), backend=node.backend, nranks=node.nranks,
    )


def estimate_seconds(plan: Plan, trials: int, cfg: Config, demo: bool, node: Node) -> float:
    """Rough time: process start and communicator set-up, plus the data moved per size."""
    overhead = 2.5 if demo else 7.0
    warmup, iters = (DEMO_WARMUP, DEMO_ITERS) if demo else (cfg.bench.warmup_iters, cfg.bench.iters)
    bws = [p.bw_gbps for (a, b), p in node.paths.gpu_gpu.items() if a != b]
    bw = 0.3 if demo else max(1.0, min(bws) if bws else 10.0)
    per_trial = overhead + sum((warmup + iters + 2) * (30e-6 + s / (bw * 1e9)) for s in plan.sizes)
    return trials * per_trial


@dataclass
class SweepReport:
    run_id: int | None
    demo: bool
    backend: str
    fingerprint: str
    plan: Plan
    result: SearchResult | None
    chosen_env: dict[str, str]
    chosen_label: str
    published: PublishedFiles | None
    topology_file: str | None
    nccl_version: str | None
    torch_version: str | None
    trials: int
    failed_trials: list[tuple[str, str]]
    wall_s: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: str = ""
    profile: str | None = None
    method: str | None = None  # how the trials measured: placement and timing


ProgressFn = Callable[[int, int, str, str, "TrialResult | None"], None]


class SweepPipeline:
    def __init__(self, cfg: Config, *, demo: str | bool | None = None, profile: str | None = None,
                 exhaustive: bool = False, force: bool = False, unpin: list[str] | None = None,
                 progress: ProgressFn | None = None, abort_check: Callable[[], str | None] | None = None,
                 env: Mapping[str, str] | None = None, python: str | None = None,
                 node: Node | None = None) -> None:
        self.cfg = cfg
        self.demo = demo
        self.profile = profile or cfg.sweep.profile
        self.exhaustive = exhaustive or cfg.sweep.strategy == "exhaustive"
        self.force = force or cfg.sweep.force
        self.unpin = unpin or []
        self.progress = progress
        self.abort_check = abort_check
        self.env = dict(os.environ if env is None else env)
        self.python = python or cfg.bench.python
        self._node = node
        self.nccl_tests: str | None = None
        self.worker_python = self.python or sys.executable
        if self.profile not in BUILTIN_PROFILES and self.profile not in cfg.sweep.profiles:
            raise InputError(cfg.path or "config", f"unknown profile {self.profile!r}",
                             line=cfg.lines.get("sweep.profile"),
                             hint=f"built in: {', '.join(BUILTIN_PROFILES)}; or define sweep.profiles")

    def node(self) -> Node:
        if self._node is None:
            self._node = load_node(self.cfg, self.demo)
        return self._node

    def plan(self) -> tuple[Plan, Search]:
        node = self.node()
        plan = make_plan(self.cfg, node, self.env, self.unpin)
        weights = profile_weights(self.profile, plan.sizes, self.cfg.sweep.profiles)
        search = Search(plan, self.settings(node), lambda e, p, lbl: None,
                        common={"NCCL_TOPO_FILE": "<topology file>"}, weights=weights)
        return plan, search

    def settings(self, node: Node) -> Settings:
        s = self.cfg.sweep
        return Settings(baseline_repeats=s.baseline_repeats, finalist_repeats=s.finalist_repeats,
                        max_finalists=s.max_finalists, min_gain_pct=s.min_gain_pct,
                        max_regression_pct=s.max_regression_pct, exhaustive=self.exhaustive)

    def run(self) -> SweepReport:
        started = time.monotonic()
        node = self.node()
        if not node.demo:
            busy = busy_gpus(node.snapshot)
            if busy and not self.force:
                procs = "; ".join(f"GPU{i}: pid {', '.join(map(str, p))}" for i, p in busy.items())
                raise BusyError(f"compute processes are using the GPUs ({procs}); a sweep would disturb them",
                                hint="wait for them to finish, or pass --force")
        plan = make_plan(self.cfg, node, self.env, self.unpin)
        state = Path(self.cfg.state_dir)
        try:
            ensure_dir(state, "state directory")
        except OSError as exc:
            raise InputError(str(state), f"cannot create the state directory: {exc.strerror}") from exc
        weights = profile_weights(self.profile, plan.sizes, self.cfg.sweep.profiles)
        self.nccl_tests = resolve_engine(self.cfg, node)
        python = (self.python or sys.executable) if self.nccl_tests else find_worker_python(self.python)
        self.worker_python = find_worker_python(self.python) if not self.nccl_tests else python
        with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
            store.mark_interrupted()
            reap_leftover_ranks(state / RANK_RECORD)
            return self._run_locked(store, node, plan, weights, python, started)

    def _run_locked(self, store: Store, node: Node, plan: Plan, weights: dict[int, float], python: str,
                    started: float) -> SweepReport:
        cfg = self.cfg
        fingerprint = node.fingerprint
        run_id = store.start_run(
            kind="sweep", fingerprint=fingerprint, backend=cast(Backend, node.backend), demo=node.demo,
            profile=self.profile,
            nccl_version=None, driver_version=node.topo.driver_version, torch_version=None,
            nccltune_version=__version__, hostname=socket.gethostname().split(".")[0],
            topology={"source": node.topo.source, "gpus": len(node.topo.gpus)}, config=config_to_dict(cfg))
        try:
            work = Path(cfg.state_dir) / "runs" / f"{run_id:05d}"
            ensure_dir(work, "run directory")
            xml_text = render_xml(node.topo.system)
            trial_xml = work / "ncclTopology.xml"
            atomic_write(trial_xml, xml_text)
            base_env = {k: v for k, v in self.env.items()}
            for name, value in cfg.sweep.pin.items():
                base_env[name] = value
            for name in [*cfg.sweep.unpin, *self.unpin]:
                base_env.pop(name, None)
            # A published NCCL_TOPO_FILE from an earlier sweep must not leak into the baseline.
            base_env.pop("NCCL_TOPO_FILE", None)
            runner = Runner(python=python, backend=node.backend, nranks=node.nranks, base_env=base_env,
                            work_dir=work, timeout_s=cfg.bench.trial_timeout_s, gpus=cfg.bench.gpus,
                            abort_check=self.abort_check, nccl_tests=self.nccl_tests,
                            rank_record=Path(cfg.state_dir) / RANK_RECORD)
            warmup, iters = (DEMO_WARMUP, DEMO_ITERS) if node.demo else (cfg.bench.warmup_iters, cfg.bench.iters)
            # The policy values ride along with every candidate: a finished trial shows torch takes them.
            common = {"NCCL_TOPO_FILE": str(trial_xml), **plan.policy}
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            store.finish_run(run_id, status=cast(RunStatus, status),
                             summary={"error": str(exc) or type(exc).__name__, "trials": 0})
            raise
        search_holder: list[Search] = []
        seq = [0]
        failed: list[tuple[str, str]] = []
        seen: dict[str, str | None] = {"nccl": None, "torch": None, "method": None}  # as the first trial that tells
        nccl_info: dict[str, dict[str, Any]] = {}

        def measure(env: dict[str, str], phase: str, label: str
                    ) -> tuple[dict[int, float], dict[str, Any]] | None:
            seq[0] += 1
            total = search_holder[0].estimate_trials() if search_holder else 0
            if self.progress:
                self.progress(seq[0], max(total, seq[0]), phase, label, None)
            result = runner.run(env, plan.sizes, warmup=warmup, iters=iters, label=label)
            seen["nccl"] = seen["nccl"] or result.start.get("nccl_version") or result.nccl.get("version")
            seen["torch"] = seen["torch"] or result.start.get("torch_version")
            seen["method"] = seen["method"] or result.method
            store.add_trial(
                run_id, seq=seq[0], phase=cast(Phase, phase), label=label, env=env,
                status=cast(TrialStatus, result.status if result.status in
                            ("ok", "timeout", "crashed", "wrong_result", "error") else "failed"),
                reason=result.reason, wall_s=result.wall_s, nccl=result.nccl,
                measurements=[Measurement(s.size_bytes, s.time_us, s.algbw_gbps, s.busbw_gbps, s.algo, s.proto,
                                          s.correct) for s in result.sizes])
            if self.progress:
                self.progress(seq[0], max(total, seq[0]), phase, label, result)
            if not result.ok:
                failed.append((label, result.reason or result.status))
                log.warning("trial %d (%s) failed: %s", seq[0], label, result.reason)
                return None
            key = label_of(env)
            nccl_info.setdefault(key, {}).update(
                {str(s.size_bytes): [s.algo, s.proto] for s in result.sizes if s.algo})
            return result.busbw(), result.nccl

        try:
            search = Search(plan, self.settings(node), measure, common=common, weights=weights)
            search_holder.append(search)
            result = search.run()
            chosen = result.chosen
            chosen_env = dict(chosen.env) if chosen else {}
            if "NCCL_TOPO_FILE" in chosen_env:
                chosen_env["NCCL_TOPO_FILE"] = str(cfg.topology_file)
            config_pins = {n: p.value for n, p in plan.pinned.items() if p.source == "config"}
            publish_env = {**chosen_env, **plan.policy, **config_pins}
            rows = report_rows(result, chosen, nccl_info)
            gains = {fmt_size(r["size_bytes"]): r["ratio"] for r in rows if r.get("ratio")}
            prov = Provenance(
                nccltune_version=__version__,
                created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                topology_fingerprint=fingerprint, nccl_version=seen["nccl"], backend=node.backend,
                demo=node.demo, profile=self.profile, gains=gains,
                note=(DEMO_LABEL if node.demo else None),
                # The daemon compares this with what it computes from its own probe of the worker's
                # NCCL, so both sides take the version from the same place.
                tuning_fingerprint=tuning_fingerprint(
                    cfg, fingerprint, None if node.demo else probe_nccl(self.worker_python).get("nccl_version"),
                    node.demo))
            if "NCCL_TOPO_FILE" in chosen_env:
                atomic_write(cfg.topology_file, xml_text)
            published = publish(cfg.publish_dir, publish_env, prov,
                                topology_xml=xml_text if publish_env.get("NCCL_TOPO_FILE") == str(cfg.topology_file)
                                else None)
            if cfg.nccl_conf is not None:
                update_nccl_conf(cfg.nccl_conf, publish_env, prov)
            chosen_label = chosen.label if chosen else "NCCL defaults"
            summary = summarize(result, chosen, node.demo)
            store.finish_run(run_id, status="ok", chosen_env=publish_env, published_generation=published.generation,
                             summary={"chosen": chosen_label, "rows": rows, "summary": summary,
                                      "nccl_version": seen["nccl"], "torch_version": seen["torch"],
                                      "method": seen["method"], "trials": seq[0], "failed": failed,
                                      "plan_pruned": len(plan.pruned)})
        except BaseException as exc:
            runner.kill()
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit, TrialAborted)) else "failed"
            store.finish_run(run_id, status=cast(RunStatus, status), summary={"error": str(exc) or type(exc).__name__,
                                                             "trials": seq[0]})
            raise
        return SweepReport(
            run_id=run_id, demo=node.demo, backend=node.backend, fingerprint=fingerprint, plan=plan,
            result=result, chosen_env=publish_env, chosen_label=chosen_label, published=published,
            topology_file=str(cfg.topology_file) if "NCCL_TOPO_FILE" in chosen_env else None,
            nccl_version=seen["nccl"], torch_version=seen["torch"], trials=seq[0], failed_trials=failed,
            wall_s=round(time.monotonic() - started, 1), rows=rows, summary=summary, profile=self.profile,
            method=seen["method"])


def report_rows(result: SearchResult, chosen: Finalist | None,
                nccl_info: Mapping[str, Mapping[str, list[str | None]]]) -> list[dict[str, Any]]:
    rows = []
    tuned = chosen.stats if chosen else {}
    chosen_key = label_of(chosen.env) if chosen else "defaults"
    for size, base in sorted(result.baseline.items()):
        t = tuned.get(size)
        d_choice = nccl_info.get("defaults", {}).get(str(size))
        t_choice = nccl_info.get(chosen_key, {}).get(str(size)) if chosen else d_choice
        rows.append({
            "size_bytes": size, "weight": result.weights.get(size, 0.0),
            "default_busbw_gbps": round(base.median, 3), "default_noise_pct": round(base.noise_pct, 2),
            "tuned_busbw_gbps": round(t.median, 3) if t else round(base.median, 3),
            "ratio": round(t.median / base.median, 4) if t and base.median > 0 else 1.0,
            "default_algo_proto": "/".join(x for x in d_choice if x) if d_choice else None,
            "tuned_algo_proto": "/".join(x for x in t_choice if x) if t_choice else None,
        })
    return rows


def summarize(result: SearchResult, chosen: Finalist | None, demo: bool) -> str:
    prefix = "[CPU demo, not NCCL numbers] " if demo else ""
    if chosen is None:
        return prefix + "Nothing beat NCCL's defaults beyond the measured noise: publishing the defaults."
    v = chosen.verdict
    if chosen is result.topo_only:
        return (prefix + "No setting beat NCCL's defaults beyond the measured noise; publishing the defaults with "
                "nccltune's topology file (measured no slower than without it).")
    gain = (f"{v.gain_pct:+.2f}% ({v.robust_gain_pct:+.2f}% beyond the run-to-run noise at each size; "
            f"minimum {v.threshold_pct:.2f}%)") if v else ""
    return prefix + f"Publishing {chosen.label}: weighted gain {gain} over NCCL's defaults."


def tuning_fingerprint(cfg: Config, topology_fp: str, nccl_version: str | None, demo: bool) -> str:
    """Everything a published tuning depends on: when it changes, the daemon re-tunes."""
    import hashlib
    import json

    s = cfg.sweep
    facts = {
        "topology": topology_fp, "nccl": nccl_version, "nccltune": __version__, "demo": demo,
        "profile": s.profile, "profiles": {k: {str(a): b for a, b in v.items()} for k, v in s.profiles.items()},
        "variables": s.variables, "pin": s.pin, "unpin": s.unpin, "exclude": s.exclude,
        "min_gain_pct": s.min_gain_pct, "max_regression_pct": s.max_regression_pct,
        "async_error_handling": s.async_error_handling,
        "sizes": [cfg.bench.min_bytes, cfg.bench.max_bytes, cfg.bench.factor],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


_PROBE = r"""
import json, os
info = {"torch_version": None, "nccl_version": None, "nccl_lib": None}
try:
    import torch
    info["torch_version"] = torch.__version__
    try:
        v = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:
        pass
    with open("/proc/self/maps") as f:
        for line in f:
            if "libnccl" in line:
                info["nccl_lib"] = line.split()[-1]
                break
except ImportError as exc:
    info["error"] = str(exc)
print(json.dumps(info))
"""


def probe_nccl(python: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """torch and NCCL versions (and NCCL's library file) as the worker interpreter sees them.

    Runs in a child interpreter: the daemon itself never imports torch.
    """
    import json
    import subprocess

    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
        info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"error": str(exc)}
    lib = info.get("nccl_lib")
    if lib:
        try:
            st = os.stat(lib)
            info["nccl_lib_stat"] = [st.st_size, int(st.st_mtime)]
        except OSError:
            pass
    return info
