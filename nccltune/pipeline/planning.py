"""From the config and the node to the sweep's plan: what is measured, pinned, pruned, published
by policy, which sizes count how much, and about how long it will take."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import collectives as coll
from ..config import Config, profile_collectives
from ..delivery.jobenv import FromPublished
from ..errors import InputError, NccltuneError
from ..names import unpublishable
from ..nccl.site import conf_settings
from ..nccl.sitetuner import default_conf_files, existing_tuner
from ..node import Node, iterations, size_ladder
from ..publish import preflight
from ..publish.policy import validate_env
from ..sweep import profiles
from ..sweep.plan import JobShape, Plan, build_plan, plan_per_size
from ..sweep.select import Key
from ..sweep.space import CATALOGUE, unknown_variable_hint
from ..sweep.strategy import Search, Settings, final_check_trials
from ..tuner.build import find_compiler, prebuilt_plugin

log = logging.getLogger(__name__)

# Published by policy beside every tuning, never swept (torch's reaction to a failed collective).
POLICY_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def check_config_variables(cfg: Config) -> None:
    """Every variable and value the config names must be known and valid (file:line on error)."""
    where = cfg.path or "config"
    for section, mapping in (("sweep.variables", cfg.sweep.variables), ("sweep.pin", cfg.sweep.pin)):
        for name, values in mapping.items():
            line = cfg.lines.get(f"{section}.{name}")
            tunable = CATALOGUE.get(name)
            why = unpublishable(name)  # as the config file's reader refuses it (a Config built in Python too)
            if why is not None:
                raise InputError(where, f"{section}.{name}: {why}", line=line)
            if tunable is None and section == "sweep.variables":
                raise InputError(where, f"{section}.{name}: not a variable nccltune knows how to sweep",
                                 line=line, hint=unknown_variable_hint(name))
            for value in ([values] if isinstance(values, str) else values):
                problem = tunable.validate(value) if tunable else None
                if problem:
                    raise InputError(where, f"{section}.{name}: {problem}", line=line)


def check_profile(cfg: Config) -> None:
    """sweep.profile names a built-in or a configured profile.

    Raises:
        InputError: it names neither (exit 78).
    """
    profile = cfg.sweep.profile
    if profile not in profiles.BUILTIN and profile not in cfg.sweep.profiles:
        raise InputError(cfg.path or "config", f"unknown profile {profile!r}", line=cfg.lines.get("sweep.profile"),
                         hint=f"built in: {', '.join(profiles.BUILTIN)}; or define sweep.profiles")


def make_plan(cfg: Config, node: Node, env: Mapping[str, str], shape: JobShape | None = None, *,
              nccl_version: str | None = None, published: FromPublished | None = None) -> Plan:
    """The plan for this node, with the variables pinned by `env` (the job's own environment:
    the calling one less what `published` says nccltune's published set put there, which is never a
    pin) and the config, less the ones sweep.unpin frees; `shape` (several nodes, NIC loopback)
    decides which network variables can matter. `nccl_version`: the NCCL the trials will load, where
    known before them (None: unknown; the per-size candidates then use only what is safe either way)."""
    check_config_variables(cfg)
    policy = {POLICY_VAR: str(cfg.sweep.async_error_handling)}
    # What could not be published is found now, before the first trial (and by --plan): the
    # topology file's path too, which is published as NCCL_TOPO_FILE wherever it lies.
    topo_file = str(cfg.topology_file)
    try:
        validate_env({"NCCL_TOPO_FILE": topo_file})
    except InputError as exc:
        where = "publish.topology_file" if cfg.publish.topology_file else "the state directory"
        raise InputError(topo_file, f"{where} gives the topology file a path that cannot be published as "
                         f"NCCL_TOPO_FILE: {exc.message.rsplit(': ', 1)[-1]}",
                         hint=f"choose a path without it (--state-dir, state_dir or publish.topology_file); "
                         f"{exc.hint}") from None
    preflight(cfg.publish_dir, {**policy, **cfg.sweep.pin},
              {n: f"{cfg.path or 'config'}:{cfg.lines.get(f'sweep.pin.{n}')}" for n in cfg.sweep.pin})
    plan = build_plan(
        node.topo, node.paths, env=env, config_pins=cfg.sweep.pin, unpin=list(cfg.sweep.unpin),
        site_pins={n: (c.value, str(c.path)) for n, c in conf_settings(env).items()},
        variables=cfg.sweep.variables, exclude=cfg.sweep.exclude, policy=policy,
        sizes=size_ladder(cfg, node.demo), backend=node.backend, nranks=node.nranks, shape=shape,
        published=published.values if published is not None else None,
    )
    if published is not None:
        plan.published_generation = published.generation if plan.from_published else None
        plan.notes.extend(published.notes)
    # Over several nodes the table is measured for that job shape (its entries for a communicator of
    # those nodes); NIC loopback is a shape no job has.
    inactive = ("the tuner table is measured for a node's own ranks or a job over several nodes; NIC loopback is "
                "neither" if shape is not None and shape.loopback else tuner_inactive_reason(cfg, env, node.demo, plan))
    plan_per_size(plan, node.topo, node.paths, inactive_reason=inactive,
                  user_variables=list(cfg.sweep.variables), demo=node.demo, exclude=list(cfg.sweep.exclude),
                  collectives=workload(cfg, node, plan.sizes).collectives, nccl_version=nccl_version)
    return plan


def tuner_inactive_reason(cfg: Config, env: Mapping[str, str], demo: bool, plan: Plan) -> str | None:
    """Why the per-size tuner table cannot be used on this node under this config, or None.

    A tuner already named by NCCL_TUNER_PLUGIN (environment or NCCL's conf files) is kept under
    tuner.plugin auto, and replaced, with a note, under tuner.plugin nccltune."""
    mode = cfg.tuner.plugin
    if mode == "keep":
        return "tuner.plugin is keep: nccltune never sets NCCL_TUNER_PLUGIN"
    existing = existing_tuner(env, default_conf_files(env))
    if existing is not None:
        if mode == "auto":
            return (f"{existing.describe()} is already set and kept (tuner.plugin: auto; "
                    "set tuner.plugin: nccltune to replace it)")
        plan.notes.append(f"WARNING: {existing.describe()} is REPLACED by nccltune's tuner (tuner.plugin: nccltune)")
    if not demo and find_compiler() is None and prebuilt_plugin()[0] is None:
        return "no C compiler (cc, gcc or clang) on PATH to build the plugin, and no prebuilt one that fits"
    return None


def _custom(cfg: Config) -> dict[str, dict[str, dict[int, float]]]:
    return {name: profile_collectives(p) for name, p in cfg.sweep.profiles.items()}


@dataclass(frozen=True)
class Workload:
    """What sweep.profile measures on this node: the collectives the trials run, the weight of
    each (collective, size), and the profile's collectives this backend cannot measure, with why."""

    profile: str
    collectives: tuple[str, ...]
    weights: dict[Key, float]
    not_measured: dict[str, str] = field(default_factory=dict)

    def sizes_of(self, collective: str) -> dict[int, float]:
        """size -> weight of one measured collective."""
        return {s: w for (c, s), w in self.weights.items() if c == collective}


def not_measured_reason(c: coll.Collective, node: Node) -> str | None:
    """Why this node's backend cannot measure `c`, known before any trial (the worker reports
    what it finds besides, as `TrialResult.not_measured`)."""
    if node.backend != "gloo":
        return None
    reason = coll.gloo_reason(c)
    if reason is None and c.name == "sendrecv" and node.nranks < 2:
        reason = "torch's gloo backend cannot send to its own rank"
    return reason


def workload(cfg: Config, node: Node, sizes: list[int]) -> Workload:
    """sweep.profile over the ladder `sizes` of this node."""
    custom = _custom(cfg)
    name = cfg.sweep.profile
    wanted = profiles.collectives_of(name, custom)
    missing = {c: why for c in wanted if (why := not_measured_reason(coll.get(c), node)) is not None}
    measured = tuple(c for c in wanted if c not in missing)
    all_weights = profiles.weights(name, sizes, custom)
    return Workload(name, measured, {k: w for k, w in all_weights.items() if k[0] in measured}, missing)


def weights(cfg: Config, plan: Plan) -> dict[Key, float]:
    """How much each (collective, size) of the plan counts under sweep.profile."""
    return profiles.weights(cfg.sweep.profile, plan.sizes, _custom(cfg))


def settings(cfg: Config, plan: Plan | None = None) -> Settings:
    """The search's settings from the sweep section.

    With the per-size table active, the whole-environment search only screens (no combining, no
    finalist round): its best screened setting joins the per-size result, and the final check
    (tablestage) measures both against the defaults, interleaved, in place of the finalist round."""
    s = cfg.sweep
    out = Settings(baseline_repeats=s.baseline_repeats, finalist_repeats=s.finalist_repeats,
                   max_finalist_repeats=s.max_finalist_repeats, max_final_trials=s.max_final_trials,
                   max_finalists=s.max_finalists, min_gain_pct=s.min_gain_pct,
                   max_regression_pct=s.max_regression_pct, exhaustive=s.strategy == "exhaustive")
    if plan is not None and plan.per_size is not None and plan.per_size.active and not out.exhaustive:
        out = dataclasses.replace(out, finalist_repeats=0, max_combine=0)
    return out


def table_check_trials(cfg: Config, plan: Plan) -> tuple[int, int]:
    """Trials of the per-size stage's final check (sweep.strategy.final_check_trials): the whole
    result and the environment part alone (one of them on the CPU demo, where the table is not
    loaded) against the defaults, each sweep.finalist_repeats times at the first look."""
    ps = plan.per_size
    if ps is None or not ps.active:
        return 0, 0
    s = cfg.sweep
    return final_check_trials(2 if ps.measured_with_nccl else 1, first=s.finalist_repeats,
                              last=s.max_finalist_repeats, max_trials=s.max_final_trials)


def trial_bounds(cfg: Config, plan: Plan, search: Search) -> tuple[int, int]:
    """Every trial of the sweep, the search's, the per-size candidates' and the final check's: (when
    the final check decides at its first look, at most)."""
    ps = plan.per_size
    candidates = ps.trial_count() if ps else 0
    about, most = search.trial_bounds()
    check_about, check_most = table_check_trials(cfg, plan)
    return about + candidates + check_about, most + candidates + check_most


def estimate_trials(cfg: Config, plan: Plan, search: Search) -> int:
    """Every trial of the sweep when the final check decides at its first look."""
    return trial_bounds(cfg, plan, search)[0]


# A trial's start on an idle node without a sweep of its own to go by, keyed (several nodes, CPU
# demo): measured with `python bench/null_sweeps.py --jobs 1` on a quiet 2-core machine (a demo
# trial 1.9 s in all), on the lent H200 (two NCCL hosts through torchrun: 7.5 to 8.8 s a trial) and
# with two CPU-demo nodes (about 10 s a trial).
IDLE_TRIAL_START_S = {(False, True): 1.8, (False, False): 7.0, (True, True): 10.0, (True, False): 8.0}


def estimate_seconds(plan: Plan, trials: int, cfg: Config, node: Node, collectives: int = 1) -> float:
    """Time of `trials` trials: each one's start (processes, interpreter, communicator set-up) plus
    the data it moves, for each of the `collectives` a trial measures.

    The start is what this node's own latest sweep of the same job shape measured
    (`measured_start_s`): it holds the machine as it is, a loaded CPU demo or a slow file system,
    where a constant cannot. Without one, the start of an idle node (IDLE_TRIAL_START_S): two
    interpreters importing torch on the demo's cores, the CUDA and NCCL set-up on a GPU node; for a
    job of several nodes also torchrun's agents and their rendezvous before the ranks start."""
    warmup, iters = iterations(cfg, node)
    bws = [p.bw_gbps for (a, b), p in node.paths.gpu_gpu.items() if a != b]
    bw = 0.3 if node.demo else max(1.0, min(bws) if bws else 10.0)
    per_collective = sum((warmup + iters + 2) * (30e-6 + s / (bw * 1e9)) for s in plan.sizes)
    nodes = plan.shape.nnodes
    start = measured_start_s(cfg, node, nodes)
    if start is None:
        start = IDLE_TRIAL_START_S[(nodes > 1, node.demo)]
    return trials * (start + max(1, collectives) * per_collective)


def measured_start_s(cfg: Config, node: Node, nnodes: int = 1) -> float | None:
    """The median start of a trial in this node's latest sweep with good trials for jobs of
    `nnodes` nodes (a multi-node sweep records its job in its summary): each trial's wall time less
    the time its measurements account for ((warmup + iterations) x the time per iteration it
    measured at each size). None without such a sweep or history."""
    from ..store import Store

    path = cfg.state_path("history.db")
    if not path.is_file():
        return None
    warmup, iters = iterations(cfg, node)
    try:
        with Store(path) as store:
            run = next((r for r in store.runs(limit=10, kind="sweep")
                        if r.fingerprint == node.fingerprint and r.backend == node.backend
                        and r.sweep_summary.job_nnodes == nnodes), None)
            trials = store.trials(run.id) if run is not None else []
    except (OSError, NccltuneError) as exc:
        log.debug("no measured trial start from the history: %s", exc)
        return None
    starts = [t.wall_s - (warmup + iters) * sum(m.time_us for m in t.measurements) / 1e6
              for t in trials if t.status == "ok" and t.wall_s and t.measurements]
    starts = [s for s in starts if s > 0]
    return statistics.median(starts) if starts else None
