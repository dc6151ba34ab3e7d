"""How a trial's ranks are started: on this node, across nodes through torchrun, or through srun.

The runner (trials.runner) builds the worker's command and environment for a trial and asks its
`Launch` what to start on this node; it spawns those processes, waits with its hard timeout and
kills them as before. A launch adds what several nodes need:

- `LocalLaunch`: one process per rank on this node (one node). With `loopback=True` every rank
  gets NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 (NCCL_NET_DISABLE_INTRA removed), so traffic
  between local GPUs goes through the NICs and NCCL sees one rank per node. Its results carry the
  shape `<nranks>x1-nic-loopback`, a key of its own that no other shape matches.
- `TorchrunLaunch`: one torchrun agent per node (`python -m torch.distributed.run`, torchrun
  itself, run by the worker's interpreter), joined by c10d rendezvous at HOST:PORT with a fresh
  rendezvous id per trial and `--max-restarts 0`. The coordinating node (the one running the
  sweep) starts its own agent, which hosts the c10d store (`is_host=1`). Every other node runs
  `nccltune sweep --join HOST:PORT` (started by hand, by the site's pdsh/ssh, or by one Slurm
  step per node); it connects to the coordinator's control channel at HOST:PORT+1 and starts one
  agent per trial, on the coordinator's word.
- `SrunLaunch`: inside a Slurm allocation, one `srun` per trial over the allocation's first N nodes
  (task 0 on the first, block distribution), one GPU bound to each task (`--gpus-per-task=1`);
  srun starts every rank and passes this node's environment to all of them (`--export=ALL,NAMES`,
  with the values in srun's own environment: Slurm's --export list cannot hold values with commas,
  NCCL_IB_HCA's can). The options are explained where the command line is built.

Same environment on every rank, by construction (trials.trialenv builds it). With srun there is
one environment, the one srun was started with. With torchrun the coordinator sends each trial's
candidate (validated by publish.validate_env on both ends) with the trial id over the control
channel; a joining node runs its agent with its own base environment plus exactly that candidate
(the same TrialEnv.for_ranks), and the rendezvous id is the trial id, so an agent started for
another trial cannot join. A topology file among the candidate's variables (NCCL_TOPO_FILE, as
the marker publish.OWN_TOPOLOGY) travels as its text and is written on the joining node, which
resolves the variable to its own copy: nodes of one class share one topology. When the
coordinator reads NCCL's log, every node runs its ranks with the same debug variables
(trials.nccllog.debug_env, the log in its own trial directory), and the node where global rank 0
ran sends rank 0's log back with its result.

A trial that fails or hangs on any node ends on all of them, and the sweep goes on:
- a worker that exits non-zero: its agent stops the other local workers, and with --max-restarts
  0 every other agent sees the rendezvous closed and stops its workers too (torchrun's own rule);
  a joiner reports the exit to the coordinator, whose runner kills its own agent.
- a hang: only the coordinator's timeout can tell. It sends {"kill": seq} to every joiner and
  stops its own agent: SIGTERM (torchrun passes it on to its workers), KILL_GRACE_S later SIGKILL
  to the agent and to every process below it (torchrun starts each worker in a session of its
  own, so a process group kill alone would leave them). A joiner does the same to its agent on
  "kill"; without the message (coordinator gone) it does so at the trial's timeout plus
  KILL_GRACE_S by its own clock (the store's death usually makes its agent exit earlier). So every
  node is clear at most timeout_s + KILL_GRACE_S after the trial started when the coordinator is
  alive (measured here: a 20 s timeout, the joining node's agent gone 1.5 s after it), and
  timeout_s + 2 * KILL_GRACE_S when it is not; the coordinator then waits up to 2 * KILL_GRACE_S
  for the other nodes' reports, and the next trial starts.
- an agent killed outright (SIGKILL, the OOM killer) takes its workers with it: each worker dies
  with its parent (rankexec.die_with_parent), and a joiner's agent dies with the joiner.
- with srun, a task that exits non-zero ends the step (--kill-on-bad-exit=1), one that ends while
  the others still run ends them SRUN_WAIT_S later (--wait); srun then exits 143 whichever task
  failed, so the failing task's own report is read from srun's stderr (srun.first_failure). The
  runner's timeout sends srun SIGTERM, on which srun SIGKILLs every task on every node, and the
  runner SIGKILLs srun after KILL_GRACE_S.

The control channel between the coordinator and the joining nodes is described in channel.py.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import UsageError
from ...files.inputfile import read_bounded
from ...files.trust import without_python_paths
from ...publish import resolve_topology
from ...sweep.plan import JobShape
from ..held import Child
from .registry import CHOICES

log = logging.getLogger(__name__)

RANKEXEC = Path(__file__).parent.parent / "rankexec.py"
WORKER = Path(__file__).parent.parent / "worker.py"
LAUNCHERS = CHOICES  # registry.CHOICES, under the name callers import
DEFAULT_RDZV_PORT = 29400  # torchrun's own default for c10d
KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL, for an agent or srun
# What root reads of what a trial's processes print (they run as the rank user and may print
# anything, without end). Their stdout from its start: rank 0's JSON lines, one per collective and
# size of a few hundred bytes (256 sizes of every collective are under 1 MiB), and srun's or an
# agent's few lines of its own; 16 times that. Their stderr from its end: what is kept of it is
# its last lines (a failing rank's own last line, srun's account of the task that failed).
MAX_OUT_BYTES = 16 << 20
ERR_TAIL_BYTES = 1 << 20
# Rank variables of an enclosing launch must not reach a trial's ranks: the launch sets its own.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class LaunchShape:
    """The job a trial measures, as the results are keyed: nodes x ranks per node, NIC loopback.

    A NIC-loopback trial runs on one node but NCCL sees one rank per node, so its shape is
    nranks x 1 with `loopback`, and its label differs from every real multi-node shape."""

    nnodes: int
    ranks_per_node: int
    loopback: bool = False

    @property
    def nranks(self) -> int:
        return self.nnodes * self.ranks_per_node

    @property
    def label(self) -> str:
        return f"{self.nnodes}x{self.ranks_per_node}" + ("-nic-loopback" if self.loopback else "")

    def plan_shape(self) -> JobShape:
        """The shape build_plan prunes for: the physical nodes, loopback or not."""
        return JobShape(nnodes=1, loopback=True) if self.loopback else JobShape(nnodes=self.nnodes)


def loopback_shape(nranks: int) -> LaunchShape:
    return LaunchShape(nnodes=nranks, ranks_per_node=1, loopback=True)


@dataclass(frozen=True)
class ProcSpec:
    """One process the runner starts on this node: `name` for its output files (name.out/.err),
    `who` for messages ("rank 1", "torchrun on this node")."""

    name: str
    argv: list[str]
    env: dict[str, str]
    who: str


@dataclass(frozen=True)
class RankFailure:
    """The rank that ended a trial, as a launcher that reports one exit status for all its ranks
    tells it: `who` ("rank 3 on node-b"), `code` (its exit status, negative for a signal; None
    where the launcher said something else), `what` (the launcher's words), `said` (the rank's own
    last line of stderr, or "")."""

    who: str
    code: int | None
    what: str = ""
    said: str = ""


@dataclass(frozen=True)
class TrialSpec:
    """What the runner knows of a trial: `worker` is [python, worker.py, args...]; `env` the full
    environment with the candidate applied (trials.trialenv.TrialEnv.for_ranks); `candidate` the
    candidate alone, nccltune's topology file in it as the marker publish.OWN_TOPOLOGY;
    `nccl_log`: the runner reads NCCL's log of rank 0 (`env` holds nccllog.debug_env for this
    node); `user`: the rank user a launch whose processes run as the caller has its ranks switch to
    (rankexec --user); `topology_file`: the run's topology file the marker stands for here."""

    seq: int
    trial_dir: Path
    worker: list[str]
    env: dict[str, str]
    candidate: dict[str, str]
    timeout_s: float
    nccl_log: bool = False
    user: str | None = None
    topology_file: Path | None = None

    @property
    def resolved_candidate(self) -> dict[str, str]:
        """The candidate with the marker as this node's path of the run's topology file."""
        return resolve_topology(self.candidate, self.topology_file)


