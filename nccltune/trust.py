"""May this process (often root) trust a path? One rule for the lock, the store, the publisher,
``nccltune env``/``exec`` and the doctor.

nccltune runs as root and writes what every job sources, so a directory or file it uses must not
be changeable by anyone else: otherwise an unprivileged user could plant a symlink (root would
write through it) or edit what jobs run. The rule:

- the owner is root or the effective user running nccltune;
- neither group nor others may write it (a sticky bit does not help: others could still create
  the names nccltune is about to open);
- nothing is opened through a symlink (O_NOFOLLOW), nothing is inherited by children (O_CLOEXEC).

Directories nccltune creates get mode 0755 whatever the umask. A violation is an InputError
(exit 78) that names the path, its owner uid and its mode.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from .errors import InputError

log = logging.getLogger(__name__)

DIR_MODE = 0o755
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def trusted_uids() -> tuple[int, ...]:
    """Owners whose files this process may trust: root and itself."""
    return (0, os.geteuid())


def problem(st: os.stat_result) -> str | None:
    """Why a file or directory with this stat may not be trusted, or None when it may."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in trusted_uids():
        return f"owned by uid {st.st_uid}, not by root or uid {os.geteuid()} (mode {mode:04o})"
    if mode & stat.S_IWOTH:
        return f"world-writable (mode {mode:04o}, owner uid {st.st_uid})"
    if mode & stat.S_IWGRP:
        return f"group-writable (mode {mode:04o}, owner uid {st.st_uid})"
    return None


def writable_word(mode: int) -> str | None:
    """'world-writable', 'group-writable' or None for a permission mode: one wording everywhere."""
    if mode & stat.S_IWOTH:
        return "world-writable"
    if mode & stat.S_IWGRP:
        return "group-writable"
    return None


def _refuse(path: Path | str, what: str, why: str) -> InputError:
    return InputError(str(path), f"refusing the {what}: it is {why}",
                      hint="make it owned by root (or the user running nccltune) and writable by nobody else, "
                           "e.g. chown root: PATH && chmod go-w PATH")


def check_stat(path: Path | str, st: os.stat_result, what: str) -> None:
    """Raise InputError (exit 78) when ``st`` (of ``path``) may not be trusted."""
    why = problem(st)
    if why is not None:
        raise _refuse(path, what, why)


def check_dir(path: Path | str, what: str = "directory") -> None:
    """Refuse a directory that is a symlink's target we did not expect, not a directory, or not trusted.

    Raises:
        InputError: not a directory, or owned/writable by another user (exit 78).
        OSError: it cannot be stat'ed (the caller words it).
    """
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(str(path), f"the {what} is not a directory")
    check_stat(path, st, what)


def ensure_dir(path: Path | str, what: str = "directory") -> Path:
    """Create ``path`` (and missing parents) with mode 0755 whatever the umask, then check it.

    Only directories created here get their mode set; an existing one is checked, never changed.

    Raises:
        InputError: it exists but is not a directory or may not be trusted (exit 78).
        OSError: it cannot be created (the caller words it: EACCES, EROFS, ENOSPC ...).
    """
    path = Path(path)
    missing: list[Path] = []
    probe = path
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            continue
        # mkdir's mode is cut by the umask; chmod is not.
        os.chmod(directory, DIR_MODE, follow_symlinks=False)
    check_dir(path, what)
    return path


def open_file(path: Path | str, flags: int, what: str, mode: int = 0o644) -> int:
    """Open a file inside a trusted directory without following a symlink, and check it.

    Returns the descriptor (close-on-exec). With O_CREAT a new file gets exactly ``mode``.

    Raises:
        InputError: ``path`` is a symlink, not a regular file, or may not be trusted (exit 78).
        OSError: any other failure of open (the caller words it).
    """
    try:
        # O_NONBLOCK: opening a FIFO planted at the name must not wait for a writer.
        fd = os.open(path, flags | NOFOLLOW | CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(str(path), f"refusing the {what}: it is a symlink",
                             hint="remove it; nccltune never opens its files through a link") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(str(path), f"refusing the {what}: it is not a regular file")
        check_stat(path, st, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(path: Path | str, what: str = "file") -> os.stat_result:
    """lstat-based check of an existing file that will be read: regular, not a link, trusted.

    Raises:
        InputError: a symlink, not a regular file, or not trusted (exit 78).
        OSError: it cannot be stat'ed.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise InputError(str(path), f"refusing the {what}: it is a symlink")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(str(path), f"refusing the {what}: it is not a regular file")
    check_stat(path, st, what)
    return st
