"""May this process (often root) trust a path? One rule for everything nccltune reads as
configuration, runs, or writes in: the config file, the worker interpreter, the topology
snapshot, class profiles, the lock, the store, the publisher, ``nccltune env``/``exec`` and the
doctor.

nccltune runs as root and writes what every job sources, so nothing it reads, runs or writes may
be changeable by anyone else: otherwise an unprivileged user could plant a symlink (root would
write through it), swap a directory on the way to a file root trusts, or edit what jobs run. The
rule holds for the whole chain from ``/`` to the final target, resolved as the kernel resolves it,
one component and one link at a time (a link's target is walked the same way, so the directories
holding link targets are checked too):

- every directory, every symlink and the final target are owned by root or the effective user
  running nccltune (a link's own owner counts: a link in a sticky directory belongs to whoever
  made it);
- neither group nor others may write a directory or the target. A sticky directory on the way
  (``/tmp``) is accepted, because others can neither rename nor remove what root or nccltune owns
  in it; it never makes a name in it trusted (that name's owner is checked), and it is refused as
  the final directory, where others could still create the names nccltune is about to open;
- files nccltune writes are opened without following a symlink (O_NOFOLLOW), nothing is
  inherited by children (O_CLOEXEC).

One walk does it (``walk_trusted``), on the path as it was given (a flag, the config, a default),
never on a string resolved beforehand, which would hide the links on its way. A path that does not
exist yet (a state directory, a metrics directory, a file about to be written) is walked as far
as it exists, and refused before anything is created; ``ensure_dir`` then creates the rest one
directory at a time, each checked as it appears. Every other function here is a use of that walk:
``check_dir``, ``ensure_dir``, ``trusted_file``, ``check_file`` and ``trusted_target`` (a file
about to be written or replaced).

Directories nccltune creates get mode 0755 whatever the umask. A violation is an InputError
(exit 78) that names the path, the offending component, its owner uid and its mode.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from ..errors import InputError

log = logging.getLogger(__name__)

DIR_MODE = 0o755
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# The kernel's own bound on links followed in one path (MAXSYMLINKS).
MAX_LINKS = 40
HINT = ("make it owned by root (or the user running nccltune) and writable by nobody else, "
        "e.g. chown root: PATH && chmod go-w PATH")


def trusted_uids() -> tuple[int, ...]:
    """Owners whose files this process may trust: root and itself."""
    return (0, os.geteuid())


def problem(st: os.stat_result, *, on_the_way: bool = False) -> str | None:
    """Why a file, directory or symlink with this (l)stat may not be trusted, or None when it may.

    ``on_the_way``: a directory passed through rather than used; a sticky one may then be
    writable by others (see the module's rule). A symlink's mode means nothing: only its owner.
    """
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in trusted_uids():
        return f"owned by uid {st.st_uid}, not by root or uid {os.geteuid()} (mode {mode:04o})"
    if stat.S_ISLNK(st.st_mode) or (on_the_way and stat.S_ISDIR(st.st_mode) and mode & stat.S_ISVTX):
        return None
    word = writable_word(mode)
    return None if word is None else f"{word} (mode {mode:04o}, owner uid {st.st_uid})"


def writable_word(mode: int) -> str | None:
    """'world-writable', 'group-writable' or None for a permission mode: one wording everywhere."""
    if mode & stat.S_IWOTH:
        return "world-writable"
    if mode & stat.S_IWGRP:
        return "group-writable"
    return None


def _refuse(path: Path | str, what: str, why: str, component: str | None = None, *,
            leads: bool = False) -> InputError:
    """The refusal of ``path``: ``component`` is what failed (None or the path itself: the path),
    ``leads``: the component is where the path's links lead, not a directory on its way."""
    if component is None or component == str(path):
        where = "it is "
    elif leads:
        where = f"it leads to {component}, which is "
    else:
        where = f"{component} on its way is "
    return InputError(str(path), f"refusing the {what}: {where}{why}", hint=HINT)


def check_stat(path: Path | str, st: os.stat_result, what: str) -> None:
    """Raise InputError (exit 78) when ``st`` (of ``path``) may not be trusted."""
    why = problem(st)
    if why is not None:
        raise _refuse(path, what, why)


class Walk(NamedTuple):
    """Where a walk under the rule ended: the deepest component that exists, by its real path, with
    its lstat, and the names below it that do not exist yet (empty: the whole path exists)."""

    real: Path
    st: os.stat_result
    missing: tuple[str, ...]


def walk_trusted(path: Path | str, what: str, *, follow_last: bool = True, replace_last: bool = False) -> Walk:
    """THE walk: ``path`` from ``/`` as the kernel would resolve it, every component checked on
    the way: each directory, each symlink (its own owner) and, through every link, the directories
    its target names. The walk stops at the first name that does not exist: what exists so far
    has passed, and nothing has been created. With ``follow_last`` false a symlink as the last
    component is refused instead of followed (a file nccltune opens with O_NOFOLLOW). With
    ``replace_last`` the last name is not looked at: it is returned as missing, for a file that
    a rename will replace whatever is there (a link at the name replaced, never followed).

    A relative path starts at the working directory, whose own chain is walked too. A directory
    with names still below it, existing or not, is checked as one passed through (a sticky one
    passes); the target, when it exists, as the target (a sticky directory is refused there).

    Raises:
        InputError: a component may not be trusted, or the last one is a symlink not to be
            followed, or there are more than MAX_LINKS links (exit 78).
        OSError: a component cannot be read (the caller words it); NotADirectoryError when a
            component on the way is not a directory; FileNotFoundError when a link's target
            climbs (``..``) out of a directory that does not exist.
    """
    shown = str(path)
    pending = [p for p in os.path.abspath(os.fspath(path)).split("/") if p]
    current = "/"
    current_st = st = os.lstat(current)
    why = problem(st, on_the_way=bool(pending))
    if why is not None:
        raise _refuse(shown, what, why, current)
    links = 0
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)  # already resolved and checked
            current_st = os.lstat(current)
            continue
        if replace_last and not pending:
            return Walk(Path(current), current_st, (name,))
        candidate = os.path.join(current, name)
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            rest = [name, *(p for p in pending if p != ".")]
            if ".." in rest:
                raise
            return Walk(Path(current), current_st, tuple(rest))
        if stat.S_ISLNK(st.st_mode):
            why = problem(st)
            if why is not None:
                raise _refuse(shown, what, f"a symlink {why}", candidate)
            if not pending and not follow_last:
                raise InputError(shown, f"refusing the {what}: it is a symlink",
                                 hint="remove it; nccltune never opens its files through a link")
            links += 1
            if links > MAX_LINKS:
                raise InputError(shown, f"refusing the {what}: more than {MAX_LINKS} symlinks on its way")
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = "/"
                current_st = os.lstat(current)
            pending[:0] = [p for p in target.split("/") if p]
            continue
        if pending and not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), candidate)
        if not pending and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            # A device, FIFO or socket: the caller refuses it for what it is (/dev/null is 0666).
            return Walk(Path(candidate), st, ())
        why = problem(st, on_the_way=bool(pending))
        if why is not None:
            final = not pending
            raise _refuse(shown, what, why, None if final and not links else candidate, leads=final)
        current, current_st = candidate, st
    return Walk(Path(current), current_st, ())


