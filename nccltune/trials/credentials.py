"""Who the benchmark ranks run as: an unprivileged user that root names in the config (`bench.user`).

nccltune runs as root (it publishes root-owned files), but the processes a trial starts run code it
did not write: torch, NCCL and whatever NCCL loads. Run by root, they run as `bench.user` (default
the system user `nccltune`, which `nccltune install` creates) with:
- that user's uid, gid and own supplementary groups only (the groups owning /dev/nvidia* among
  them), none of root's; with every uid changed the kernel clears all capabilities;
- no_new_privs: exec gains nothing from set-user-ID binaries or file capabilities;
- an environment without root's identity or secrets (`rank_env`);
- a working directory of their own per trial (`RANK_DIR` in the trial directory, made by root and
  given to the user) and a cache directory for CUDA's JIT kernels shared by a sweep's trials. The
  trial directory around it stays root's: the ranks' stdout and stderr are files root opened there.

srun is the exception among the processes: Slurm starts a step only for the allocation's owner,
so srun runs as the caller and each of its tasks switches itself (rankexec --user). Not run by
root, the ranks run as the caller, unchanged.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .rankexec import become, die_with_parent

log = logging.getLogger(__name__)

USER_KEY = "bench.user"
DEFAULT_USER = "nccltune"
RANK_DIR = "rank"  # in a trial directory: the ranks' working directory, theirs to write
CACHE_DIR = "rank-cache"  # in a runner's work directory: XDG_CACHE_HOME and CUDA_CACHE_PATH of the ranks

# Root's identity and the sockets and descriptors of its session or service: none is the ranks'.
IDENTITY_VARS = frozenset({
    "HOME", "USER", "LOGNAME", "SHELL", "MAIL", "PWD", "OLDPWD", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME",
    "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME", "CUDA_CACHE_PATH", "DBUS_SESSION_BUS_ADDRESS",
    "XAUTHORITY", "KRB5CCNAME", "NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "LISTEN_FDS",
    "LISTEN_PID", "LISTEN_FDNAMES", "CREDENTIALS_DIRECTORY", "MAINPID", "MANAGERPID",
})
IDENTITY_PREFIXES = ("SSH_", "SUDO_", "GPG_", "GNUPG")
# Parts of a variable's name that mark a secret (AWS_SECRET_ACCESS_KEY, GITHUB_TOKEN, ...).
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE", "API_KEY", "ACCESS_KEY")

_warned: set[str] = set()


@dataclass(frozen=True)
class RankUser:
    """The user the ranks run as: its name, uid, gid and every group it is a member of."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def rank_user(configured: str | None) -> RankUser | None:
    """The user the ranks run as; None when they run as the caller (nccltune is not root, or
    `bench.user` is unset and the default user does not exist: then a warning says so, once).

    Raises:
        InputError: the configured user does not exist, or is root (exit 78).
    """
    if os.geteuid() != 0:
        return None
    name = configured or DEFAULT_USER
    try:
        entry = pwd.getpwnam(name)
    except (KeyError, ValueError):  # ValueError: a NUL in the name
        if configured is not None:
            raise InputError(USER_KEY, f"no user {name!r} on this node to run the benchmark ranks as",
                             hint=f"`nccltune install` creates the system user {DEFAULT_USER}; or create "
                                  f"{name} with `useradd --system --no-create-home --shell /usr/sbin/nologin "
                                  f"{name}`") from None
        if name not in _warned:
            _warned.add(name)
            log.warning("the benchmark ranks run as root: there is no user %s (bench.user unset); "
                        "`nccltune install` creates it", name)
        return None
    if entry.pw_uid == 0:
        raise InputError(USER_KEY, f"{name!r} is root (uid 0): the benchmark ranks run as an unprivileged user",
                         hint=f"leave {USER_KEY} unset for the system user {DEFAULT_USER}")
    groups = tuple(sorted(set(os.getgrouplist(name, entry.pw_gid))))
    return RankUser(name, entry.pw_uid, entry.pw_gid, groups)


