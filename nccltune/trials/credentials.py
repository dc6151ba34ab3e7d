"""Who the benchmark ranks run as: an unprivileged user that root names in the config (`bench.user`).

nccltune runs as root (it publishes root-owned files), but the processes a trial starts run code it
did not write: torch, NCCL and whatever NCCL loads. Run by root, they run as `bench.user` (default
the system user `nccltune`, which `nccltune install` creates) with:
- that user's uid, gid and own supplementary groups only (the groups owning /dev/nvidia* among
  them), none of root's; with every uid changed the kernel clears all capabilities;
- no_new_privs: exec gains nothing from set-user-ID binaries or file capabilities;
- an environment of what the worker, torch, CUDA and NCCL need (an allow-list, `rank_env`), none
  of root's identity, sessions or secrets;
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

# What of root's environment reaches ranks run as the rank user: an allow-list of what the worker,
# torch, CUDA, NCCL and the launchers need, so that nothing else of root's (a URL or a proxy with a
# password in it, a cloud or cluster credential under any name, a socket of its session) does.
# Each entry, and why it is there:
RANK_NAMES = frozenset({
    "PATH",  # the interpreter's and the launchers' look-ups (torchrun's agent, srun, nvidia-smi, a compiler)
    "LANG", "LANGUAGE",  # the locale: how text is decoded and messages are written (with LC_*)
    "TMPDIR",  # where torch, CUDA and the compilers put temporary files, as the site set it
    "LD_LIBRARY_PATH",  # a site's NCCL, CUDA and network-plugin libraries outside the loader's paths
    "OMP_NUM_THREADS",  # torch's CPU threads (the trial sets one unless the caller chose)
    "PYTHONUNBUFFERED",  # the worker's output line by line, as the runner reads it
    # The rank and the rendezvous, where a launcher sets them before the ranks start.
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})
RANK_PREFIXES = (
    "LC_",  # the locale's categories
    "NCCL_",  # what is measured: NCCL's variables (and its plugins' NCCL_* ones)
    "TORCH_",  # torch's settings: its NCCL ones (TORCH_NCCL_*) measured too, TORCH_CPP_LOG_LEVEL, ...
    "NCCLTUNE_",  # the tuner plugin's table and fingerprint, the worker's test hooks
    "GLOO_",  # the CPU demo's gloo backend (GLOO_SOCKET_IFNAME)
    "CUDA_",  # the GPUs the ranks see and CUDA's settings (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, ...)
    "NVIDIA_",  # the container runtime's GPU selection and driver capabilities
    "FI_", "OFI_NCCL_",  # libfabric and the aws-ofi-nccl network plugin (FI_PROVIDER, FI_EFA_*)
    "UCX_", "SHARP_COLL_",  # the UCX and SHARP network plugins
    "RDMAV_", "IBV_",  # libibverbs (RDMAV_FORK_SAFE, IBV_FORK_SAFE)
    "SLURM_", "SRUN_",  # srun's allocation and step (SLURM_JOB_ID, ...) and its own input (SRUN_CPUS_PER_TASK)
)
# Set for the rank user by rank_env itself, whatever root's were.
RANK_IDENTITY = ("HOME", "USER", "LOGNAME", "XDG_CACHE_HOME", "CUDA_CACHE_PATH")


def rank_may_get(name: str) -> bool:
    """Whether a variable of root's environment is one the ranks get (RANK_NAMES, RANK_PREFIXES)."""
    return name in RANK_NAMES or name.startswith(RANK_PREFIXES)


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
    """The ranks' environment: `env` as it is for the caller's own ranks; for a rank user only what
    the allow-list names (rank_may_get), with its own identity, HOME (the trial's rank directory)
    and caches."""
    if user is None:
        return dict(env)
    out = {k: v for k, v in env.items() if rank_may_get(k)}
    identity = (str(home), user.name, user.name, str(cache), str(cache / "cuda"))
    out.update(zip(RANK_IDENTITY, identity, strict=True))
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