def resolve_trusted(path: Path | str, what: str, *, follow_last: bool = True) -> tuple[Path, os.stat_result]:
    """``walk_trusted`` over a path that must exist: its final target's real path and lstat.

    Raises:
        InputError: a component may not be trusted (see walk_trusted; exit 78).
        OSError: a component is missing (FileNotFoundError naming it) or cannot be read.
    """
    real, st, missing = walk_trusted(path, what, follow_last=follow_last)
    if missing:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(real / missing[0]))
    return real, st


def trusted_file(path: Path | str, what: str) -> Path:
    """An existing regular file that will be read as configuration or run, its whole chain
    trusted (links followed, each checked). Returns its real path: open that, not ``path``.

    Raises:
        InputError: untrusted on the way, or not a regular file (exit 78).
        OSError: missing or unreadable (the caller words it).
    """
    real, st = resolve_trusted(path, what)
    if stat.S_ISDIR(st.st_mode):
        raise InputError(str(path), f"is a directory, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(str(path), f"is not a regular file (a device, FIFO or socket), not a {what}")
    return real


def check_dir(path: Path | str, what: str = "directory") -> None:
    """Refuse a directory that is not one, or not trusted along its whole chain (links followed).

    Raises:
        InputError: not a directory, or owned/writable by another user on the way (exit 78).
        OSError: it cannot be stat'ed (the caller words it).
    """
    _, st = resolve_trusted(path, what)
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(str(path), f"the {what} is not a directory")


def ensure_dir(path: Path | str, what: str = "directory") -> Path:
    """Create ``path`` (and missing parents) with mode 0755 whatever the umask, then check it.

    The path is walked first (``walk_trusted``): a component on its way that may not be trusted
    is refused before anything is created. The missing directories are then made one at a time
    at the real path the walk found, each checked as it appears (a name another user made first
    in a sticky directory, a directory or a link, is refused, and nothing is made below it).
    Only directories created here get their mode set; an existing one is checked, never changed.

    Raises:
        InputError: it exists but is not a directory, or a component may not be trusted (exit 78).
        OSError: it cannot be created (the caller words it: EACCES, EROFS, ENOSPC ...).
    """
    real, _, missing = walk_trusted(path, what)
    for name in missing:
        real = real / name
        try:
            os.mkdir(real, DIR_MODE)
        except FileExistsError:
            pass  # made since the walk, by whoever: checked below like any other
        else:
            # mkdir's mode is cut by the umask; chmod is not.
            os.chmod(real, DIR_MODE, follow_symlinks=False)
        st = os.lstat(real)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise InputError(str(path), f"refusing the {what}: {real} on its way appeared while it was being "
                             f"created, {kind} (owner uid {st.st_uid})", hint=f"remove {real}, then run again")
        why = problem(st, on_the_way=True)
        if why is not None:
            raise _refuse(path, what, why, str(real))
    check_dir(path, what)
    return Path(path)


def trusted_target(path: Path | str, what: str, *, follow_last: bool = True) -> Path:
    """Where a file nccltune is about to write (create or replace) at ``path`` lies, after the
    rule (``walk_trusted``, over the whole chain as far as it exists): its directory exists, and
    the real path to write is returned: write that, not ``path``.

    ``follow_last``: a symlink at the name is followed, each link checked, and its target is what
    is edited (an NCCL conf file kept by configuration management); the file, when it exists, is
    a regular file that passes, and its directory passes as the final directory (not a sticky
    one: the file is read and its mode and owner kept). False: the name is replaced by the rename
    of a temporary file made O_EXCL|O_NOFOLLOW (files/atomicfile.py), whatever is at the name (a
    link replaced, never followed), so only its directory's chain counts, the directory passed
    through like any other (a sticky one passes: no name in it is trusted or opened).

    Raises:
        InputError: a component or the file may not be trusted, or the file is not a regular
            file (exit 78).
        OSError: its directory does not exist (FileNotFoundError naming what is missing) or
            cannot be read.
    """
    real, st, missing = walk_trusted(path, what, replace_last=not follow_last)
    if len(missing) > 1:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(real / missing[0]))
    if not follow_last:
        if not missing:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(real))
        return real / missing[0]
    if missing:
        directory, target = real, real / missing[0]
    elif stat.S_ISDIR(st.st_mode):
        raise InputError(str(path), f"is a directory, not a {what}")
    elif not stat.S_ISREG(st.st_mode):
        raise InputError(str(path), f"refusing the {what}: it is not a regular file")
    else:
        directory, target = real.parent, real
        st = os.lstat(directory)
    why = problem(st)  # the directory the file is edited in: a sticky one is refused here
    if why is not None:
        raise _refuse(path, what, why, str(directory))
    return target


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
    """An existing file nccltune reads and writes in place: regular, not itself a link, trusted
    along its whole chain.

    Raises:
        InputError: a symlink, not a regular file, or not trusted on the way (exit 78).
        OSError: it cannot be stat'ed.
    """
    _, st = resolve_trusted(path, what, follow_last=False)
    if not stat.S_ISREG(st.st_mode):
        raise InputError(str(path), f"refusing the {what}: it is not a regular file")
    return st


