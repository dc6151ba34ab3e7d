"""srun inside a Slurm allocation: one step per trial over the allocation's first nodes."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UnavailableError, UsageError
from ...files.trust import python_argv
from ...publish import validate_env
from .. import nccllog
from ..held import Child
from .base import (
    KILL_GRACE_S,
    Launch,
    LaunchShape,
    ProcSpec,
    RankFailure,
    TrialSpec,
    clean_env,
    free_port,
    rank_argv,
    read_text,
    worker_args,
)
from .slurm import cpus_per_node, slurm_node_count, slurm_nodes, this_node

if TYPE_CHECKING:
    from .base import LaunchRequest

log = logging.getLogger(__name__)


def check_room(hosts: Sequence[str], ranks_per_node: int, env: Mapping[str, str]) -> None:
    """Refuse an allocation that cannot run `ranks_per_node` tasks on each of `hosts` (its first
    nodes): srun would refuse every trial's step ("More processors requested than permitted").
    A step inherits the allocation's --cpus-per-task (SLURM_CPUS_PER_TASK), one CPU otherwise.

    Raises:
        UsageError: too few CPUs on one of the nodes (exit 2).
    """
    text = env.get("SLURM_CPUS_PER_TASK", "")
    per_task = int(text) if text.isdigit() and int(text) > 0 else 1
    for host, cpus in zip(hosts, cpus_per_node(env), strict=False):  # [] where Slurm does not say
        if cpus < ranks_per_node * per_task:
            raise UsageError(
                f"the allocation holds {cpus} CPU(s) on {host}, and every trial runs {ranks_per_node} task(s) "
                f"per node with {per_task} CPU each: srun would refuse every trial",
                hint=f"allocate them: sbatch/salloc --nodes {len(hosts)} --ntasks-per-node={ranks_per_node}")


def check_resolves(host: str) -> None:
    """Rank 0 listens on the allocation's first node, and every rank connects to it by name
    (MASTER_ADDR): a name that does not resolve would leave every trial waiting until its timeout.

    Raises:
        UnavailableError: `host` does not resolve here (exit 69).
    """
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:
        raise UnavailableError(
            f"the allocation's first node {host} does not resolve here ({exc}): every rank connects to rank 0 "
            f"there by that name", hint="Slurm's node names must resolve on every node (DNS or /etc/hosts)") from exc


def from_request(request: LaunchRequest, shape: LaunchShape, *, node_class: str | None = None,
                 gpus: bool = False) -> SrunLaunch:
    """The registry's factory: srun_launch in the allocation the request's environment describes,
    the rendezvous port its endpoint's where given."""
    return srun_launch(shape, request.endpoint[1] if request.endpoint else None, request.env, gpus=gpus,
                       node_class=node_class)


def srun_launch(shape: LaunchShape, master_port: int | None, env: Mapping[str, str], *, gpus: bool,
                node_class: str | None) -> SrunLaunch:
    """The SrunLaunch of a sweep of `shape` in the allocation `env` describes, checked before the
    first trial: enough nodes, room for the tasks on each, a first node whose name resolves.

    Raises:
        UsageError: too few nodes or CPUs (exit 2); UnavailableError: scontrol cannot name the
        nodes, or the first does not resolve (exit 69).
    """
    nnodes = shape.nnodes if shape.nnodes > 1 else max(1, slurm_node_count(env))
    hosts = slurm_nodes(env)
    if nnodes > len(hosts):
        raise UsageError(f"--nodes {nnodes}: the allocation has {len(hosts)} node(s)")
    check_room(hosts[:nnodes], shape.ranks_per_node, env)
    check_resolves(hosts[0])
    here = this_node(env)
    if hosts[0] != here and hosts[0].split(".")[0] != here.split(".")[0]:
        log.warning("rank 0 runs on %s, the allocation's first node, not on this node (%s): its NCCL log stays "
                    "there, and trials go without the algorithm and protocol per size; run the sweep on %s",
                    hosts[0], here, hosts[0])
    return SrunLaunch(nnodes, shape.ranks_per_node, master_addr=hosts[0], master_port=master_port,
                      nodelist=hosts[:nnodes], gpus_per_task=1 if gpus else 0, node_class=node_class)


