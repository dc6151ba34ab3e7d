"""What root may trust: the state and publish directories and the files nccltune opens there.

Real files, a real unprivileged user (nobody, through setpriv) where the tests run as root, and
real processes for the CLI.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from publishing import publish_set

from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.files import trust
from nccltune.files.lock import SweepLock
from nccltune.publish import Provenance

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                             reason="needs root and setpriv to act as an unprivileged user")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory nobody can reach (pytest's own tmp root is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="nccltune-trust-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd],
                          capture_output=True, text=True, timeout=30, check=False)


def prov() -> Provenance:
    return Provenance(nccltune_version="0", created_at="2026-01-01T00:00:00+00:00", topology_fingerprint="f",
                      nccl_version=None, backend="gloo", demo=True, profile=None)


def run_py(code: str, *, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pre = (lambda: os.umask(umask) and None) if umask is not None else None
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=env, preexec_fn=pre, check=False)


@as_root
def test_symlink_planted_by_another_user_is_not_truncated(open_dir: Path) -> None:
    """The drill's case: a state dir others can write (made under umask 000), a link planted
    by nobody at sweep.lock pointing at a root file; root's sweep must leave the file alone."""
    victim = open_dir / "victim"
    victim.write_text("root's data\n")
    state = open_dir / "state"
    state.mkdir()
    state.chmod(0o777)
    planted = as_nobody("ln", "-s", str(victim), str(state / "sweep.lock"))
    assert planted.returncode == 0, planted.stderr
    assert (state / "sweep.lock").lstat().st_uid == NOBODY
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert str(state) in proc.stderr and "world-writable" in proc.stderr and "0777" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert victim.read_text() == "root's data\n"


@pytest.mark.parametrize("name", ["sweep.lock", "daemon.lock"])
def test_lock_never_opens_through_a_symlink(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / name).symlink_to(victim)
    with pytest.raises(InputError, match="symlink") as info:
        SweepLock(state / name).acquire()
    assert info.value.exit_code == EXIT_CONFIG
    assert str(state / name) in str(info.value)
    assert victim.read_text() == "keep\n"


@as_root
def test_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chown(state, NOBODY, NOBODY)
    with pytest.raises(InputError) as info:
        SweepLock(state / "sweep.lock").acquire()
    message = str(info.value)
    assert str(state) in message and f"uid {NOBODY}" in message and "0755" in message
    assert not (state / "sweep.lock").exists()
    with pytest.raises(InputError, match=f"uid {NOBODY}"):
        publish_set(state, {"NCCL_ALGO": "Ring"}, prov())
    assert sorted(os.listdir(state)) == []


@as_root
def test_lock_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    lock = state / "sweep.lock"
    lock.write_text("")
    os.chown(lock, NOBODY, NOBODY)
    with pytest.raises(InputError, match=f"lock file: it is owned by uid {NOBODY}"):
        SweepLock(lock).acquire()


@pytest.mark.parametrize(("mode", "word"), [(0o775, "group-writable"), (0o757, "world-writable"),
                                            (0o777, "world-writable")])
def test_writable_directory_named_correctly(tmp_path: Path, mode: int, word: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)
    with pytest.raises(InputError, match=word):
        SweepLock(state / "sweep.lock").acquire()
    assert not (state / "sweep.lock").exists()


def test_directories_are_created_0755_under_umask_000(tmp_path: Path) -> None:
    state = tmp_path / "a" / "state"
    code = ("from pathlib import Path; from nccltune.files.lock import SweepLock; "
            "from nccltune.config import Config; from nccltune.publish import Provenance, Setting, publish_setting\n"
            f"SweepLock(Path({str(state)!r}) / 'sweep.lock').acquire()\n"
            f"publish_setting(Config(state_dir={str(state / 'pub')!r}), Setting({{'NCCL_ALGO': 'Ring'}}, "
            "Provenance('0', 'now', 'f', None, 'gloo', True, None)))\n")
    proc = run_py(code, umask=0)
    assert proc.returncode == 0, proc.stderr
    for directory in (tmp_path / "a", state, state / "pub", state / "pub" / "generations",
                      state / "pub" / "generations" / "1"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755, directory
    assert stat.S_IMODE((state / "sweep.lock").stat().st_mode) == 0o644
    assert stat.S_IMODE((state / "pub" / "generations" / "1" / "nccl.sh").stat().st_mode) == 0o644


def test_problem_wording() -> None:
    st = os.stat("/")
    assert trust.problem(st) is None or st.st_uid != 0
    assert trust.writable_word(0o666) == "world-writable"
    assert trust.writable_word(0o664) == "group-writable"
    assert trust.writable_word(0o644) is None


# -- the NCCL conf file -----------------------------------------------------------------------


@as_root
def test_conf_link_to_a_file_another_user_owns_is_not_written(open_dir: Path) -> None:
    from nccltune.publish import update_nccl_conf

    theirs = open_dir / "theirs.conf"
    theirs.write_text("NCCL_DEBUG=WARN\n")
    os.chown(theirs, NOBODY, NOBODY)
    link = open_dir / "nccl.conf"
    link.symlink_to(theirs)
    expected = f"{link}: refusing the NCCL conf file: it leads to {theirs}, which is owned by uid {NOBODY}"
    with pytest.raises(InputError, match=expected):
        update_nccl_conf(link, {"NCCL_ALGO": "Ring"}, prov())
    assert theirs.read_text() == "NCCL_DEBUG=WARN\n"


@as_root
def test_conf_link_planted_by_another_user_into_their_directory_is_not_written(open_dir: Path) -> None:
    from nccltune.publish import update_nccl_conf

    drop = open_dir / "drop"
    drop.mkdir()
    drop.chmod(0o777)
    link = open_dir / "nccl.conf"
    assert as_nobody("sh", "-c", f"printf 'NCCL_DEBUG=WARN\\n' > {drop}/x.conf").returncode == 0
    link.symlink_to(drop / "x.conf")
    with pytest.raises(InputError, match="world-writable"):
        update_nccl_conf(link, {"NCCL_ALGO": "Ring"}, prov())
    assert (drop / "x.conf").read_text() == "NCCL_DEBUG=WARN\n"
