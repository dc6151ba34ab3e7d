"""One sweep at a time: an flock on `<state_dir>/sweep.lock` holding the owner's pid.

The lock file lives in a directory root may have to share with nobody, so it is opened the safe
way (``nccltune.files.trust``): the state directory is created 0755 and must be owned by root or the
user running nccltune and writable by nobody else; the lock file is opened with O_NOFOLLOW and
O_CLOEXEC and must be a regular file of a trusted owner. A symlink planted at the lock's name is
refused (exit 78), never followed and truncated.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType

from ..errors import BusyError
from . import trust
from .atomicfile import FileError


class SweepLock:
    """Non-blocking exclusive lock. Raises BusyError (exit 75) naming the holder's pid.

    Raises on acquire:
        InputError: the state directory or the lock file may not be trusted (exit 78).
        FileError: the OS refused (disk full, read-only, permission), exit 1.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            trust.ensure_dir(self.path.parent, "state directory")
        except OSError as exc:
            raise FileError(self.path, exc, action=f"cannot open the sweep lock (cannot create {self.path.parent})"
                            ) from exc
        try:
            fd = trust.open_file(self.path, os.O_RDWR | os.O_CREAT, "lock file", 0o644)
        except OSError as exc:
            raise FileError(self.path, exc, action="cannot open the sweep lock") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise BusyError(f"another sweep is running (pid {holder}, lock {self.path})") from exc
            raise FileError(self.path, exc, action="cannot lock") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise FileError(self.path, exc, action="cannot record the lock holder") from exc
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass  # a full disk must not keep the lock: closing drops it
            finally:
                os.close(self._fd)  # closing drops the flock
                self._fd = None

    def __enter__(self) -> SweepLock:
        self.acquire()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def is_held(path: Path) -> bool:
    """True when a live process holds the lock at ``path`` (a run recorded as running while it is
    free was killed). Opens nothing through a symlink and creates nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | trust.NOFOLLOW | trust.CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
