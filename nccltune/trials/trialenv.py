"""One trial's environment, built in one place and passed one way: from the plan to the ranks.

A trial's environment has two parts:

- the fixed part, what every trial of a run starts from: on the node that runs the sweep, the
  calling environment as the job set it (without what a launch applied of the published set:
  delivery.jobenv.from_published) with the config's pins, without sweep.unpin's variables and
  without what an earlier publish put there (``fixed_part``); on a joining node, its own
  environment as its job set it;
- the candidate, the variables one trial tries. The search, the per-size stage and verify only
  compose candidates: every candidate but NCCL's defaults carries the policy values and, unless
  the site pins a topology file, nccltune's own as the marker publish.OWN_TOPOLOGY (``carried``).

``TrialEnv.for_ranks`` is the one function that makes what a rank process gets of both, on the
node its ranks run on (``RankSide``): the marker resolved to that node's copy of the run's
topology file (the runner: ``runs/NNNNN/ncclTopology.xml``; a joining node: the copy it wrote
from the text that came), the GPUs, the Python settings every worker needs, the rank user's
identity (trials.credentials) and NCCL's log (trials.nccllog). The launches (trials/launch/) add
only what one rank or one launcher needs: RANK and the rendezvous, srun's --export list.

``TrialEnv.recorded`` is the candidate as the history stores it: the marker as the run's own
topology file. The publisher resolves the same marker to the generation's copy (publish.topofile).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..files.trust import without_python_paths
from ..publish import (
    OWN_TOPOLOGY,
    TOPO_FILE_VAR,
    TUNER_FINGERPRINT_VAR,
    TUNER_PLUGIN_VAR,
    TUNER_TABLE_VAR,
    resolve_topology,
)
from ..sweep.plan import Plan
from ..tuner.build import is_own_tuner
from .credentials import RankUser, rank_env
from .nccllog import debug_env

# nccltune's own tuner in an environment: the plugin, its table and the table's fingerprint.
TUNER_VARS = frozenset({TUNER_PLUGIN_VAR, TUNER_TABLE_VAR, TUNER_FINGERPRINT_VAR})


def names_own_topology(env: Mapping[str, str]) -> bool:
    """Whether `env` names nccltune's own topology file (the marker publish.OWN_TOPOLOGY), which
    stands for the run's copy in a trial and for the generation's in a publish."""
    return env.get(TOPO_FILE_VAR) == OWN_TOPOLOGY


def fixed_part(calling: Mapping[str, str], pins: Mapping[str, str], unpin: Iterable[str]) -> dict[str, str]:
    """What every trial of a sweep starts from: ``calling`` (the calling environment as the job set
    it, delivery.jobenv's ``FromPublished.own``) with the config's ``pins`` set and the
    ``unpin`` variables removed, and without what an earlier publish put there (its NCCL_TOPO_FILE,
    nccltune's own tuner and table), which must not leak into NCCL's defaults. A foreign tuner
    stays: it is the site's default. A topology file the config pins is kept, as the published set
    names it (publish.topology_env)."""
    env = {name: value for name, value in calling.items() if name != TOPO_FILE_VAR}
    env.update(pins)
    for name in unpin:
        env.pop(name, None)
    if is_own_tuner(env.get(TUNER_PLUGIN_VAR, "none")):
        env.pop(TUNER_PLUGIN_VAR, None)
    for name in (TUNER_TABLE_VAR, TUNER_FINGERPRINT_VAR):
        env.pop(name, None)
    return env


def carried(plan: Plan) -> dict[str, str]:
    """What every candidate but NCCL's defaults carries: nccltune's own topology file (the marker)
    unless the site pins one, which NCCL in the trials then reads where it is, and the plan's policy
    values (a finished trial shows torch takes them)."""
    own = {} if TOPO_FILE_VAR in plan.pinned else {TOPO_FILE_VAR: OWN_TOPOLOGY}
    return {**own, **plan.policy}


@dataclass(frozen=True)
class RankSide:
    """Where one trial's ranks run on one node: ``topology_file`` is this node's copy of the run's
    topology file (None: the trial names none of nccltune's), ``trial_dir`` and ``rank_dir`` the
    trial's directories, ``cache`` the ranks' cache, ``user`` the rank user (None: the caller),
    ``nccl_log`` whether NCCL writes its log for the runner, ``gpus`` the GPUs the ranks see (None:
    as the fixed part says)."""

    topology_file: Path | None
    trial_dir: Path
    rank_dir: Path
    cache: Path
    user: RankUser | None = None
    nccl_log: bool = False
    gpus: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TrialEnv:
    """One trial's environment before it reaches a node: the fixed part and the candidate (which
    may name nccltune's own topology file by the marker). Both are read-only once built."""

    fixed: Mapping[str, str]
    candidate: Mapping[str, str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))
        object.__setattr__(self, "candidate", MappingProxyType(dict(self.candidate)))

    @property
    def own_topology(self) -> bool:
        """The candidate names nccltune's own topology file (the marker)."""
        return names_own_topology(self.candidate)

    def recorded(self, topology_file: Path | None) -> dict[str, str]:
        """The candidate with the marker as ``topology_file``: what the history stores of the trial,
        and what a launcher that passes the candidate by value (srun) hands on.

        Raises:
            ValueError: the candidate names the marker and ``topology_file`` is None."""
        return resolve_topology(self.candidate, topology_file)

    def for_ranks(self, side: RankSide) -> dict[str, str]:
        """What every rank process of the trial gets on the node ``side`` describes, before its
        launch adds the rank's own variables: the fixed part, the candidate over it (the marker as
        this node's copy of the topology file), the GPUs, no Python search path (the worker must
        see its own directory only, also under torchrun, which starts it without -I), unbuffered
        output for the runner's reading, one OpenMP thread unless set, the rank user's identity
        and NCCL's log when the runner reads it.

        Raises:
            ValueError: the candidate names the marker and ``side`` has no topology file."""
        env = {**self.fixed, **self.recorded(side.topology_file)}
        if side.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in side.gpus)
        env = without_python_paths(env)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        env = rank_env(env, side.user, side.rank_dir, side.cache)
        if side.nccl_log:
            env.update(debug_env(side.trial_dir))
        return env
