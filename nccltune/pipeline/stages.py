"""The sweep, as stages: load the node, check it is idle, plan, run the trials, choose, publish,
report. Used by `nccltune sweep` and by the daemon.

A failed or interrupted sweep publishes nothing: trials use a topology file in the run's own
directory, and the published files (env files, ncclTopology.xml, the nccl.conf block) are
replaced only after a choice has been made. The configuration arrives complete: the command
line's flags were folded into it (cli/context.py) before the pipeline sees it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from ..delivery.jobenv import FromPublished, from_published
from ..errors import InputError, NccltuneError, UnavailableError
from ..files.lock import SweepLock
from ..files.trust import ensure_dir
from ..names import DEMO_LABEL
from ..node import ONE_GPU, Node, load_node, require_idle
from ..publish import (
    Provenance,
    PublishedFiles,
    Setting,
    Tuner,
    atomic_write,
    build_provenance,
    names_own_topology,
    publish_setting,
    read_set,
    resolve_topology,
)
from ..publish.tuning import tuning_fingerprint
from ..records import Backend, ReportRow
from ..store import Phase, RunStatus, Store, SweepSummary
from ..sweep.plan import JobShape, Plan
from ..sweep.select import Key, key_label, size_stats
from ..sweep.strategy import Search, SearchResult
from ..topology.ncclxml import render_xml
from ..topology.nodeclass import node_class
from ..trials.container import Container, from_config
from ..trials.container import provenance as container_provenance
from ..trials.launch.base import LaunchRequest
from ..trials.probe import probe_nccl
from ..trials.runner import RANK_RECORD, Runner, TrialAborted, find_worker_python, reap_leftover_ranks
from ..trials.session import (
    Engine,
    ProgressFn,
    TrialSession,
    close_dead_runs,
    remove_leftover_temps,
    resolve_engine,
    start_run,
)
from ..trials.trialenv import carried, fixed_part
from .choice import Choice, choose, split_scopes
from .planning import (
    POLICY_VAR,
    Workload,
    check_profile,
    estimate_seconds,
    estimate_trials,
    make_plan,
    settings,
    trial_bounds,
    workload,
)
from .tablestage import TableOutcome, TableStage

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
    collectives: tuple[str, ...] = ("all_reduce",)  # what every trial measured
    not_measured: dict[str, str] = field(default_factory=dict)  # the profile's others: collective -> why
    table: TableOutcome | None = None  # the per-size stage (tuner table); None: not planned
    published_table: dict[str, str] = field(default_factory=dict)  # what the publish stage did with it
    not_published: str | None = None  # why a finished sweep published nothing (job shape, class profile)
    every_job_env: dict[str, str] = field(default_factory=dict)  # nccl.sh / nccl.env / nccl.conf
    single_node_env: dict[str, str] = field(default_factory=dict)  # nccl-single-node.sh / .env
    image: dict[str, str] | None = None  # the job's image the ranks ran in (trials.container.provenance)


class SweepPipeline:
    """One sweep of one node under one configuration."""

    def __init__(self, cfg: Config, *, demo: str | bool | None = None, progress: ProgressFn | None = None,
                 abort_check: Callable[[], str | None] | None = None, env: Mapping[str, str] | None = None,
                 node: Node | None = None, launch: LaunchRequest | None = None, over_profile: bool = False) -> None:
        """`launch`: a sweep over several nodes or through the NICs (None: this node's ranks).
        `over_profile`: publish this node's result even while a class profile is in force.

        Raises: InputError for a sweep.profile that names no profile (exit 78)."""
        check_profile(cfg)
        self.launch = launch if launch is not None and not launch.single_node else None
        if cfg.bench.nranks == 1 and not self.spans_nodes:
            raise InputError(cfg.path or "config", "bench.nranks is 1: one rank on one node has no collective to "
                             "measure", line=cfg.lines.get("bench.nranks"),
                             hint="one rank per node is for sweeps over several nodes (--nodes N, --join)")
        self.over_profile = over_profile
        self.cfg = cfg
        self.demo = demo
        self.progress = progress
        self.abort_check = abort_check
        self.env = dict(os.environ if env is None else env)
        self._published: FromPublished | None = None
        self._node = node
        self._probed: dict[str, str | None] = {}  # worker interpreter -> the NCCL version it loads
        self._container: tuple[Container, dict[str, str]] | None = None

    def container(self) -> tuple[Container, dict[str, str]] | None:
        """The image the ranks run in (bench.image) and what its probe found, made and probed once
        per sweep; None: the ranks run bench.python on the host.

        Raises:
            InputError: bench.image not by digest, or bench.user unknown (exit 78).
            UnavailableError: no runtime, or the image does not start (exit 69)."""
        if not self.cfg.bench.image:
            return None
        if self._container is None:
            c = from_config(self.cfg.bench, demo=self.node().demo)
            self._container = (c, c.probe({"PATH": self.env.get("PATH", os.defpath)}))
        return self._container

    @property
    def profile(self) -> str:
        return self.cfg.sweep.profile

    def published_in_env(self) -> FromPublished:
        """What of the calling environment nccltune's published set put there, by the marker a
        launch form left (delivery.jobenv.from_published): never a pin. Read once per sweep."""
        if self._published is None:
            self._published = from_published(self.env, self.cfg.publish_dir)
        return self._published

    def own_env(self) -> dict[str, str]:
        """The calling environment as the job set it: what the plan pins and the trials start from."""
        return self.published_in_env().own(self.env)

    @property
    def spans_nodes(self) -> bool:
        """The trials run across several nodes (not NIC loopback on this one)."""
        return self.launch is not None and not self.launch.loopback and self.launch.nodes > 1

    def measurable(self) -> bool:
        """A collective can be timed: two ranks here, or this node's ranks (one GPU included) in a
        job over several nodes, whose shape is then nodes x 1."""
        return self.node().measurable or (self.spans_nodes and self.node().nranks >= 1)

    def node(self) -> Node:
        """Stage 1: the node (loaded once)."""
        if self._node is None:
            self._node = load_node(self.cfg, self.demo)
        return self._node

    def nccl_version(self, python: str | None = None) -> str | None:
        """The NCCL version the trials will load, as the worker interpreter (`python`, default the
        one bench.python names or the sweep finds) reports it: probed once per sweep, for the plan
        (which per-size candidates NCCL can take), the provenance and the tuning fingerprint. None on
        the CPU demo, or when the probe finds no NCCL.

        Raises:
            UnavailableError: no worker interpreter with torch (exit 69)."""
        if self.node().demo:
            return None
        image = self.container()
        if image is not None:
            return image[1].get("nccl_version")
        exe = python or find_worker_python(self.cfg.bench.python)
        if exe not in self._probed:
            version = probe_nccl(exe).get("nccl_version")
            self._probed[exe] = version if isinstance(version, str) and version else None
        return self._probed[exe]

    def _plan_nccl_version(self) -> str | None:
        """What the plan needs to know of NCCL: nothing on a node with nothing to measure."""
        return self.nccl_version() if self.measurable() else None

    def job_shape(self) -> JobShape | None:
        """The shape the plan prunes for; None for a sweep of this node's own ranks."""
        return self.launch.shape(self.node().nranks).plan_shape() if self.launch else None

    def plan(self) -> tuple[Plan, Search]:
        """Stage 3 on its own (`sweep --plan`): the plan and a search that measures nothing."""
        try:
            nccl_version = self._plan_nccl_version()
        except UnavailableError:
            nccl_version = None  # no worker interpreter yet: the plan can still be shown
        plan = make_plan(self.cfg, self.node(), self.own_env(), self.job_shape(), nccl_version=nccl_version,
                         published=self.published_in_env())
        search = Search(plan, settings(self.cfg, plan), lambda e, p, lbl: None,
                        common=carried(plan), weights=self.workload(plan).weights)
        return plan, search

    def workload(self, plan: Plan) -> Workload:
        """What sweep.profile measures over the plan's sizes: collectives, weights, what cannot be measured."""
        return workload(self.cfg, self.node(), plan.sizes)

    def estimate_trials(self, plan: Plan, search: Search) -> int:
        """Every trial the sweep makes: the search's, the per-size candidates' and the final check's,
        when the final check decides at its first look."""
        return estimate_trials(self.cfg, plan, search)

    def trial_bounds(self, plan: Plan, search: Search) -> tuple[int, int]:
        """(estimate_trials, the most the sweep can make: the final check adding every round it may)."""
        return trial_bounds(self.cfg, plan, search)

    def estimate_seconds(self, plan: Plan, trials: int) -> float:
        return estimate_seconds(plan, trials, self.cfg, self.node(), len(self.workload(plan).collectives))

    def run(self) -> SweepReport:
        started = time.monotonic()
        node = self.node()
        require_idle(node, self.cfg.sweep.force)
        plan = make_plan(self.cfg, node, self.own_env(), self.job_shape(), nccl_version=self._plan_nccl_version(),
                         published=self.published_in_env())
        state = Path(self.cfg.state_dir)
        try:
            ensure_dir(state, "state directory")
        except OSError as exc:
            raise InputError(str(state), f"cannot create the state directory: {exc.strerror}") from exc
        if not self.measurable():
            with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
                close_dead_runs(store, self.cfg.publish_dir)
                remove_leftover_temps(self.cfg)
                return self._publish_unmeasured(store, node, plan, started)
        engine = resolve_engine(self.cfg, node, workload(self.cfg, node, plan.sizes).collectives)
        with SweepLock(state / "sweep.lock"), Store(state / "history.db") as store:
            close_dead_runs(store, self.cfg.publish_dir)
            reap_leftover_ranks(state / RANK_RECORD)
            remove_leftover_temps(self.cfg)
            sweep = _Sweep(self, store, node, plan, engine)
            return sweep.run(started)

    def _publish_unmeasured(self, store: Store, node: Node, plan: Plan, started: float) -> SweepReport:
        """One GPU: no trial, and the part that fits every job (topology file, policy values,
        config pins) published as a sweep would; recorded as a run of no trials."""
        cfg = self.cfg
        run_id = start_run(store, kind="sweep", cfg=cfg, node=node, profile=cfg.sweep.profile,
                           topology=run_topology(node))
        try:
            # What every candidate carries, as a sweep would have chosen nothing but it.
            every_job, single_node = split_scopes(carried(plan), plan)
            probed = self.nccl_version()
            prov = _provenance(cfg, node, probed, {}, UNMEASURED_SUMMARY, probed_nccl=probed, run=(store, run_id),
                               state="defaults")
            # nccltune's own XML only where nothing pins a topology file (split_scopes: publish.topology_env).
            xml = render_xml(node.topo.system) if names_own_topology(every_job) else None
            published = publish_setting(cfg, Setting(every_job, prov, single_node, xml, where="one-GPU publish"))
        except BaseException as exc:
            status: RunStatus = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            store.finish_run(run_id, status=status, summary=SweepSummary.ended(str(exc) or type(exc).__name__, 0))
            raise
        log.info("%s", UNMEASURED_SUMMARY)
        recorded = resolve_topology(every_job, cfg.topology_file)  # the run's record names the stable copy
        store.finish_run(run_id, status="ok", summary=SweepSummary(chosen="nothing measured", line=UNMEASURED_SUMMARY,
                                                                     trials=0, failed=(), plan_pruned=len(plan.pruned)),
                         chosen_env=recorded, published_generation=published.generation)
        return SweepReport(
            run_id=run_id, demo=node.demo, backend=node.backend, fingerprint=node.fingerprint, plan=plan,
            result=None, chosen_env=recorded, chosen_label="nothing measured", published=published,
            topology_file=str(cfg.topology_file), nccl_version=prov.nccl_version, torch_version=None, trials=0,
            failed_trials=[], wall_s=round(time.monotonic() - started, 1), summary=UNMEASURED_SUMMARY,
            profile=cfg.sweep.profile, every_job_env=dict(published.env),
            single_node_env=dict(published.single_node_env))


def run_topology(node: Node) -> dict[str, Any]:
    """What a run records of the node it measured (history, report and the plot's title)."""
    return {"source": node.topo.source, "gpus": len(node.topo.gpus),
            "gpu_model": ", ".join(sorted({g.name for g in node.topo.gpus if g.name})) or None}


class _Sweep:
    """The stages that hold the sweep lock: trials, choice, publishing, the report."""

    def __init__(self, pipe: SweepPipeline, store: Store, node: Node, plan: Plan, engine: Engine) -> None:
        self.pipe, self.cfg, self.store, self.node, self.plan, self.engine = pipe, pipe.cfg, store, node, plan, engine
        # A sweep over several nodes (or through the NICs) measures a job shape, not this node: its
        # trials are stored with the shape and the node class, for `nccltune export` and
        # `nccltune fleet decide`; nothing of it is published on this node.
        self.launch = (pipe.launch.build(node.nranks, node_class=node_class(node.topo).id,
                                         gpus=node.backend == "nccl")
                       if pipe.launch else None)
        topology: dict[str, Any] = run_topology(node)
        if self.launch is not None:
            topology["job"] = self.launch.record()
        self.run_id = start_run(store, kind="sweep", cfg=self.cfg, node=node, profile=self.cfg.sweep.profile,
                                topology=topology)
        self.xml_text = ""  # rendered as the session opens, where a failure closes the run
        self.trial_xml = Path(self.cfg.state_dir) / "runs" / f"{self.run_id:05d}" / "ncclTopology.xml"
        self.search: Search | None = None
        self.workload = workload(self.cfg, node, plan.sizes)
        self.table: TableOutcome | None = None
        self.published_table: dict[str, str] = {}
        self.not_published: str | None = None
        self._tuning_fp: str | None = None

    def run(self, started: float) -> SweepReport:
        session = self._open_session()
        published = None
        try:
            result = self._search(session)
            result = self._per_size(session, result)
            choice = choose(result, self.plan, self.cfg.topology_file, session.results, self.node.demo)
            held = None if self.launch is not None or self.pipe.over_profile else self._held_by_profile()
            published = self._publish(choice, session) if self.launch is None and held is None else None
            if held is not None:
                self.not_published = held
                log.warning("not published: %s", held)
            if self.launch is not None:
                self.not_published = (f"measured for the job shape {self.launch.shape.label}: a class "
                                      "profile decides for it (nccltune export, nccltune fleet decide)")
            summary = self._summary(choice, session)
            session.finish("ok", summary, chosen_env=choice.env,
                           published_generation=published.generation if published else None, rows=choice.rows)
        except BaseException as exc:
            if published is not None:
                # The generation is current and every job gets it: the run is what published it,
                # whatever ended the sweep afterwards (the record close_dead_runs makes after a kill).
                session.finish("ok", SweepSummary.ended(str(exc) or type(exc).__name__, session.seq,
                                                        ended_after_publish=published.generation),
                               chosen_env=choice.env, published_generation=published.generation,
                               rows=choice.rows)
                raise
            interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit, TrialAborted))
            session.abandon("interrupted" if interrupted else "failed",
                            SweepSummary.ended(str(exc) or type(exc).__name__, session.seq))
            raise
        finally:
            session.runner.close()
            if self.launch is not None:
                self.launch.close()
        return self._report(result, choice, published, session, started)

    def _held_by_profile(self) -> str | None:
        """Why this node's own result must not replace what is published: a class profile in force
        (one decision per kind of node; the daemon keeps profile.path's applied), or None."""
        from ..fleet.apply import profile_in_force

        try:
            current = read_set(self.cfg.publish_dir)
        except NccltuneError:
            return None  # an unreadable set is replaced, as a publish always does
        loaded = profile_in_force(self.cfg, current.provenance) if current is not None else None
        if loaded is None:
            return None
        name = str(current.provenance["class_profile"].get("file") or loaded.path.name) if current else loaded.path.name
        return (f"the class profile {name} (class {loaded.class_id}) is in force: this node's own result "
                "is recorded in the history, and the profile stays published (`nccltune sweep --over-profile` "
                "publishes the node's result instead; a daemon with profile.path applies the profile again)")

    def _open_session(self) -> TrialSession:
        """The run's directory, its own topology file and the runner that measures the trials."""
        try:
            work = self.trial_xml.parent
            ensure_dir(work, "run directory")
            self.xml_text = render_xml(self.node.topo.system)
            atomic_write(self.trial_xml, self.xml_text)
            runner = Runner(python=self.engine.python, backend=self.node.backend, nranks=self.node.nranks,
                            base_env=fixed_part(self.pipe.own_env(), self.cfg.sweep.pin, self.cfg.sweep.unpin),
                            topology_file=self.trial_xml, work_dir=work, timeout_s=self.cfg.bench.trial_timeout_s,
                            gpus=self.cfg.bench.gpus, abort_check=self.pipe.abort_check,
                            nccl_tests=self.engine.nccl_tests, rank_record=Path(self.cfg.state_dir) / RANK_RECORD,
                            launch=self.launch, user=self.cfg.bench.user, fork_ranks=self.cfg.bench.fork_ranks,
                            container=image[0] if (image := self.pipe.container()) else None)
        except BaseException as exc:
            status: RunStatus = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            self.store.finish_run(self.run_id, status=status,
                                  summary=SweepSummary.ended(str(exc) or type(exc).__name__, 0))
            raise
        return TrialSession(self.store, self.run_id, runner, self.plan.sizes, cfg=self.cfg, node=self.node,
                            progress=self.pipe.progress, collectives=self.workload.collectives,
                            expected_trials=lambda: (estimate_trials(self.cfg, self.plan, self.search)
                                                     if self.search else 0))

    def _search(self, session: TrialSession) -> SearchResult:
        """The trials, as the search asks for them; a failed trial counts as no result."""

        def measure(env: dict[str, str], phase: str, label: str) -> tuple[dict[Key, float], dict[str, Any]] | None:
            result = session.trial(env, typing.cast(Phase, phase), label)
            if not result.ok:
                log.warning("trial %d (%s) failed: %s", session.seq, label, result.reason)
                return None
            return result.busbw_by_key(), result.nccl

        # The policy values and nccltune's topology file ride along with every candidate.
        common = carried(self.plan)
        self.search = Search(self.plan, settings(self.cfg, self.plan), measure, common=common,
                             weights=self.workload.weights)
        return self.search.run()

    def tuning_fp(self) -> str:
        """The tuning fingerprint (once per sweep): in the provenance and in the tuner table."""
        if self._tuning_fp is None:
            # The daemon compares this with what it computes from its own probe of the worker's
            # NCCL, so both sides take the version from the same place.
            self._tuning_fp = tuning_fingerprint(self.cfg, self.node.fingerprint,
                                                 self.pipe.nccl_version(self.engine.python), self.node.demo)
        return self._tuning_fp

    def _per_size(self, session: TrialSession, result: SearchResult) -> SearchResult:
        """Stage 4b: the per-size candidates, the tuner table and the final check of the whole result
        (tablestage). Without the table planned, the search's own result stands."""
        if self.plan.per_size is None or not self.plan.per_size.active:
            return result
        shape = self.launch.shape if self.launch is not None else None
        stage = TableStage(self.cfg, self.plan, session, work_dir=self.trial_xml.parent, common=carried(self.plan),
                           nranks=shape.nranks if shape else self.node.nranks, nnodes=shape.nnodes if shape else 1,
                           fingerprint=self.tuning_fp(), demo=self.node.demo)
        self.table = stage.run(result)
        finalists = [f for f in (self.table.whole, self.table.env_only) if f is not None]
        runs = stage.baseline_runs if stage.baseline_runs is not None else result.baseline_runs
        return dataclasses.replace(result, chosen=self.table.chosen, finalists=finalists, topo_only=None,
                                   baseline_runs=runs, baseline=size_stats(runs))

    def _publish(self, choice: Choice, session: TrialSession) -> PublishedFiles:
        """Every file a launcher reads, as one generation (publish_setting): the environment files of
        both scopes (the choice's every-job part, and its single-node part for jobs known to run on
        this node), the nccl.conf block (every-job part only: NCCL cannot know a job's shape), the
        topology file when the choice uses it and, when the whole result with the tuner table won,
        the plugin and its table (every job: an entry applies only to the communicator shape it was
        measured for)."""
        gains = {key_label((r.collective, r.size_bytes)): r.ratio for r in choice.rows if r.ratio}
        # A choice of NCCL's defaults publishes nothing measured: the set says so ("defaults").
        prov = _provenance(self.cfg, self.node, session.nccl_version, gains, None, fingerprint=self.tuning_fp(),
                           run=(self.store, self.run_id), state="tuned" if choice.chosen is not None else "defaults")
        image = self.pipe.container()
        if image is not None:
            prov = dataclasses.replace(prov, image=container_provenance(*image))
        # The scopes as the choice decided them: the marker for the topology file and the tuner's
        # variables (the run's plugin and table) are the publisher's to name as the generation's own.
        every_job, single_node = choice.every_job_env, choice.single_node_env
        tuner: Tuner | None = None
        pub = self.table.publication if self.table else None
        if pub is not None and self.table is not None and self.table.chosen is self.table.whole:
            tuner = Tuner(pub.plugin_path, pub.table_text)
        setting = Setting(every_job, prov, single_node, self.xml_text if choice.uses_topology_file else None,
                          tuner, where="sweep")
        published = publish_setting(self.cfg, setting)
        if tuner is not None:
            self.published_table = {"generation": str(published.generation),
                                    "single_node_env": " ".join(f"{k}={v}" for k, v in sorted(single_node.items()))}
        return published

    def _summary(self, choice: Choice, session: TrialSession) -> SweepSummary:
        table: dict[str, Any] | None = None
        if self.table is not None:
            # The table's text lies in the run's directory (table_path); the store keeps the path.
            table = {**self.table.as_dict(), "published": self.published_table or None}
        elif self.plan.per_size is not None:
            table = {"status": self.plan.per_size.inactive_text}
        image = self.pipe.container()
        return SweepSummary(
            chosen=choice.label, line=choice.summary, nccl_version=session.nccl_version,
            torch_version=session.torch_version, method=session.method, trials=session.seq,
            failed=tuple(session.failed), plan_pruned=len(self.plan.pruned),
            collectives=tuple(self.workload.collectives), not_measured=self._not_measured(session),
            tuner_table=table, not_published=self.not_published,
            job=self.launch.record() if self.launch is not None else None,
            image=container_provenance(*image) if image is not None else None)

    def _not_measured(self, session: TrialSession) -> dict[str, str]:
        """The profile's collectives without numbers, with why: known before the trials, or as the
        worker reported."""
        return {**self.workload.not_measured, **session.not_measured}

    def _report(self, result: SearchResult, choice: Choice, published: PublishedFiles | None, session: TrialSession,
                started: float) -> SweepReport:
        return SweepReport(
            run_id=self.run_id, demo=self.node.demo, backend=self.node.backend, fingerprint=self.node.fingerprint,
            plan=self.plan, result=result, chosen_env=choice.env, chosen_label=choice.label, published=published,
            topology_file=str(self.cfg.topology_file) if choice.uses_topology_file else None,
            nccl_version=session.nccl_version, torch_version=session.torch_version, trials=session.seq,
            failed_trials=session.failed, wall_s=round(time.monotonic() - started, 1), rows=choice.rows,
            summary=choice.summary, profile=self.cfg.sweep.profile, method=session.method,
            collectives=self.workload.collectives, not_measured=self._not_measured(session), table=self.table,
            published_table=dict(self.published_table), not_published=self.not_published,
            # What the launchers read when published (the generation's own files named), else the choice.
            every_job_env=dict(published.env if published else choice.recorded_every_job),
            single_node_env=dict(published.single_node_env if published else choice.single_node_env),
            image=container_provenance(*image) if (image := self.pipe.container()) is not None else None)


def _provenance(cfg: Config, node: Node, nccl_version: str | None, gains: Mapping[str, float], note: str | None,
                *, probed_nccl: Any = None, fingerprint: str | None = None,
                run: tuple[Store, int] | None = None, state: str = "tuned") -> Provenance:
    """The provenance of what a sweep publishes. ``probed_nccl`` is the version the worker's probe
    reported (None in the demo): the tuning fingerprint's input, as the daemon computes it;
    ``fingerprint`` is that fingerprint when the sweep has it already; ``run`` the history and the
    run that publishes it (close_dead_runs reads them back); ``state`` what is published
    (publish.PUBLISHED_STATES)."""
    return build_provenance(
        topology_fingerprint=node.fingerprint, nccl_version=nccl_version, backend=node.backend, demo=node.demo,
        profile=cfg.sweep.profile, gains=gains, note=DEMO_LABEL if node.demo else note,
        tuning_fingerprint=fingerprint or tuning_fingerprint(cfg, node.fingerprint, probed_nccl, node.demo),
        run=(run[1], run[0].path) if run else None, state=state)
