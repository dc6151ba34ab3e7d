"""What every launcher builds on, and the choice of one: the `Launch` base with its hooks, the
types the runner and the launchers share (`LaunchShape`, `TrialSpec`, `ProcSpec`, `RankFailure`,
`LaunchRequest`), their helpers (a rank's command line, the environment a launcher passes on, the
bounded read of what a trial's processes print), and `resolve_launcher` and `make_launch`, which
read the registry (registry.py) and load the chosen launcher's module only then. Imports no
launcher: every launcher imports this module.
"""

from __future__ import annotations

import logging
import os
import random
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
from . import registry
from .slurm import slurm_node_count

log = logging.getLogger(__name__)

__all__ = ["ERR_TAIL_BYTES", "KILL_GRACE_S", "LAUNCHERS", "MAX_OUT_BYTES", "RANKEXEC", "RANK_VARS", "WORKER", "Launch",
           "LaunchRequest", "LaunchShape", "ProcSpec", "RankFailure", "TrialSpec", "clean_env", "free_port",
           "host_port", "is_loopback", "loopback_shape", "make_launch", "parse_endpoint", "rank_argv", "read_text",
           "resolve_launcher", "worker_args"]

RANKEXEC = Path(__file__).parent.parent / "rankexec.py"
WORKER = Path(__file__).parent.parent / "worker.py"
LAUNCHERS = registry.CHOICES  # under the name callers import
KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL, for an agent or srun
# What root reads of what a trial's processes print (they run as the rank user and may print
# anything, without end). Their stdout from its start: rank 0's JSON lines, one per collective and
# size of a few hundred bytes (256 sizes of every collective are under 1 MiB), and srun's or an
# agent's few lines of its own; 16 times that. Their stderr from its end: what is kept of it is
# its last lines (a failing rank's own last line, srun's account of the task that failed).
MAX_OUT_BYTES = 16 << 20
ERR_TAIL_BYTES = 1 << 20
# Rank variables of an enclosing launch must not reach a trial's ranks: the launch sets its own.
RANK_VARS = (*registry.WORKER_RANK_VARS, "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


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


# Where a rendezvous port is chosen: below Linux's default ephemeral range (32768-60999). A port
# the kernel hands out from that range (bind to port 0) is free only until rank 0 binds it, and any
# outgoing connection on the node may take it as its own source port meanwhile (rank 0 then fails
# with EADDRINUSE); below the range only another listener can.
RDZV_PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, from RDZV_PORTS (the kernel's choice where none is)."""
    rng = random.SystemRandom()
    for _ in range(32):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, rng.choice(RDZV_PORTS)))
            except OSError:
                continue
            return int(s.getsockname()[1])
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


def rank_argv(args: Sequence[str], *, slurm: bool = False, user: str | None = None) -> list[str]:
    """What a launcher starts as each rank, after the interpreter: rankexec.py, then worker.py with
    `args` (`slurm`: rankexec maps Slurm's rank variables, registry's srun entry; `user`: the rank
    user it becomes when started as root)."""
    return [str(RANKEXEC), *(["--slurm"] if slurm else []), *(["--user", user] if user else []), str(WORKER), *args]


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
    """auto: srun inside an allocation of several nodes, torchrun for --nodes > 1, else local; any
    other name as the registry has it.

    Raises:
        UsageError: a name not registered, or an impossible combination (exit 2).
    """
    if launcher != registry.AUTO and registry.entry(launcher) is None:
        raise UsageError(f"--launcher {launcher!r}: expected one of {', '.join(registry.choices())}")
    if launcher == registry.AUTO:
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
                key_file: str | None = None, image: str | None = None) -> Launch:
    """The Launch for a sweep of `shape` (`launcher` one of LAUNCHERS, `endpoint` the rendezvous;
    `gpus`: the ranks run on GPUs, one each, which srun then binds; `key_file`: the multi-node key
    of a torchrun launch over several nodes, default sealing.KEY_FILE; `image`: the digest of the
    image every node measures in, None on the host), made by the chosen
    launcher's factory (registry.Launcher.load).

    Raises:
        UsageError: an impossible combination, or an allocation too small for the trials (exit
        2); UnavailableError: Slurm asked for, and scontrol cannot name the nodes or the first
        does not resolve (exit 69).
    """
    env = os.environ if env is None else env
    if shape.loopback:
        if launcher not in (registry.AUTO, registry.LOOPBACK):
            raise UsageError(f"--loopback measures this node alone; it cannot run with --launcher {launcher}")
        choice = registry.LOOPBACK
    else:
        choice = resolve_launcher(launcher, shape.nnodes, env)
    entry = registry.entry(choice)
    assert entry is not None  # resolve_launcher returns registered names only
    request = LaunchRequest(nodes=shape.nnodes, loopback=shape.loopback, launcher=choice, endpoint=endpoint,
                            key_file=key_file, env=env, image=image)
    launch = entry.load()(request, shape, node_class=node_class, gpus=gpus)
    if not isinstance(launch, Launch):
        raise TypeError(f"{entry.module}.{entry.factory} made {type(launch).__name__}, not a Launch")
    return launch


@dataclass(frozen=True)
class LaunchRequest:
    """What the command line asked for; the pipeline turns it into a Launch once it knows the
    node's ranks (`build`)."""

    nodes: int = 1
    loopback: bool = False
    launcher: str = "auto"
    endpoint: tuple[str, int] | None = None
    key_file: str | None = None  # multinode.key_file, for a torchrun launch over several nodes
    image: str | None = None  # bench.image's digest: every node of a torchrun launch measures in it
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), compare=False, repr=False)

    @property
    def single_node(self) -> bool:
        """Today's sweep: this node, its own ranks, no NIC loopback."""
        return resolve_launcher(self.launcher, self.nodes, self.env) == "local" and not self.loopback

    def shape(self, ranks_per_node: int) -> LaunchShape:
        return loopback_shape(ranks_per_node) if self.loopback else LaunchShape(self.nodes, ranks_per_node)

    def build(self, ranks_per_node: int, node_class: str | None = None, *, gpus: bool = False) -> Launch:
        return make_launch(self.shape(ranks_per_node), self.launcher, self.endpoint, node_class=node_class,
                           env=self.env, gpus=gpus, key_file=self.key_file, image=self.image)

    @property
    def authenticated(self) -> bool:
        """The sweep runs the control channel (torchrun over several nodes), which needs the key."""
        launcher = resolve_launcher(self.launcher, self.nodes, self.env)
        return not self.loopback and self.nodes > 1 and launcher == "torchrun"
