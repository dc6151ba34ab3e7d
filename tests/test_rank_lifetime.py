"""Ranks never outlive the sweep: a kill -9 of the parent during a hung trial takes the ranks
with it, and what an earlier sweep left running is ended from its rank record, by pid and start
time, never by a process name. Real processes and signals throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nccltune.hw.procfs import boot_id, start_time_ticks
from nccltune.trials.runner import reap_leftover_ranks
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]

_PARENT = """
import os, sys
from pathlib import Path
from nccltune.trials.runner import Runner
work = Path(sys.argv[1])
env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL")}
env[sys.argv[2]] = "hang@1"
runner = Runner(python=sys.executable, backend="gloo", nranks=2, base_env=env, work_dir=work / "work",
                timeout_s=3600, rank_record=work / "ranks.running")
runner.run({}, [4096], warmup=1, iters=2, label="hang")
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(check: object, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def _recorded(record: Path) -> list[int]:
    try:
        return [int(line.split()[0]) for line in record.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def test_a_kill_9_of_the_parent_during_a_hung_trial_ends_its_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path), FAULT_VAR], env=env)
    record = tmp_path / "ranks.running"
    try:
        assert _wait_for(lambda: len(_recorded(record)) == 2), "the ranks never started"
        ranks = _recorded(record)
        assert all(_alive(pid) for pid in ranks)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_for(lambda: not any(_alive(pid) for pid in ranks), timeout_s=10), \
            f"ranks {ranks} outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in _recorded(record):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_leftover_rank_is_ended_from_the_record(tmp_path: Path) -> None:
    # A rank the death signal did not reach (its parent survived, or a kernel without it).
    leftover = subprocess.Popen(["sleep", "600"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        record = tmp_path / "ranks.running"
        started, boot = start_time_ticks(leftover.pid), boot_id()
        assert started is not None and boot is not None
        # The bystander's pid with another start time: a pid reused since the record was written.
        # Its own start time in another boot, or without a boot: a record from before a reboot.
        bystanders = [f"{bystander.pid} {started - 1} {boot}", f"{bystander.pid} {start_time_ticks(bystander.pid)} "
                      f"{boot.replace(boot[0], 'f' if boot[0] != 'f' else '0', 1)}",
                      f"{bystander.pid} {start_time_ticks(bystander.pid)}"]
        record.write_text("".join(f"{line}\n" for line in [f"{leftover.pid} {started} {boot}", *bystanders]))
        assert reap_leftover_ranks(record) == [leftover.pid]
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None
        assert record.read_text() == ""
    finally:
        for proc in (leftover, bystander):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_symlinked_rank_record_is_refused(tmp_path: Path) -> None:
    from nccltune.errors import InputError

    (tmp_path / "elsewhere").write_text("1 1\n")
    (tmp_path / "ranks.running").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InputError, match="symlink"):
        reap_leftover_ranks(tmp_path / "ranks.running")
    assert (tmp_path / "elsewhere").read_text() == "1 1\n"
