"""One sweep at a time: an flock on `<state_dir>/sweep.lock` holding the owner's pid."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType

from .errors import BusyError, NccltuneError


class SweepLock:
    """Non-blocking exclusive lock. Raises BusyError (exit 75) naming the holder's pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise NccltuneError(f"{self.path}: cannot open the sweep lock: {exc.strerror}",
                                hint="is the state directory writable? (--state-dir)") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise BusyError(f"another sweep is running (pid {holder}, lock {self.path})") from exc
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)  # closing drops the flock
                self._fd = None

    def __enter__(self) -> SweepLock:
        self.acquire()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
