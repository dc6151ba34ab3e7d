"""The sweep, as stages: load the node, check it is idle, plan, run the trials, choose, publish,
report. Used by `nccltune sweep` and by the daemon.

A failed or interrupted sweep publishes nothing: trials use a topology file in the run's own
directory, and the published files (env files, ncclTopology.xml, the nccl.conf block) are
replaced only after a choice has been made. The configuration arrives complete: the command
line's flags were folded into it (cli.py) before the pipeline sees it.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .choice import Choice, choose, split_scopes
from .config import Config
from .errors import InputError
from .lock import SweepLock
from .names import DEMO_LABEL, format_size
from .node import ONE_GPU, Node, load_node, require_idle
from .planning import POLICY_VAR, check_profile, estimate_seconds, make_plan, settings, weights
from .probe import probe_nccl
from .publish import Provenance, PublishedFiles, Tuner, atomic_write, publish, update_nccl_conf
from .records import Backend, ReportRow
from .store import Phase, RunStatus, Store
from .sweep.plan import Plan
from .sweep.strategy import Search, SearchResult
from .topology.ncclxml import render_xml
from .trials.runner import RANK_RECORD, Runner, TrialAborted, find_worker_python, reap_leftover_ranks
from .trials.session import Engine, ProgressFn, TrialSession, resolve_engine, start_run
from .trust import ensure_dir
from .tuning import tuning_fingerprint

log = logging.getLogger(__name__)

# What a sweep on a node with one GPU says instead of a measurement.
UNMEASURED_SUMMARY = f"{ONE_GPU}; published what fits every job"

# Besides its own names, the ones the daemon imports from here; their homes are node, planning,
# probe and tuning (ARCHITECTURE.md).
__all__ = [
    "POLICY_VAR", "Node", "ProgressFn", "SweepPipeline", "SweepReport", "load_node", "probe_nccl", "tuning_fingerprint",
]


@dataclass
class SweepReport:
    """What a finished sweep found and published, for rendering and the daemon's metrics."""

    run_id: int | None
    demo: bool
    backend: Backend
    fingerprint: str
    plan: Plan
    result: SearchResult | None
    chosen_env: dict[str, str]  # both parts: what was measured as a whole
    chosen_label: str
    published: PublishedFiles | None
    topology_file: str | None
    nccl_version: str | None
    torch_version: str | None
    trials: int
    failed_trials: list[tuple[str, str]]
    wall_s: float
    rows: list[ReportRow] = field(default_factory=list)
    summary: str = ""
    profile: str | None = None
    method: str | None = None  # how the trials measured: placement and timing
    every_job_env: dict[str, str] = field(default_factory=dict)  # nccl.sh / nccl.env / nccl.conf
    single_node_env: dict[str, str] = field(default_factory=dict)  # nccl-single-node.sh / .env


