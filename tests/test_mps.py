"""CUDA MPS for ranks on one GPU (trials/mps.py): started from a system directory with its own pipe
and log directories, stopped with `quit`, and where it cannot start the ranks time-slice and the
label says why. A stand-in control binary plays NVIDIA's (no GPU here): it makes the control pipe
on -d and records what it was asked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nccltune.trials import mps

FAKE = """#!/bin/sh
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {calls}
if [ "$1" = "-d" ]; then
  {start}
fi
if [ -z "$1" ]; then
  read cmd; echo "stdin $cmd" >> {calls}; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
fi
"""


def _install(bindir: Path, calls: Path, start: str) -> None:
    bindir.mkdir(mode=0o755)
    exe = bindir / mps.CONTROL
    exe.write_text(FAKE.format(calls=calls, start=start))
    exe.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)


def test_the_daemon_runs_for_the_ranks_inside_and_quits_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    _install(tmp_path / "bin", calls, 'mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"')
    monkeypatch.setattr(mps, "SEARCH", (str(tmp_path / "bin"),))
    with mps.shared_gpu(tmp_path / "work", None) as sharing:
        assert sharing.mps and sharing.label == mps.CONCURRENT
        pipe = Path(sharing.env[mps.PIPE_VAR])
        assert (pipe / "control").exists() and pipe.is_relative_to(tmp_path / "work")
        assert stat.S_IMODE(os.stat(pipe).st_mode) == 0o700
        assert sharing.doc() == {"mps": True, "label": mps.CONCURRENT}
    lines = calls.read_text().splitlines()
    assert lines[0] == f"-d pipe={pipe} log={sharing.env[mps.LOG_VAR]}"
    assert "stdin quit" in lines
    assert not pipe.exists()  # the run's MPS directories go with it


def test_a_refused_start_leaves_the_ranks_time_sliced_and_says_why(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    _install(tmp_path / "bin", calls, 'echo "An instance of this daemon is already running" >&2; exit 3')
    monkeypatch.setattr(mps, "SEARCH", (str(tmp_path / "bin"),))
    with mps.shared_gpu(tmp_path / "work", None) as sharing:
        assert not sharing.mps and sharing.env == {}
        assert sharing.label.startswith(mps.TIME_SLICED)
        assert "exited 3: An instance of this daemon is already running" in sharing.label
    assert "stdin quit" not in calls.read_text()


def test_no_binary_in_a_system_directory_and_not_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mps, "SEARCH", (str(tmp_path / "nothing-here"),))
    # A control binary on the caller's PATH is never run.
    _install(tmp_path / "path", tmp_path / "calls", "exit 0")
    monkeypatch.setenv("PATH", f"{tmp_path / 'path'}:{os.environ['PATH']}")
    with mps.shared_gpu(tmp_path / "work", None) as sharing:
        assert not sharing.mps and "is not installed in a system directory" in sharing.label
    assert not (tmp_path / "calls").exists()
    with mps.shared_gpu(tmp_path / "work", None, enabled=False) as sharing:
        assert not sharing.mps and sharing.label == f"{mps.TIME_SLICED}: not asked for"