SRUN_WAIT_S = 60  # srun --wait: a task that ended while others run means those others are stuck
# With --label, srun starts every line a task writes with the task's number: "3: text".
LABELLED = re.compile(r" *(\d+): ?(.*)")
# srun's account of a task that ended badly: "srun: error: NODE: task 3: Exited with exit code 4",
# "...: task 3: Aborted" (strsignal's words), "...: tasks 0-1: Terminated".
TASK_ENDED = re.compile(r"srun: error: (\S+): tasks? (\d+)[-,\d]*: (.*)")
EXITED = re.compile(r"Exited with exit code (\d+)")
SIGNAL_WORDS = {signal.strsignal(s) or s.name: int(s) for s in signal.Signals}


def task_lines(text: str, task: int) -> list[str]:
    """The lines task `task` wrote, without srun's label (and without slurmstepd's own lines)."""
    out = []
    for line in text.splitlines():
        m = LABELLED.fullmatch(line)
        if m and int(m[1]) == task and not m[2].startswith("slurmstepd"):
            out.append(m[2])
    return out


def first_failure(srun_err: str) -> RankFailure | None:
    """The task that ended a step, from srun's stderr: the first task srun reports as ended badly
    (the ones --kill-on-bad-exit then terminated come after it), with its exit status or signal and
    its own last line; where no task ended, srun's own first error (a step it could not start)."""
    own_error = None
    for line in srun_err.splitlines():
        m = TASK_ENDED.fullmatch(line.strip())
        if m is None:
            if own_error is None and line.startswith("srun: error: "):
                own_error = line.removeprefix("srun: error: ").strip()[:200]
            continue
        node, task, what = m[1], int(m[2]), m[3].strip()
        exited = EXITED.fullmatch(what)
        signum = SIGNAL_WORDS.get(what.removesuffix(" (core dumped)"))
        code = int(exited[1]) if exited else -signum if signum else None
        own = task_lines(srun_err, task)
        return RankFailure(f"rank {task} on {node}", code, what, own[-1][:200] if own else "")
    return RankFailure("srun", None, own_error) if own_error else None