class SweepPipeline:
    """One sweep of one node under one configuration."""

    def __init__(self, cfg: Config, *, demo: str | bool | None = None, progress: ProgressFn | None = None,
                 abort_check: Callable[[], str | None] | None = None, env: Mapping[str, str] | None = None,
                 node: Node | None = None) -> None:
        """Raises: InputError for a sweep.profile that names no profile (exit 78)."""
        check_profile(cfg)
        self.cfg = cfg
        self.demo = demo
        self.progress = progress
        self.abort_check = abort_check
        self.env = dict(os.environ if env is None else env)
        self._node = node

    @property
    def profile(self) -> str:
        return self.cfg.sweep.profile

    def node(self) -> Node:
        """Stage 1: the node (loaded once)."""
        if self._node is None:
            self._node = load_node(self.cfg, self.demo)
        return self._node

    def plan(self) -> tuple[Plan, Search]:
        """Stage 3 on its own (`sweep --plan`): the plan and a search that measures nothing."""
        plan = make_plan(self.cfg, self.node(), self.env)
        search = Search(plan, settings(self.cfg), lambda e, p, lbl: None,
                        common={"NCCL_TOPO_FILE": "<topology file>"}, weights=weights(self.cfg, plan))
        return plan, search

    def estimate_seconds(self, plan: Plan, trials: int) -> float:
        return estimate_seconds(plan, trials, self.cfg, self.node())

    def run(self) -> SweepReport:
        started = time.monotonic()
        node = self.node()
        require_idle(node, self.cfg.sweep.force)
        plan = make_plan(self.cfg, node, self.env)
        state = Path(self.cfg.state_dir)
        try:
            ensure_dir(state, "state directory")
        except OSError as exc:
            raise InputError(str(state), f"cannot create the state directory: {exc.strerror}") from exc
        if not node.measurable:
            with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
                store.mark_interrupted()
                return self._publish_unmeasured(store, node, plan, started)
        engine = resolve_engine(self.cfg, node)
        with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
            store.mark_interrupted()
            reap_leftover_ranks(state / RANK_RECORD)
            sweep = _Sweep(self, store, node, plan, engine)
            return sweep.run(started)

    def _publish_unmeasured(self, store: Store, node: Node, plan: Plan, started: float) -> SweepReport:
        """One GPU: no trial, and the part that fits every job (topology file, policy values,
        config pins) published as a sweep would; recorded as a run of no trials."""
        cfg = self.cfg
        run_id = start_run(store, kind="sweep", cfg=cfg, node=node, profile=cfg.sweep.profile,
                           topology={"source": node.topo.source, "gpus": len(node.topo.gpus)})
        try:
            xml_text = render_xml(node.topo.system)
            every_job, single_node = split_scopes({"NCCL_TOPO_FILE": str(cfg.topology_file)}, plan,
                                                  cfg.topology_file)
            probed = None if node.demo else probe_nccl(find_worker_python(cfg.bench.python)).get("nccl_version")
            prov = _provenance(cfg, node, probed if isinstance(probed, str) else None, {}, UNMEASURED_SUMMARY,
                               probed_nccl=probed)
            write_topology_file(cfg, xml_text)
            published = publish(cfg.publish_dir, every_job, prov, topology_xml=xml_text, single_node_env=single_node)
            if cfg.nccl_conf is not None:
                update_nccl_conf(cfg.nccl_conf, every_job, prov)
        except BaseException as exc:
            status: RunStatus = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            store.finish_run(run_id, status=status, summary={"error": str(exc) or type(exc).__name__, "trials": 0})
            raise
        log.info("%s", UNMEASURED_SUMMARY)
        store.finish_run(run_id, status="ok", summary={"chosen": "nothing measured", "summary": UNMEASURED_SUMMARY,
                                                         "trials": 0, "failed": [], "plan_pruned": len(plan.pruned)},
                         chosen_env=every_job, published_generation=published.generation)
        return SweepReport(
            run_id=run_id, demo=node.demo, backend=node.backend, fingerprint=node.fingerprint, plan=plan,
            result=None, chosen_env=dict(every_job), chosen_label="nothing measured", published=published,
            topology_file=str(cfg.topology_file), nccl_version=prov.nccl_version, torch_version=None, trials=0,
            failed_trials=[], wall_s=round(time.monotonic() - started, 1), summary=UNMEASURED_SUMMARY,
            profile=cfg.sweep.profile, every_job_env=dict(every_job), single_node_env=dict(single_node))


