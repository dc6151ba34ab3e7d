"""Rank entry point under torchrun and srun: map the launcher's variables, then exec the worker.

Executed by path with the worker's interpreter (standard library only, like worker.py). It
replaces itself with `python worker.py ARGS...` (same pid, so the launcher watches the worker
itself) after three adjustments:
- the rank dies with its launcher (`die_with_parent`, the same rule the runner gives the ranks it
  starts itself): torchrun starts each worker in a session of its own, and an agent killed with
  SIGKILL cannot stop them, so without it its workers would go on holding the GPUs. The death
  signal stays armed across the exec.
- `--slurm`: RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE from SLURM_PROCID, SLURM_LOCALID,
  SLURM_NTASKS and SLURM_NTASKS_PER_NODE (srun sets those; the worker reads what torchrun sets).
- every rank but 0 writes its stdout to stderr: the launcher merges the ranks' streams, and the
  coordinator reads rank 0's JSON lines, so only rank 0 may speak on stdout.

Usage: rankexec.py [--slurm] WORKER [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

# What srun sets for every task -> what the worker (and torch's env:// init) reads.
SLURM_TO_TORCH = (("SLURM_PROCID", "RANK"), ("SLURM_LOCALID", "LOCAL_RANK"), ("SLURM_NTASKS", "WORLD_SIZE"),
                  ("SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE"))


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A function that asks the kernel to SIGKILL the calling process when its parent dies, and
    exits at once if the parent (`parent_pid`) is already gone. libc is loaded here, before any
    fork, so the function may run as a subprocess preexec_fn, where the child should only call it."""
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return arm


def rank_env(env: dict[str, str], slurm: bool) -> dict[str, str]:
    """The worker's environment; raises KeyError naming a variable srun should have set."""
    out = dict(env)
    if slurm:
        for src, dst in SLURM_TO_TORCH:
            if src == "SLURM_NTASKS_PER_NODE" and src not in env:
                continue  # optional: the worker does not read LOCAL_WORLD_SIZE
            # SLURM_NTASKS_PER_NODE may read "2(x3)" on uneven allocations; the count comes first.
            out[dst] = env[src].split("(")[0]
    return out


def main(argv: list[str]) -> int:
    die_with_parent(os.getppid())()
    slurm = bool(argv) and argv[0] == "--slurm"
    rest = argv[1:] if slurm else argv
    if not rest:
        sys.stderr.write("usage: rankexec.py [--slurm] WORKER [ARGS...]\n")
        return 2
    try:
        env = rank_env(dict(os.environ), slurm)
    except KeyError as exc:
        sys.stderr.write(f"rankexec: {exc.args[0]} is not set (not started by srun?)\n")
        return 4
    if env.get("RANK", "0") != "0":
        os.dup2(2, 1)
    # Isolated (-I), as nccltune starts every Python: nothing of a working directory or PYTHONPATH.
    os.execve(sys.executable, [sys.executable, "-I", *rest], env)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
