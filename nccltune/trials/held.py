"""The processes root holds by a pidfd, and the one way it signals a process.

A pid is a number the kernel hands out again once the process that had it is reaped, and the rank
user, who may control its own processes (a rank can reap its children, any of its processes can
ptrace the rank server), decides when that happens to a rank. So root signals only processes it
holds a pidfd on, through that pidfd (pidfd_send_signal: it reaches the process it was opened on,
or nobody), and a process group only as the group of a leader it holds (`Held.signal_group`):

- its own children (`Child`, a Popen), held as they start: a child's pid stays its own until its
  parent, this process, reaps it, so the pidfd opened right after the fork is the child's;
- a rank the rank server forked (trials.forkedranks), held once it is seen to be the server's child;
- the processes found below one it holds (`below`), each held, then checked to be below it still;
- a rank left running by an earlier sweep (trials.runner.reap_leftover_ranks), held, then checked
  against its recorded start time.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
from typing import Any

from ..hw.procfs import parent_pid, parent_pids


class Held:
    """One process held by a pidfd (`pid` is what it had when it was opened, for messages and as
    its group's id)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._fd = pidfd

    @classmethod
    def open(cls, pid: int) -> Held | None:
        """The process that has `pid` now, held; None when there is none (or pid is not one)."""
        if pid <= 0:
            return None
        try:
            return cls(pid, os.pidfd_open(pid))
        except OSError:
            return None

    def exists(self) -> bool:
        """Not reaped yet (a zombie still exists): its pid is still its own."""
        if self._fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self._fd, 0)
        except PermissionError:
            return True  # there, and not ours to signal
        except OSError:
            return False
        return True

    def ended(self) -> bool:
        """It has exited (reaped or not): its pidfd reads as ready."""
        if self._fd < 0:
            return True
        readable, _, _ = select.select([self._fd], [], [], 0)
        return bool(readable)

    def signal(self, signum: int) -> bool:
        """Send `signum` to the process itself; False when it is gone (or was never ours to signal)."""
        if self._fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self._fd, signum)
        except OSError:
            return False
        return True

    def signal_group(self, signum: int) -> bool:
        """Send `signum` to the process group this process leads (its id is the leader's pid);
        False, and nothing sent, once the leader is reaped.

        Safe because the leader is checked, through its pidfd, to be not reaped yet: until then its
        pid is its own and no other process can have it, so no other group can carry that id. The
        check and the signal are two calls; between them the leader could be reaped and its pid
        handed to a new group leader only if the kernel handed out every other free pid first (it
        hands pids out in turn, up to pid_max). Once the leader is reaped, members of its group
        may remain, but from here they cannot be told from a group that got the id later: they
        are not signalled."""
        if not self.exists():
            return False
        try:
            os.killpg(self.pid, signum)
        except OSError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the group it leads (while that is safe, see signal_group) and the process itself
        (one that leads no group of its own is ended too)."""
        self.signal_group(signal.SIGKILL)
        self.signal(signal.SIGKILL)

    def close(self) -> None:
        """Let go of the pidfd; signals go nowhere after this."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class Child(subprocess.Popen[bytes]):
    """A process this one starts (the Popen arguments), held by a pidfd from its start; every
    signal Popen sends goes through it, and `kill_group` ends its process group as well."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Not reaped yet (nothing has waited on it): the pid is the child's.
        held = Held.open(self.pid)
        if held is None:  # pragma: no cover - pidfd_open fails only without the system call (Linux < 5.3)
            self.kill()
            raise OSError(f"cannot hold process {self.pid} by a pidfd")
        self.held = held

    def send_signal(self, sig: int) -> None:
        self.held.signal(sig)

    def kill_group(self) -> None:
        """SIGKILL the process and the group it leads (start it with start_new_session)."""
        self.held.kill()


def below(top: Held) -> list[Held]:
    """Every process below `top` in the process tree, each held by a pidfd, and each checked after
    it was opened to be the child of a process held here: the pidfd is opened on whatever process
    has the pid now, its parent read, and then both must still be unreaped, so the parent read was
    that process's own and the parent's pid was its own. A process whose parent died meanwhile
    (reparented) is not below `top` any more, and is left out."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_pids().items():
        children.setdefault(ppid, []).append(pid)
    held = {top.pid: top}
    out: list[Held] = []
    todo = [top]
    while todo:
        parent = todo.pop()
        for pid in children.get(parent.pid, ()):
            if pid in held:
                continue
            found = Held.open(pid)
            if found is None:
                continue
            if parent_pid(pid) == parent.pid and found.exists() and parent.exists():
                held[pid] = found
                out.append(found)
                todo.append(found)
            else:
                found.close()
    return out