class Launch:
    """Base: what to start on this node, and the hooks around the runner's wait and kill."""

    launcher = "local"
    # What it starts runs as the caller, not as bench.user (trials.credentials): its ranks switch
    # themselves (TrialSpec.user).
    runs_as_caller = False

    def __init__(self, shape: LaunchShape, node_class: str | None = None) -> None:
        self.shape = shape
        self.node_class = node_class

    def record(self) -> dict[str, Any]:
        """What results are stored with: the shape, its label (the key) and the node class."""
        return {"label": self.shape.label, "nnodes": self.shape.nnodes, "ranks_per_node": self.shape.ranks_per_node,
                "loopback": self.shape.loopback, "launcher": self.launcher, "node_class": self.node_class}

    def prepare(self) -> None:
        """Before a trial's clock starts: have every other node ready (a torchrun launch admits its
        joiners here, so their coming never counts against a trial's time limit)."""

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        """Tell other nodes (where there are any) and return what to spawn here."""
        raise NotImplementedError

    def poll(self) -> str | None:
        """Why the trial failed on another node, once it has; None while nothing is known."""
        return None

    def stop(self, procs: Sequence[Child]) -> None:
        """Before the runner SIGKILLs its process groups: end the trial everywhere (`procs`: what
        the runner started by exec here, held by their pidfds)."""

    def finish(self, trial_dir: Path) -> None:
        """After the wait: leave rank 0's JSON lines in trial_dir/rank0.out."""

    def failed_rank(self, trial_dir: Path) -> RankFailure | None:
        """After finish, when the one process started here exited non-zero for all the ranks:
        which rank failed, and how (None: not known beyond that exit status)."""
        return None

    def close(self) -> None:
        """At the end of the sweep."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(text: str, what: str = "--rdzv-endpoint") -> tuple[str, int]:
    """HOST:PORT (IPv6 as [ADDR]:PORT); PORT+1 must be a port too (the control channel).

    Raises:
        UsageError: malformed (exit 2).
    """
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65534:
        raise UsageError(f"{what} {text!r}: expected HOST:PORT with PORT between 1 and 65534")
    if any(c.isspace() for c in host) or host.startswith("-"):
        raise UsageError(f"{what} {text!r}: not a host name or address")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def worker_args(worker: Sequence[str]) -> list[str]:
    """The arguments after worker.py in [python, -I, worker.py, args...]."""
    return list(worker[list(worker).index(str(WORKER)) + 1:])


def clean_env(env: Mapping[str, str]) -> dict[str, str]:
    """A launcher's environment: no rank variables of the caller, nothing that points a Python
    started without -I (torchrun's workers) at other modules (trust.without_python_paths)."""
    return without_python_paths({k: v for k, v in env.items() if k not in RANK_VARS})


def read_text(path: Path, *, tail: bool = False) -> str:
    """The output a trial's process wrote to `path` as text, "" where there is none: its first
    MAX_OUT_BYTES (with `tail`: its last ERR_TAIL_BYTES, from a whole line on)."""
    try:
        got = read_bounded(path, ERR_TAIL_BYTES if tail else MAX_OUT_BYTES, tail=tail)
    except OSError:
        return ""
    if tail and got.cut:
        return "".join(f"{line}\n" for line in got.lines())
    return got.data.decode(errors="replace")


# -- choosing one ----------------------------------------------------------------------------------------


def resolve_launcher(launcher: str, nnodes: int, env: Mapping[str, str]) -> str:
    """auto: srun inside an allocation of several nodes, torchrun for --nodes > 1, else local.

    Raises:
        UsageError: an impossible combination (exit 2).
    """
    from .srun import slurm_node_count

    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    if launcher == "auto":
        if slurm_node_count(env) > 1:
            return "srun"
        return "torchrun" if nnodes > 1 else "local"
    if launcher == "local" and nnodes > 1:
        raise UsageError(f"--launcher local runs on this node only; --nodes {nnodes} needs torchrun or srun")
    if launcher == "srun" and not env.get("SLURM_JOB_ID"):
        raise UsageError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID is not set)",
                         hint="run inside sbatch/salloc, or use --launcher torchrun")
    return launcher


