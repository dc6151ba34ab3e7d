"""From the config and the node to the sweep's plan: what is measured, pinned, pruned, published
by policy, which sizes count how much, and about how long it will take."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from . import collectives as coll
from .config import Config, profile_collectives
from .errors import InputError
from .node import Node, iterations, size_ladder
from .publish import preflight
from .sweep import profiles
from .sweep.plan import JobShape, Plan, build_plan
from .sweep.select import Key
from .sweep.space import CATALOGUE, unknown_variable_hint
from .sweep.strategy import Settings

# Published by policy beside every tuning, never swept (torch's reaction to a failed collective).
POLICY_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


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


def check_profile(cfg: Config) -> None:
    """sweep.profile names a built-in or a configured profile.

    Raises:
        InputError: it names neither (exit 78).
    """
    profile = cfg.sweep.profile
    if profile not in profiles.BUILTIN and profile not in cfg.sweep.profiles:
        raise InputError(cfg.path or "config", f"unknown profile {profile!r}", line=cfg.lines.get("sweep.profile"),
                         hint=f"built in: {', '.join(profiles.BUILTIN)}; or define sweep.profiles")


def make_plan(cfg: Config, node: Node, env: Mapping[str, str], shape: JobShape | None = None) -> Plan:
    """The plan for this node, with the variables pinned by `env` (the calling environment) and
    the config, less the ones sweep.unpin frees; `shape` (several nodes, NIC loopback) decides
    which network variables can matter."""
    check_config_variables(cfg)
    policy = {POLICY_VAR: str(cfg.sweep.async_error_handling)}
    # What could not be published is found now, before the first trial (and by --plan).
    preflight(cfg.publish_dir, {**policy, **cfg.sweep.pin},
              {n: f"{cfg.path or 'config'}:{cfg.lines.get(f'sweep.pin.{n}')}" for n in cfg.sweep.pin})
    return build_plan(
        node.topo, node.paths, env=env, config_pins=cfg.sweep.pin, unpin=list(cfg.sweep.unpin),
        variables=cfg.sweep.variables, exclude=cfg.sweep.exclude, policy=policy,
        sizes=size_ladder(cfg, node.demo), backend=node.backend, nranks=node.nranks, shape=shape,
    )


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


def settings(cfg: Config) -> Settings:
    """The search's settings from the sweep section."""
    s = cfg.sweep
    return Settings(baseline_repeats=s.baseline_repeats, finalist_repeats=s.finalist_repeats,
                    max_finalists=s.max_finalists, min_gain_pct=s.min_gain_pct,
                    max_regression_pct=s.max_regression_pct, exhaustive=s.strategy == "exhaustive")


def estimate_seconds(plan: Plan, trials: int, cfg: Config, node: Node, collectives: int = 1) -> float:
    """Rough time: process start and communicator set-up, plus the data moved per size, for each
    of the `collectives` a trial measures."""
    overhead = 2.5 if node.demo else 7.0
    warmup, iters = iterations(cfg, node)
    bws = [p.bw_gbps for (a, b), p in node.paths.gpu_gpu.items() if a != b]
    bw = 0.3 if node.demo else max(1.0, min(bws) if bws else 10.0)
    per_collective = sum((warmup + iters + 2) * (30e-6 + s / (bw * 1e9)) for s in plan.sizes)
    return trials * (overhead + max(1, collectives) * per_collective)