class SrunLaunch(Launch):
    """One srun over the allocation's nodes per trial; rank 0's output comes back on srun's stdout.

    `nodelist`: the nodes of the step, the first one hosting task 0 (rank 0, MASTER_ADDR; sbatch
    runs its script there); `gpus_per_task`: GPUs bound to each task (0 for the CPU demo, whose
    allocation has none)."""

    launcher = "srun"
    # Slurm creates a step only for the allocation's owner (or root): srun cannot run as bench.user;
    # its tasks switch in rankexec.
    runs_as_caller = True

    def __init__(self, nnodes: int, ntasks_per_node: int, *, master_addr: str, master_port: int | None = None,
                 nodelist: Sequence[str] = (), gpus_per_task: int = 0, srun: str = "srun",
                 node_class: str | None = None) -> None:
        super().__init__(LaunchShape(nnodes, ntasks_per_node), node_class)
        self.master_addr = master_addr
        self.master_port = master_port
        self.nodelist = list(nodelist)
        self.gpus_per_task = gpus_per_task
        self.srun = srun

    def command(self, trial: TrialSpec, names: Sequence[str]) -> list[str]:
        """srun's command line for `trial`; `names`: the variables every task must get from srun's
        own environment (the candidate's, the rendezvous', NCCL's log settings). What each option
        does, as srun(1) documents it, is said beside it."""
        minutes = int(trial.timeout_s // 60) + 2  # Slurm's own limit is a backstop behind the runner's
        n, p = self.shape.nnodes, self.shape.ranks_per_node
        # An explicit task count: --gpus-per-task requires one.
        argv = [self.srun, "--nodes", str(n), "--ntasks", str(n * p), "--ntasks-per-node", str(p)]
        if self.nodelist:
            argv.append(f"--nodelist={','.join(self.nodelist)}")
        # block: consecutive tasks share a node, in node order, so task 0 runs on the first node.
        # Without an explicit distribution, a configured topology plugin orders tasks by topology.
        argv.append("--distribution=block")
        if self.gpus_per_task:
            # Implies --tres-bind=gres/gpu:per_task:N: each task is bound to its own GPU(s), and
            # Slurm sets CUDA_VISIBLE_DEVICES for each task to them (the worker takes the one it sees).
            argv.append(f"--gpus-per-task={self.gpus_per_task}")
        # --kill-on-bad-exit=1: the step is terminated as soon as any task exits non-zero (this takes
        # precedence over --wait; current Slurm documents it as needing proctrack/cgroup with
        # cgroup/v2). --wait: the remaining tasks are terminated this long after the first task
        # ends; without it, slurm.conf's WaitTime decides. The runner's timeout stays the last word.
        argv += ["--kill-on-bad-exit=1", f"--wait={SRUN_WAIT_S}"]
        # --label: every line of output starts with its task's number, so rank 0's JSON lines and a
        # failing task's own message can be told apart in srun's two merged streams.
        argv.append("--label")
        # --export=ALL,NAMES: a name without a value passes srun's current value to every task (values
        # stay out of the list: it is comma-separated, and NCCL_IB_HCA's values hold commas). Given
        # on the command line, it wins over the export setting steps would otherwise inherit from
        # sbatch (--export=NONE, say): srun's command line options override its environment variables.
        argv.append(f"--export=ALL,{','.join(['MASTER_ADDR', 'MASTER_PORT', *names])}")
        # rankexec --slurm: each task's rank variables from Slurm's (registry's srun entry); --user:
        # each task, started as the allocation's owner, becomes bench.user.
        return [*argv, f"--time={minutes}", *python_argv(trial.worker[0]),
                *rank_argv(worker_args(trial.worker), slurm=True, user=trial.user)]

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        # By value: srun's --export names the candidate's variables, the run's topology file among them.
        candidate = validate_env(trial.resolved_candidate, source="trial candidate")
        # The master port is chosen free here; sbatch runs its script on the allocation's first node,
        # so that is where rank 0 listens (elsewhere, give the port explicitly).
        port = self.master_port or free_port("0.0.0.0")
        # NCCLTUNE_DISABLE: the TaskProlog (launchers/slurm-prolog.sh) exports nothing, so this node's
        # published set never adds to or replaces what the trial measures.
        env = {**clean_env(trial.env), **candidate, "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port),
               "NCCLTUNE_DISABLE": "1"}
        names = ["NCCLTUNE_DISABLE", *sorted(candidate)]
        if trial.nccl_log:
            # The log's path is this node's trial directory: rank 0, on this node, writes it there.
            names += sorted(set(nccllog.debug_env(trial.trial_dir)) - set(names))
        if self.gpus_per_task:
            env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm sets it for each task from its binding
        return [ProcSpec("srun", self.command(trial, names), env, "srun")]

    def stop(self, procs: Sequence[Child]) -> None:
        # srun does not pass SIGTERM on: it SIGKILLs every task of the step on every node ("forcing
        # job termination") and waits up to KillWait + 2 s for them to go; the runner's SIGKILL to
        # srun follows KILL_GRACE_S later.
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # through its pidfd (trials.held)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S)

    def finish(self, trial_dir: Path) -> None:
        out, err = read_text(trial_dir / "srun.out"), read_text(trial_dir / "srun.err", tail=True)
        (trial_dir / "rank0.out").write_text("".join(f"{line}\n" for line in task_lines(out, 0)))
        (trial_dir / "rank0.err").write_text("".join(f"{line}\n" for line in task_lines(err, 0)))

    def failed_rank(self, trial_dir: Path) -> RankFailure | None:
        # srun's own exit status is 143 (a task it terminated), whichever task failed and how.
        return first_failure(read_text(trial_dir / "srun.err", tail=True))
