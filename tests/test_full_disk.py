"""A full disk is reported as what it is (exit 1, ENOSPC, the path), never as bad config, and
leaves no empty database behind. A real tmpfs filled to the last block."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fill_up

from nccltune.errors import EXIT_CHECK_FAILED
from nccltune.files.atomicfile import FileError
from nccltune.files.lock import SweepLock
from nccltune.store import Store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def full_disk(tmpfs: Path) -> Path:
    """A state directory on a tmpfs with no block left."""
    (tmpfs / "state").mkdir(mode=0o755)
    fill_up(tmpfs)
    return tmpfs / "state"


def test_a_full_disk_in_the_lock_is_exit_1_naming_enospc(full_disk: Path) -> None:
    with pytest.raises(FileError) as info:
        SweepLock(full_disk / "sweep.lock").acquire()
    assert info.value.exit_code == EXIT_CHECK_FAILED
    assert "ENOSPC" in str(info.value) and str(full_disk / "sweep.lock") in str(info.value)


def test_a_full_disk_in_the_history_leaves_no_empty_database(full_disk: Path) -> None:
    with pytest.raises(FileError) as info:
        Store(full_disk / "history.db")
    assert info.value.exit_code == EXIT_CHECK_FAILED
    assert "ENOSPC" in str(info.value) and "bad config" not in str(info.value)
    assert [p.name for p in full_disk.iterdir() if p.name.startswith("history.db")] == []


def test_sweep_on_a_full_disk_exits_1_without_a_traceback(full_disk: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    env["PYTHONPATH"] = str(REPO)
    got = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", "--state-dir", str(full_disk)],
                         capture_output=True, text=True, timeout=120, env=env, check=False)
    assert got.returncode == EXIT_CHECK_FAILED, got.stderr
    assert "No space left on device" in got.stderr and "Traceback" not in got.stderr
