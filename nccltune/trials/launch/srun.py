"""srun inside a Slurm allocation: one step per trial over the allocation's first nodes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...errors import UnavailableError
from ...publish import validate_env
from .. import nccllog
from . import (
    KILL_GRACE_S,
    RANKEXEC,
    WORKER,
    Launch,
    LaunchShape,
    ProcSpec,
    TrialSpec,
    clean_env,
    free_port,
    read_text,
    worker_args,
)


def slurm_nodes(env: Mapping[str, str], scontrol: str = "scontrol") -> list[str]:
    """The allocation's host names, in order, from `scontrol show hostnames $SLURM_JOB_NODELIST`.

    Raises:
        UnavailableError: not in an allocation, or scontrol failed (exit 69).
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UnavailableError("SLURM_JOB_NODELIST is not set: srun trials need a Slurm allocation",
                               hint="run inside sbatch/salloc, or use --launcher torchrun")
    exe = shutil.which(scontrol, path=env.get("PATH")) or scontrol
    try:
        done = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60,
                              env=dict(env), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UnavailableError(f"scontrol show hostnames failed: {exc}") from exc
    hosts = done.stdout.split()
    if done.returncode != 0 or not hosts:
        raise UnavailableError(f"scontrol show hostnames {nodelist} failed: {done.stderr.strip()[:200]}")
    return hosts


def slurm_node_count(env: Mapping[str, str]) -> int:
    """Nodes of the enclosing allocation; 0 outside one."""
    if not env.get("SLURM_JOB_ID"):
        return 0
    text = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return int(text) if text.isdigit() else 1


SRUN_WAIT_S = 60  # srun --wait: a task that ended while others run means those others are stuck


class SrunLaunch(Launch):
    """One srun over the allocation's nodes per trial; rank 0's output comes back on srun's stdout.

    `nodelist`: the nodes of the step, the first one hosting task 0 (rank 0, MASTER_ADDR; sbatch
    runs its script there); `gpus_per_task`: GPUs bound to each task (0 for the CPU demo, whose
    allocation has none)."""

    launcher = "srun"
    # Slurm creates a step only for the allocation's owner (or root): srun cannot run as bench.user.
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
        # --export=ALL,NAMES: a name without a value passes srun's current value to every task (values
        # stay out of the list: it is comma-separated, and NCCL_IB_HCA's values hold commas). Given
        # on the command line, it wins over the export setting steps would otherwise inherit from
        # sbatch (--export=NONE, say): srun's command line options override its environment variables.
        argv.append(f"--export=ALL,{','.join(['MASTER_ADDR', 'MASTER_PORT', *names])}")
        return [*argv, f"--time={minutes}", trial.worker[0], str(RANKEXEC), "--slurm", str(WORKER),
                *worker_args(trial.worker)]

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        candidate = validate_env(trial.candidate, source="trial candidate")
        # The master port is chosen free here; sbatch runs its script on the allocation's first node,
        # so that is where rank 0 listens (elsewhere, give the port explicitly).
        port = self.master_port or free_port("0.0.0.0")
        env = {**clean_env(trial.env), **candidate, "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port)}
        names = sorted(candidate)
        if trial.nccl_log:
            # The log's path is this node's trial directory: rank 0, on this node, writes it there.
            names += sorted(set(nccllog.debug_env(trial.trial_dir)) - set(names))
        if self.gpus_per_task:
            env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm sets it for each task from its binding
        return [ProcSpec("srun", self.command(trial, names), env, "srun")]

    def stop(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        # srun passes SIGTERM to every task on every node; the runner's SIGKILL follows.
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S)

    def finish(self, trial_dir: Path) -> None:
        (trial_dir / "rank0.out").write_text(read_text(trial_dir / "srun.out"))
        (trial_dir / "rank0.err").write_text(read_text(trial_dir / "srun.err"))