def make_launch(shape: LaunchShape, launcher: str, endpoint: tuple[str, int] | None, *,
                node_class: str | None = None, env: Mapping[str, str] | None = None, gpus: bool = False,
                key_file: str | None = None) -> Launch:
    """The Launch for a sweep of `shape` (`launcher` one of LAUNCHERS, `endpoint` the rendezvous;
    `gpus`: the ranks run on GPUs, one each, which srun then binds; `key_file`: the multi-node key
    of a torchrun launch over several nodes, default channel.KEY_FILE).

    Raises:
        UsageError: an impossible combination, or an allocation too small for the trials (exit
        2); UnavailableError: Slurm asked for, and scontrol cannot name the nodes or the first
        does not resolve (exit 69).
    """
    from .channel import KEY_FILE
    from .local import LocalLaunch
    from .srun import allocation_hosts, srun_launch
    from .torchrun import TorchrunLaunch

    env = os.environ if env is None else env
    if shape.loopback:
        if launcher not in ("auto", "local"):
            raise UsageError(f"--loopback measures this node alone; it cannot run with --launcher {launcher}")
        return LocalLaunch(shape.nranks, loopback=True, node_class=node_class)
    choice = resolve_launcher(launcher, shape.nnodes, env)
    if choice == "local":
        return LocalLaunch(shape.ranks_per_node, node_class=node_class)
    if choice == "torchrun":
        if endpoint is None and shape.nnodes > 1:
            # The control channel listens on exactly the address given, never one of its own choosing.
            raise UsageError(f"--nodes {shape.nnodes} with torchrun needs --rdzv-endpoint HOST:PORT: the address of "
                             "this node that the other nodes reach (the rendezvous and the control channel listen "
                             "there, on PORT and PORT+1)")
        ep = endpoint or ("127.0.0.1", DEFAULT_RDZV_PORT)
        return TorchrunLaunch(shape.nnodes, shape.ranks_per_node, ep, node_class=node_class,
                              key_file=key_file or KEY_FILE,
                              job_hosts=allocation_hosts(env) if shape.nnodes > 1 else ())
    return srun_launch(shape, endpoint[1] if endpoint else None, env, gpus=gpus, node_class=node_class)


