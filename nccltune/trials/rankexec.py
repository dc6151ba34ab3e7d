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
- `--user NAME`, when it runs as root (srun's tasks in an allocation of root's): it becomes NAME
  first (`become`: that user's uid, gid and groups only, no capabilities, no_new_privs), as the
  runner's own ranks do (trials.credentials), with HOME, USER and LOGNAME its own.

Usage: rankexec.py [--slurm] [--user NAME] WORKER [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import pwd
import signal
import sys
from collections.abc import Callable, Sequence

# What srun sets for every task -> what the worker (and torch's env:// init) reads.
SLURM_TO_TORCH = (("SLURM_PROCID", "RANK"), ("SLURM_LOCALID", "LOCAL_RANK"), ("SLURM_NTASKS", "WORLD_SIZE"),
                  ("SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE"))


PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NO_NEW_PRIVS = 38
# Loaded at import, before any fork: `become` may run as a subprocess preexec_fn.
_LIBC = ctypes.CDLL(None, use_errno=True)


def become(uid: int, gid: int, groups: Sequence[int]) -> None:
    """Switch this process to `uid`, `gid` and `groups` alone (real, effective, saved and
    filesystem ids), then set no_new_privs. Run by root: with every uid changed from 0 the kernel
    clears all capabilities. The change clears the parent-death signal: arm it afterwards.

    Raises:
        OSError: a switch was refused (not root, or no CAP_SETUID/CAP_SETGID).
    """
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), "prctl(PR_SET_NO_NEW_PRIVS)")


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A function that asks the kernel to SIGKILL the calling process when its parent dies, and
    exits at once if the parent (`parent_pid`) is already gone. libc is loaded here, before any
    fork, so the function may run as a subprocess preexec_fn, where the child should only call it."""
    def arm() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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
    slurm = bool(argv) and argv[0] == "--slurm"
    rest = argv[1:] if slurm else argv
    user = rest[1] if rest[:1] == ["--user"] and len(rest) > 1 else None
    rest = rest[2:] if user is not None else rest
    if not rest:
        sys.stderr.write("usage: rankexec.py [--slurm] [--user NAME] WORKER [ARGS...]\n")
        return 2
    try:
        env = rank_env(dict(os.environ), slurm)
    except KeyError as exc:
        sys.stderr.write(f"rankexec: {exc.args[0]} is not set (not started by srun?)\n")
        return 4
    if user is not None and os.geteuid() == 0:
        try:
            entry = pwd.getpwnam(user)
            become(entry.pw_uid, entry.pw_gid, os.getgrouplist(user, entry.pw_gid))
        except (KeyError, OSError) as exc:
            sys.stderr.write(f"rankexec: cannot run as {user} (bench.user) on this node: {exc}\n")
            return 4
        env.update(HOME=os.getcwd(), USER=user, LOGNAME=user)
    die_with_parent(os.getppid())()
    if env.get("RANK", "0") != "0":
        os.dup2(2, 1)
    # Isolated (-I), as nccltune starts every Python: nothing of a working directory or PYTHONPATH.
    os.execve(sys.executable, [sys.executable, "-I", *rest], env)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
