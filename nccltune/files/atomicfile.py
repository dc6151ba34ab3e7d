"""Atomic file replacement, the ground floor under everything nccltune writes.

A file is written to a temp file in the same directory (``.<name>.tmp-<pid>-<random>``, opened
O_EXCL|O_NOFOLLOW|O_CLOEXEC, mode 0600 until complete), fsync'ed, chmod'ed, renamed over the
target, and the directory is fsync'ed: a reader sees the old file or the new one, never a torn
one, and a write never goes through a symlink planted at the temp name. A rename replaces a
symlink at the target rather than following it. OS failures become FileError (exit 1; disk full is
not bad input), naming the path, the OS error and what to do. A document too large to hold in
memory is written the same way through a file object (``atomic_stream``).

The writer's pid is in the temp name, so what a killed writer left is known as such:
``remove_dead_temps`` removes, in a directory of ours, the temp files whose writer is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NoReturn

from ..errors import EXIT_CHECK_FAILED, NccltuneError

log = logging.getLogger(__name__)

# A temp file is named ".<target>.tmp-<pid>-<random>" so that a crashed writer's leftover is
# recognisable, never matches what a launcher reads, and can be cleaned up by the next writer.
TEMP_INFIX = ".tmp-"
_TEMP_INFIX = TEMP_INFIX
# A live writer holds its temp file for milliseconds; an hour-old one belongs to a dead writer,
# even where its pid has been given to another process since.
STALE_TEMP_AGE_S = 3600.0
_TEMP_NAME_ATTEMPTS = 16
# nccltune's temp names, whoever wrote them: a file's ".<name>.tmp-<pid>-<8 hex>" (temp_path), a
# link's ".link.<name>.tmp-..." and a generation being built ".<N>.tmp-..." (publish.generations).
TEMP_NAME_RE = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>[0-9]{1,10})-[0-9a-f]{8}$")
# Above the kernel's largest pid (PID_MAX_LIMIT, 2^22): no such process, so no live writer.
_MAX_PID = 1 << 22


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
    """A fresh temp name next to ``path``, with this process's pid in it (TEMP_NAME_RE)."""
    return path.with_name(f".{path.name}{_TEMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}")


def create_temp(path: Path, mode: int = 0o600) -> tuple[int, Path]:
    """A new temp file next to ``path``, opened for writing (O_EXCL, O_NOFOLLOW, O_CLOEXEC) with
    ``mode``: its descriptor and its path.

    Raises:
        FileError: the OS refused, or no free name was found.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(_TEMP_NAME_ATTEMPTS):
        tmp = temp_path(path)
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise FileError(path, exc, action="cannot create a temporary file next to it") from exc
    raise FileError(path, FileExistsError(errno.EEXIST, "no free temporary file name"))


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
    # 0o600 until the content is complete: nobody should read a half-written file.
    fd, tmp = create_temp(path)
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


@contextmanager
def atomic_stream(path: Path, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Replace ``path`` with what the block writes to the file object it is given, atomically, as
    atomic_write does: a temp file next to it, fchmod to ``mode``, fsync, rename, directory fsync,
    when the block ends; if it raises, the temp file is removed and ``path`` is untouched.

    Raises:
        FileError: the OS refused (the block's own exceptions pass as they are).
    """
    path = Path(path)
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 16) as out:
            yield out
            out.flush()
            os.fchmod(out.fileno(), mode)
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        fail_without_temp(tmp, path, exc)
    fsync_dir(path.parent)


def temp_writer(name: str) -> int | None:
    """The pid of the process that made the temp file ``name`` (TEMP_NAME_RE), or None when the
    name is no temp name of nccltune's."""
    m = TEMP_NAME_RE.match(name)
    return int(m["pid"]) if m else None


def _writer_alive(pid: int) -> bool:
    """Whether the process ``pid`` (a writer's, from its temp name) exists: this process, or any
    process the kernel knows by that pid (another user's answers EPERM)."""
    if pid == os.getpid():
        return True
    if not 0 < pid <= _MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(fd: int) -> bool:
    """An opened directory that is this user's (root's, for the service) and writable by nobody
    else: only there may a temp name be taken for one of ours (anywhere else it may be planted)."""
    st = os.fstat(fd)
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _remove_flat_dir(parent: int, name: str) -> None:
    """Remove the directory ``name`` of the directory open as ``parent`` (a generation a killed
    publisher was building: files only), by descriptor, never following a link in it.

    Raises:
        OSError: it cannot be opened, holds a directory (ENOTEMPTY), or an entry cannot go.
    """
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        with os.scandir(fd) as entries:
            inside = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for entry, is_dir in inside:
            if is_dir:
                raise OSError(errno.ENOTEMPTY, f"holds a directory ({entry})")
            os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def remove_dead_temps(directory: Path, targets: Collection[str] | None = None, *,
                      now: float | None = None) -> list[Path]:
    """Remove the temp files and temp links that writers killed mid-write left in ``directory``
    (and a generation a killed publisher was building, a directory of files): only nccltune's own
    temp names (TEMP_NAME_RE; of ``targets`` alone when given, for a directory shared with other
    programs), only in a directory that is ours (owned by this user, writable by nobody else),
    never through a link (the directory opened O_NOFOLLOW, each entry looked at and removed
    through that descriptor; a temp link is removed, not followed).
    A temp whose writer (the pid in its name) is gone is removed at once; one whose pid runs only
    when older than STALE_TEMP_AGE_S (the pid taken by another process since). Writers on one
    node share a pid namespace (the Kubernetes DaemonSet runs with hostPID).

    Returns what was removed; nothing is raised (a failure is logged: cleaning up must not stop
    the start it is part of).
    """
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return removed
    except OSError as exc:
        log.warning("cannot open %s to look for temporary files of killed writers: %s", directory, exc)
        return removed
    try:
        if not _ours(fd):
            log.debug("not looking for temporary files in %s: another user owns it or may write to it", directory)
            return removed
        with os.scandir(fd) as entries:
            names = [e.name for e in entries]
        for name in names:
            m = TEMP_NAME_RE.match(name)
            if m is None or (targets is not None and m["target"] not in targets):
                continue
            try:
                st = os.lstat(name, dir_fd=fd)
            except OSError:
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                continue
            if _writer_alive(int(m["pid"])) and now - st.st_mtime < STALE_TEMP_AGE_S:
                continue
            try:
                if stat.S_ISDIR(st.st_mode):
                    _remove_flat_dir(fd, name)
                else:
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("cannot remove %s, left by a killed writer: %s", Path(directory) / name, exc)
                continue
            log.info("removed %s, left by a writer killed mid-write", Path(directory) / name)
            removed.append(Path(directory) / name)
    finally:
        os.close(fd)
    return removed