@dataclass(frozen=True)
class LaunchRequest:
    """What the command line asked for; the pipeline turns it into a Launch once it knows the
    node's ranks (`build`)."""

    nodes: int = 1
    loopback: bool = False
    launcher: str = "auto"
    endpoint: tuple[str, int] | None = None
    key_file: str | None = None  # multinode.key_file, for a torchrun launch over several nodes
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), compare=False, repr=False)

    @property
    def single_node(self) -> bool:
        """Today's sweep: this node, its own ranks, no NIC loopback."""
        return resolve_launcher(self.launcher, self.nodes, self.env) == "local" and not self.loopback

    def shape(self, ranks_per_node: int) -> LaunchShape:
        return loopback_shape(ranks_per_node) if self.loopback else LaunchShape(self.nodes, ranks_per_node)

    def build(self, ranks_per_node: int, node_class: str | None = None, *, gpus: bool = False) -> Launch:
        return make_launch(self.shape(ranks_per_node), self.launcher, self.endpoint, node_class=node_class,
                           env=self.env, gpus=gpus, key_file=self.key_file)

    @property
    def authenticated(self) -> bool:
        """The sweep runs the control channel (torchrun over several nodes), which needs the key."""
        launcher = resolve_launcher(self.launcher, self.nodes, self.env)
        return not self.loopback and self.nodes > 1 and launcher == "torchrun"
