"""The runner's side of the rank server (trials/rankserver.py): start it, have it fork ranks, watch them.

One server per runner (a sweep, a verify), started at the first rank that may be forked, as the
rank user and dying with the runner, like every rank. A forked rank (`ForkedRank`) is handled as
the runner handles the Popen of a rank it starts by exec: its pid, `poll`, `wait`, its process
group killed. The server runs as the rank user, so what it says is checked before root acts on
it: a pid it names must be a child of the server when the runner first sees it (/proc), and is
then held by a pidfd (trials.held), so that a signal never reaches another process that got the
pid later; a rank is over when its pidfd says so, whatever the server says: a rank the server
says has ended while it runs still runs, and one that ended without the server saying how
within EXIT_REPORT_S is over all the same (the server has failed); the server's messages are
bounded in size and in number per look, and their text is escaped (logsetup.escaped) wherever it
goes.

Anything that goes wrong with the server (torch fails to import, it dies, it answers nonsense)
is said once in the log and the runner starts its ranks by exec from then on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from ..files import trust
from ..files.inputfile import loads_strict
from ..hw.procfs import parent_pid
from ..logsetup import escaped
from . import rankserver
from .credentials import RankUser, rank_preexec
from .held import Child, Held

log = logging.getLogger(__name__)

SERVER = Path(rankserver.__file__)
REPLY_S = 30.0  # a fork and its answer; the server's own start waits for torch's import instead
DRAIN_MAX = 1024  # messages read at one look: a server that floods the socket cannot hold the runner
# From a rank's end (its pidfd) to the server's word on how it ended: the server waits on its
# children as each ends, so this is only a loaded machine's delay, and a server silent this long
# has failed. The runner's kill waits 10 s for a killed rank (Runner.kill), longer than this.
EXIT_REPORT_S = 5.0
# The exit status of a rank that ended without the server saying how: no status can be it
# (an exit status is 0-255, a signal negative).
UNREPORTED = 256


class ServerFailed(Exception):
    """The rank server cannot fork ranks (the message says why, escaped: its text may be the
    server's); start them by exec."""

    def __init__(self, why: str) -> None:
        super().__init__(escaped(why))


class ForkedRank:
    """One rank forked by the server, with what the runner uses of a Popen: pid, returncode,
    poll() and wait(); `held`, its pidfd."""

    def __init__(self, server: RankServer, held: Held) -> None:
        self.server = server
        self.held = held
        self.pid = held.pid
        self.returncode: int | None = None
        self.ended_at: float | None = None  # when its pidfd first said it had ended

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self)
            if self.returncode is not None:
                self.held.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(SERVER), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the process group it leads (the server makes each rank a session of its own),
        only while its pidfd says the rank is not reaped (Held.signal_group), and the process
        itself through its pidfd: a process the server failed to give a group of its own is
        ended too, and a pid the server reaped is never signalled, whoever has it now."""
        self.held.kill()

    def alive(self) -> bool:
        """The process still runs (its pidfd is not readable yet)."""
        return self.returncode is None and not self.held.ended()


class RankServer:
    """The rank server of one runner."""

    def __init__(self, python: str, env: Mapping[str, str], cwd: Path, user: RankUser | None, err: Path,
                 ready_s: float) -> None:
        """Start the server with `env` (rankserver.start_part of the first rank's), in `cwd` (a
        directory of the rank user's), its output to `err`, and wait up to `ready_s` for torch's import.

        Raises:
            ServerFailed: it did not come up.
        """
        self.env = rankserver.start_part(env)
        self.broken: str | None = None  # why the server may not be asked for anything more
        self._exits: dict[int, int] = {}
        self._forked: set[int] = set()  # the ranks it forked that have not ended yet
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | trust.NOFOLLOW | trust.CLOEXEC
        out = os.open(err, flags, 0o644)
        try:
            self._proc = Child(
                [*trust.python_argv(python, str(SERVER)), str(theirs.fileno())], env=self.env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=(theirs.fileno(),),
                start_new_session=True, cwd=cwd, preexec_fn=rank_preexec(os.getpid(), user))
        except OSError as exc:
            ours.close()
            raise ServerFailed(f"cannot start it: {exc.strerror}") from exc
        finally:
            os.close(out)
            theirs.close()
        try:
            reply = self._reply(ready_s, "ready")
        except ServerFailed:
            self.close()
            raise
        if reply.get("ready") != self._proc.pid:
            self.close()
            raise ServerFailed(f"it said {reply} when it should have said it was ready")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def fork(self, argv: list[str], env: Mapping[str, str], fds: tuple[int, int, int, int]) -> ForkedRank:
        """A rank running the worker with `argv` (its arguments) and `env`, `fds` its stdin, stdout,
        stderr and working directory (an open directory).

        Raises:
            ServerFailed: the server did not fork it.
        """
        request = json.dumps({"argv": argv, "env": dict(env)}).encode()
        try:
            socket.send_fds(self._sock, [request], list(fds))
        except OSError as exc:
            raise ServerFailed(f"it does not take requests: {exc}") from exc
        reply = self._reply(REPLY_S, "started")
        pid = reply.get("started")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise ServerFailed(f"it did not fork the rank: {reply.get('refused', reply)}")
        # Only a child of the server, held by a pidfd from then on: the server is the rank user's
        # and may not point root at anyone else's process.
        if parent_pid(pid) != self.pid:
            raise ServerFailed(f"pid {pid}, which it named, is not a rank of its own")
        held = Held.open(pid)
        if held is None:
            raise ServerFailed(f"pid {pid}, which it named, cannot be held: no such process")
        # Its parent read after the pidfd was opened, and the pidfd's process not reaped after
        # that: the parent read is that process's own (trials.held.below says why).
        if parent_pid(pid) != self.pid or not held.exists():
            held.close()
            raise ServerFailed(f"pid {pid}, which it named, is not a rank of its own")
        self._forked.add(pid)
        return ForkedRank(self, held)

    def exit_code(self, rank: ForkedRank) -> int | None:
        """The rank's exit status (negative: the signal) once its pidfd says it has ended, else
        None, whatever the server says. The status is the server's word; a rank of a server that
        died died with it (SIGKILL); a rank the server says nothing of within EXIT_REPORT_S of its
        end is UNREPORTED, and the server has failed."""
        try:
            self._drain()
        except ServerFailed as exc:
            self.fail(str(exc))
        if not rank.held.ended():
            return None
        if rank.pid in self._exits:
            self._forked.discard(rank.pid)
            return self._exits.pop(rank.pid)
        if self._proc.poll() is not None:
            return -signal.SIGKILL
        now = time.monotonic()
        rank.ended_at = rank.ended_at or now
        if now - rank.ended_at < EXIT_REPORT_S:
            return None
        self._forked.discard(rank.pid)
        self.fail(f"it did not say how rank {rank.pid} ended within {EXIT_REPORT_S:g} s")
        return UNREPORTED

    def close(self) -> None:
        """End the server (it exits when its socket closes; its ranks die with it)."""
        with contextlib.suppress(OSError):
            self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill_group()
            self._proc.wait(timeout=10)

    def fail(self, why: str) -> None:
        """Stop talking to a server that failed (`why`): it is ended, its ranks with it, and said so once."""
        if self.broken is None:
            self.broken = why
            log.warning("the rank server %d failed (%s): ending it; ranks start by exec from now on", self.pid,
                        escaped(why))
            with contextlib.suppress(OSError):
                self._sock.close()
            self._proc.kill_group()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)

    def _drain(self) -> None:
        if self.broken is not None:
            return
        for _ in range(DRAIN_MAX):
            doc = self._receive(0.0)
            if doc is None:
                return
            self._note(doc)

    def _note(self, doc: dict[str, object]) -> bool:
        """Record an exit message (of a rank it forked; others are not kept); False for anything else."""
        pid, code = doc.get("exited"), doc.get("code")
        if isinstance(pid, int) and isinstance(code, int):
            if pid in self._forked:
                self._exits[pid] = code
            return True
        return False

    def _reply(self, within_s: float, key: str) -> dict[str, object]:
        """The next message that is not an exit message (those are recorded on the way)."""
        deadline = time.monotonic() + within_s
        while True:
            left = deadline - time.monotonic()
            doc = self._receive(max(0.0, left))
            if doc is None:
                if self._proc.poll() is not None:
                    raise ServerFailed(f"it exited with status {self._proc.returncode}")
                if left <= 0:
                    raise ServerFailed(f"no {key!r} answer within {within_s:g} s")
                continue
            if "error" in doc:
                raise ServerFailed(str(doc["error"]))
            if not self._note(doc):
                return doc

    def _receive(self, timeout: float) -> dict[str, object] | None:
        """One message, or None when none came within `timeout` seconds.

        Raises:
            ServerFailed: the server closed its end, or sent something that is not a JSON object.
        """
        readable, _, _ = select.select([self._sock], [], [], min(timeout, 0.25))
        if not readable:
            return None
        try:
            data = self._sock.recv(rankserver.MAX_MESSAGE)
        except OSError as exc:
            raise ServerFailed(f"its socket failed: {exc}") from exc
        if not data:
            raise ServerFailed("it closed its socket")
        try:
            doc = loads_strict(data)
        except ValueError as exc:
            raise ServerFailed(f"it sent something that is not JSON: {data[:80]!r}") from exc
        if not isinstance(doc, dict):
            raise ServerFailed(f"it sent something that is not a JSON object: {data[:80]!r}")
        return doc