class _Sweep:
    """The stages that hold the sweep lock: trials, choice, publishing, the report."""

    def __init__(self, pipe: SweepPipeline, store: Store, node: Node, plan: Plan, engine: Engine) -> None:
        self.pipe, self.cfg, self.store, self.node, self.plan, self.engine = pipe, pipe.cfg, store, node, plan, engine
        self.run_id = start_run(store, kind="sweep", cfg=self.cfg, node=node, profile=self.cfg.sweep.profile,
                                topology={"source": node.topo.source, "gpus": len(node.topo.gpus)})
        self.xml_text = ""  # rendered as the session opens, where a failure closes the run
        self.trial_xml = Path(self.cfg.state_dir) / "runs" / f"{self.run_id:05d}" / "ncclTopology.xml"
        self.search: Search | None = None

    def run(self, started: float) -> SweepReport:
        session = self._open_session()
        try:
            result = self._search(session)
            choice = choose(result, self.plan, self.cfg.topology_file, session.results, self.node.demo)
            published = self._publish(choice, session)
            session.finish("ok", self._summary(choice, session), chosen_env=choice.env,
                           published_generation=published.generation, rows=choice.rows)
        except BaseException as exc:
            interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit, TrialAborted))
            session.abandon("interrupted" if interrupted else "failed",
                            {"error": str(exc) or type(exc).__name__, "trials": session.seq})
            raise
        return self._report(result, choice, published, session, started)

    def _open_session(self) -> TrialSession:
        """The run's directory, its own topology file and the runner that measures the trials."""
        try:
            work = self.trial_xml.parent
            ensure_dir(work, "run directory")
            self.xml_text = render_xml(self.node.topo.system)
            atomic_write(self.trial_xml, self.xml_text)
            runner = Runner(python=self.engine.python, backend=self.node.backend, nranks=self.node.nranks,
                            base_env=self._base_env(), work_dir=work, timeout_s=self.cfg.bench.trial_timeout_s,
                            gpus=self.cfg.bench.gpus, abort_check=self.pipe.abort_check,
                            nccl_tests=self.engine.nccl_tests, rank_record=Path(self.cfg.state_dir) / RANK_RECORD)
        except BaseException as exc:
            status: RunStatus = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            self.store.finish_run(self.run_id, status=status,
                                  summary={"error": str(exc) or type(exc).__name__, "trials": 0})
            raise
        return TrialSession(self.store, self.run_id, runner, self.plan.sizes, cfg=self.cfg, node=self.node,
                            progress=self.pipe.progress,
                            expected_trials=lambda: self.search.estimate_trials() if self.search else 0)

    def _base_env(self) -> dict[str, str]:
        """The calling environment with the config's pins set and sweep.unpin's variables removed."""
        base_env = dict(self.pipe.env)
        base_env.update(self.cfg.sweep.pin)
        for name in self.cfg.sweep.unpin:
            base_env.pop(name, None)
        # A published NCCL_TOPO_FILE from an earlier sweep must not leak into the baseline.
        base_env.pop("NCCL_TOPO_FILE", None)
        return base_env

    def _search(self, session: TrialSession) -> SearchResult:
        """The trials, as the search asks for them; a failed trial counts as no result."""

        def measure(env: dict[str, str], phase: str, label: str) -> tuple[dict[int, float], dict[str, Any]] | None:
            result = session.trial(env, typing.cast(Phase, phase), label)
            if not result.ok:
                log.warning("trial %d (%s) failed: %s", session.seq, label, result.reason)
                return None
            return result.busbw(), result.nccl

        # The policy values ride along with every candidate: a finished trial shows torch takes them.
        common = {"NCCL_TOPO_FILE": str(self.trial_xml), **self.plan.policy}
        self.search = Search(self.plan, settings(self.cfg), measure, common=common,
                             weights=weights(self.cfg, self.plan))
        return self.search.run()

    def _publish(self, choice: Choice, session: TrialSession, tuner: Tuner | None = None) -> PublishedFiles:
        """Every file a launcher reads: the environment files of both scopes (the choice's
        every-job part, and its single-node part for jobs known to run on this node), the
        nccl.conf block (every-job part only: NCCL cannot know a job's shape), the topology file
        when the choice uses it and, with ``tuner``, the plugin and its table."""
        # The daemon compares the tuning fingerprint with what it computes from its own probe of
        # the worker's NCCL, so both sides take the version from the same place.
        probed = None if self.node.demo else probe_nccl(self.engine.python).get("nccl_version")
        prov = _provenance(self.cfg, self.node, session.nccl_version,
                           {format_size(r.size_bytes): r.ratio for r in choice.rows if r.ratio},
                           None, probed_nccl=probed)
        if choice.uses_topology_file:
            write_topology_file(self.cfg, self.xml_text)
        published = publish(self.cfg.publish_dir, choice.every_job_env, prov,
                            topology_xml=self.xml_text if choice.uses_topology_file else None,
                            single_node_env=choice.single_node_env, tuner=tuner)
        if self.cfg.nccl_conf is not None:
            update_nccl_conf(self.cfg.nccl_conf, choice.every_job_env, prov)
        return published

    def _summary(self, choice: Choice, session: TrialSession) -> dict[str, Any]:
        return {"chosen": choice.label, "summary": choice.summary, "nccl_version": session.nccl_version,
                "torch_version": session.torch_version, "method": session.method, "trials": session.seq,
                "failed": session.failed, "plan_pruned": len(self.plan.pruned)}

    def _report(self, result: SearchResult, choice: Choice, published: PublishedFiles, session: TrialSession,
                started: float) -> SweepReport:
        return SweepReport(
            run_id=self.run_id, demo=self.node.demo, backend=self.node.backend, fingerprint=self.node.fingerprint,
            plan=self.plan, result=result, chosen_env=choice.env, chosen_label=choice.label, published=published,
            topology_file=str(self.cfg.topology_file) if choice.uses_topology_file else None,
            nccl_version=session.nccl_version, torch_version=session.torch_version, trials=session.seq,
            failed_trials=session.failed, wall_s=round(time.monotonic() - started, 1), rows=choice.rows,
            summary=choice.summary, profile=self.cfg.sweep.profile, method=session.method,
            every_job_env=dict(choice.every_job_env), single_node_env=dict(choice.single_node_env))


def _provenance(cfg: Config, node: Node, nccl_version: str | None, gains: Mapping[str, float], note: str | None,
                *, probed_nccl: Any) -> Provenance:
    """The provenance of what a sweep publishes. ``probed_nccl`` is the version the worker's probe
    reported (None in the demo): the tuning fingerprint's input, as the daemon computes it."""
    return Provenance(
        nccltune_version=__version__,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        topology_fingerprint=node.fingerprint, nccl_version=nccl_version,
        backend=node.backend, demo=node.demo, profile=cfg.sweep.profile, gains=dict(gains),
        note=DEMO_LABEL if node.demo else note,
        tuning_fingerprint=tuning_fingerprint(cfg, node.fingerprint, probed_nccl, node.demo))


def write_topology_file(cfg: Config, xml_text: str) -> None:
    """A copy of the topology file at its stable path (publish.topology_file), for an
    /etc/nccl.conf block or a site script that names one path. The published environment names
    the generation's own copy, which publish() writes with the rest of the set."""
    atomic_write(cfg.topology_file, xml_text)