# -- the Python interpreters nccltune starts -------------------------------------------------------

# Isolated mode for every Python nccltune starts (the worker, its probe, torchrun, a search for
# torch): no PYTHON* variables, no user site-packages, and neither the working directory nor any
# other path but the script's own directory (for `-c` and `-m`: none) on sys.path. A torch.py
# planted where root happens to stand is never imported.
PYTHON_ISOLATED = "-I"
# PATH for those children: system directories only, never the caller's (which may hold ".").
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def system_program(name: str, what: str, path: str | None = None) -> Path:
    """The program `name` as root runs it: looked up only on `path` (system directories,
    SAFE_PATH unless given; never the caller's PATH), its file and every directory and link on
    the way passing the trust rule. Returns the real path to run.

    Raises:
        FileNotFoundError: no such program on `path`.
        InputError: another user could change it (exit 78).
    """
    path = SAFE_PATH if path is None else path
    found = shutil.which(name, path=path)
    if found is None:
        raise FileNotFoundError(errno.ENOENT, f"{what}: no {name} in {path}")
    return trusted_file(found, what)


# What a child that only loads torch and NCCL keeps of nccltune's environment.
KEPT_PREFIXES = ("CUDA_", "NCCL_", "NVIDIA_")
KEPT_NAMES = ("LD_LIBRARY_PATH", "LANG", "LC_ALL", "TZ")


# Variables that make a Python started without -I (torchrun starts its workers so) import from
# elsewhere than its installation, and the settings that keep its own directory and the user's
# site-packages off its path: for every environment nccltune gives a Python child.
PYTHON_PATH_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONINSPECT",
                         "PYTHONEXECUTABLE", "PYTHONPLATLIBDIR")
PYTHON_SAFE_SETTINGS = {"PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1"}


def without_python_paths(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without PYTHON_PATH_VARIABLES, with PYTHON_SAFE_SETTINGS."""
    return {**{k: v for k, v in env.items() if k not in PYTHON_PATH_VARIABLES}, **PYTHON_SAFE_SETTINGS}


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment for a child interpreter that looks at torch and NCCL: a fixed PATH,
    the CUDA, NCCL and library-path variables of ``env`` (default: this process's), nothing else."""
    source = os.environ if env is None else env
    kept = {k: v for k, v in source.items() if k.startswith(KEPT_PREFIXES) or k in KEPT_NAMES}
    return {**kept, "PATH": SAFE_PATH, **PYTHON_SAFE_SETTINGS}


def python_argv(python: str, *args: str) -> list[str]:
    """The command line that runs ``python`` isolated with ``args`` (a script by absolute path,
    or ``-m MODULE`` / ``-c CODE``)."""
    return [python, PYTHON_ISOLATED, *args]