def rank_preexec(parent_pid: int, user: RankUser | None) -> Callable[[], None]:
    """The ranks' preexec_fn: become the rank user (rankexec.become, the one switch, also for
    srun's tasks), then die with `parent_pid` (rankexec.die_with_parent; the switch clears the
    parent-death signal, so it is armed after it)."""
    arm = die_with_parent(parent_pid)
    if user is None:
        return arm

    def preexec() -> None:
        become(user.uid, user.gid, user.groups)
        arm()

    return preexec


def rank_env(env: Mapping[str, str], user: RankUser | None, home: Path, cache: Path) -> dict[str, str]:
    """The ranks' environment: `env` as it is for the caller's own ranks; for a rank user without
    root's identity, sockets and secrets, with its own HOME (the trial's rank directory) and caches."""
    if user is None:
        return dict(env)
    out = {k: v for k, v in env.items()
           if k not in IDENTITY_VARS and not k.startswith(IDENTITY_PREFIXES)
           and not any(word in k.upper() for word in SECRET_WORDS)}
    out.update(HOME=str(home), USER=user.name, LOGNAME=user.name, XDG_CACHE_HOME=str(cache),
               CUDA_CACHE_PATH=str(cache / "cuda"))
    return out


def _give(path: Path, user: RankUser | None) -> None:
    """`path`, a directory root just made or found in a directory only root writes, to `user`
    (mode first: once given away, changing it would need CAP_FOWNER)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o755)
        if user is not None:
            os.fchown(fd, user.uid, user.gid)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a rank directory an earlier run left. Its directories are the rank user's: root takes
    them back first (CAP_CHOWN; the units keep no CAP_DAC_OVERRIDE to write into them), then
    removes the tree by descriptor, never following a link the ranks left inside."""
    if os.geteuid() == 0:
        for _root, _dirs, _files, dirfd in os.fwalk(path, follow_symlinks=False):
            os.fchown(dirfd, 0, 0)
            os.fchmod(dirfd, 0o700)
    shutil.rmtree(path)


def fresh_rank_dir(trial_dir: Path, user: RankUser | None) -> Path:
    """The trial's rank directory, empty (an earlier run's is removed) and the rank user's.
    `trial_dir` is root's (or the caller's) own, so nobody else can put anything in its place."""
    path = trial_dir / RANK_DIR
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            _remove(path)
        else:
            os.unlink(path)
        os.mkdir(path, 0o755)
    _give(path, user)
    return path


def cache_dir(work_dir: Path, user: RankUser | None) -> Path:
    """The ranks' cache directory in `work_dir` (kept between trials: CUDA JIT-compiles a kernel
    once per sweep, not once per rank), the rank user's."""
    path = work_dir / CACHE_DIR
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            os.mkdir(path, 0o755)
    _give(path, user)
    return path


def check_reachable(python: str, files: Sequence[Path], user: RankUser | None) -> None:
    """Refuse, before any trial, an interpreter or worker file the rank user cannot use: every
    rank would fail the same way. Runs the interpreter as that user (isolated, no site) and opens
    the files with it.

    Raises:
        InputError: the rank user cannot run the interpreter or read a file (exit 78).
    """
    if user is None:
        return
    code = "import sys\nfor p in sys.argv[1:]: open(p, 'rb').close()"
    try:
        done = subprocess.run([python, "-I", "-S", "-c", code, *map(str, files)], capture_output=True, text=True,
                              timeout=120, cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                              stdin=subprocess.DEVNULL, preexec_fn=rank_preexec(os.getpid(), user))
    except subprocess.SubprocessError as exc:  # the switch itself failed (in preexec_fn)
        raise InputError(USER_KEY, f"cannot switch to user {user.name} to run the ranks ({exc})",
                         hint="the service needs CAP_SETUID and CAP_SETGID (systemd/nccltune.service)") from exc
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.EACCES:
            why += " (a directory on its way is closed to that user)"
        raise InputError(USER_KEY, f"user {user.name} cannot run the worker interpreter {python}: {why}",
                         hint="install the interpreter and torch where every user may read them (not under "
                              "/root), and name it in bench.python") from exc
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise InputError(USER_KEY, f"user {user.name} cannot run the worker with {python}: {tail[:300]}",
                         hint="install the interpreter, torch and nccltune where every user may read them "
                              "(not under /root), and name the interpreter in bench.python")
