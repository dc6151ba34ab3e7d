"""Atomic file replacement, the ground floor under everything nccltune writes.

A file is written to a temp file in the same directory (``.<name>.tmp-<pid>-<random>``, opened
O_EXCL|O_NOFOLLOW|O_CLOEXEC, mode 0600 until complete), fsync'ed, chmod'ed, renamed over the
target, and the directory is fsync'ed: a reader sees the old file or the new one, never a torn
one, and a write never goes through a symlink planted at the temp name. A rename replaces a
symlink at the target rather than following it. OS failures become FileError (exit 1; disk full is
not bad input), naming the path, the OS error and what to do.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import NoReturn

from ..errors import EXIT_CHECK_FAILED, NccltuneError

log = logging.getLogger(__name__)

# A temp file is named ".<target>.tmp-<pid>-<random>" so that a crashed writer's leftover is
# recognisable, never matches what a launcher reads, and can be cleaned up by the next writer.
TEMP_INFIX = ".tmp-"
_TEMP_INFIX = TEMP_INFIX
STALE_TEMP_GLOB = ".nccl*" + TEMP_INFIX + "*"
_STALE_TEMP_GLOB = STALE_TEMP_GLOB
# A live writer holds its temp file for milliseconds; an hour-old one belongs to a dead writer.
STALE_TEMP_AGE_S = 3600.0
_TEMP_NAME_ATTEMPTS = 16


class FileError(NccltuneError):
    """Writing (or reading) a file failed at the OS level: disk full, permission denied, read-only
    filesystem.

    Exit code 1 ("check failed"): the contract (DESIGN.md section 3) has no separate code for I/O
    failure, it is not bad input (78) and not a missing GPU (69); 1 is the documented generic
    failure. The message names the path and the OS error; ``errno`` keeps the number for callers
    that want to react to, say, ENOSPC.
    """

    exit_code = EXIT_CHECK_FAILED

    def __init__(
        self, path: Path | str, exc: OSError, *, action: str = "cannot write", extra: str | None = None
    ) -> None:
        code = exc.errno
        reason = exc.strerror or str(exc)
        name = errno.errorcode.get(code, "") if code is not None else ""
        detail = f"{reason} ({name})" if name else reason
        if extra:
            detail = f"{detail}; {extra}"
        hints = {
            errno.EACCES: "run as a user allowed to write there, or choose another path (--state-dir)",
            errno.EPERM: "run as a user allowed to write there, or choose another path (--state-dir)",
            errno.EROFS: "the filesystem is mounted read-only; choose another path (--state-dir)",
            errno.ENOSPC: "free space on that filesystem and re-run",
            errno.EDQUOT: "the disk quota is exhausted; free space and re-run",
        }
        super().__init__(f"{path}: {action}: {detail}", hint=hints.get(code) if code is not None else None)
        self.path = str(path)
        self.errno = code



def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TEMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}")


def remove_quietly(path: Path) -> None:
    """Remove a file, link or directory tree without following a link; a failure is logged, not
    raised (what is being removed is a leftover, and the caller's own error matters more)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def fail_without_temp(tmp: Path, path: Path, exc: BaseException) -> NoReturn:
    """Remove the temp file, then re-raise: an OSError as FileError naming the target, anything
    else (KeyboardInterrupt mid-write) as it is. The target itself is never touched."""
    remove_quietly(tmp)
    if isinstance(exc, OSError):
        raise FileError(path, exc) from exc
    raise exc


def write_temp(path: Path, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> Path:
    """Write ``data`` to a new temp file next to ``path``, durably, with ``mode``; return its path.

    On any failure the temp file is removed and ``path`` is not touched.

    Raises:
        FileError: the OS refused (ENOSPC, EACCES, EROFS, ...).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(_TEMP_NAME_ATTEMPTS):
        tmp = temp_path(path)
        try:
            # 0o600 until the content is complete: nobody should read a half-written file.
            fd = os.open(tmp, flags, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise FileError(path, exc, action="cannot create a temporary file next to it") from exc
        break
    else:
        raise FileError(path, FileExistsError(errno.EEXIST, "no free temporary file name"))
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if owner is not None:
                _chown_if_possible(fd, owner)
            # fchmod ignores the umask, so the mode is exactly `mode`; done before fsync so that the
            # mode is durable together with the data.
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        fail_without_temp(tmp, path, exc)
    return tmp


def _chown_if_possible(fd: int, owner: tuple[int, int]) -> None:
    """Keep a replaced file's owner and group; only root may give a file away, others keep theirs."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == owner:
        return
    try:
        os.fchown(fd, *owner)
    except PermissionError:
        log.debug("cannot keep owner %d:%d; the replaced file belongs to the writer", *owner)


def fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable.

    Raises:
        FileError: the directory cannot be synced (the new files are in place but may not
            survive a crash).
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise FileError(directory, exc, action="cannot open directory to sync it") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems cannot fsync a directory at all; that is no failure of ours.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise FileError(directory, exc, action="cannot sync directory") from exc
    finally:
        os.close(fd)


def atomic_write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new one.

    Temp file ``.<name>.tmp-<pid>-<random>`` in the same directory; write, fchmod to ``mode``,
    fsync, rename over ``path``, fsync the directory. A replaced symlink is replaced, not followed.

    Raises:
        FileError: the OS refused; the temp file is removed and ``path`` is untouched (unless
            only the final directory sync failed, which the message says).
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    replace_file(path, payload, mode)


def replace_file(path: Path, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    tmp = write_temp(path, data, mode, owner)
    try:
        os.replace(tmp, path)
    except BaseException as exc:
        fail_without_temp(tmp, path, exc)
    fsync_dir(path.parent)


def clean_stale_temps(
    directory: Path, pattern: str = _STALE_TEMP_GLOB, *, now: float | None = None
) -> list[Path]:
    """Remove temp files left by dead writers: names matching ``pattern``, older than an hour.

    Younger ones may belong to a writer that is still running, so they stay. Returns what was
    removed; failures to remove are logged, never raised (cleanup must not block a publish).
    """
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        log.warning("cannot list %s for stale temporary files: %s", directory, exc)
        return removed
    for entry in entries:
        if not fnmatch.fnmatchcase(entry.name, pattern):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_TEMP_AGE_S:
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove stale temporary file %s: %s", entry.path, exc)
            continue
        log.info("removed stale temporary file %s left by an interrupted writer", entry.path)
        removed.append(Path(entry.path))
    return removed
