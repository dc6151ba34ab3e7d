"""How a sweep ends when it is signalled: SIGTERM exits 143 and is recorded as such; a kill -9
shows as interrupted in `history` as soon as nothing holds the run, before any next sweep.
Real sweeps (CPU demo) with a hung trial, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    env.update(PYTHONPATH=str(REPO), **{FAULT_VAR: "hang@1"})
    return env


def _start(state: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "nccltune", "sweep", "--demo", "--state-dir", str(state)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_hung_ranks(state: Path, proc: subprocess.Popen[str]) -> list[int]:
    record = state / "ranks.running"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            pids = [int(line.split()[0]) for line in record.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            pids = []
        if len(pids) == 2:
            return pids
        time.sleep(0.1)
    raise AssertionError("the sweep never started its ranks")


def _history(state: Path) -> list[dict[str, object]]:
    got = subprocess.run([sys.executable, "-m", "nccltune", "history", "--json", "--state-dir", str(state)],
                         env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert got.returncode == 0, got.stderr
    runs = json.loads(got.stdout)["runs"]
    assert isinstance(runs, list)
    return runs


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_sigterm_exits_143_and_history_says_terminated(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = _start(state)
    try:
        pids = _wait_for_hung_ranks(state, proc)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert _gone(pids)
    run = _history(state)[0]
    assert run["status"] == "interrupted"
    assert "terminated (SIGTERM)" in json.dumps(run) and "KeyboardInterrupt" not in json.dumps(run)


def test_a_kill_9_shows_as_interrupted_in_history_at_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = _start(state)
    try:
        pids = _wait_for_hung_ranks(state, proc)
        assert _history(state)[0]["status"] == "running"  # a live sweep holds it
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone(pids), "ranks outlived the killed sweep"
    assert _history(state)[0]["status"] == "interrupted"


@pytest.mark.parametrize("limit", ["-5", "0", "x"])
def test_history_limit_must_be_positive(tmp_path: Path, limit: str) -> None:
    got = subprocess.run([sys.executable, "-m", "nccltune", "history", "--limit", limit, "--state-dir",
                          str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert got.returncode == 2 and "--limit" in got.stderr


def test_report_on_a_verify_run_shows_its_table(tmp_path: Path) -> None:
    from nccltune.store import Store

    with Store(tmp_path / "history.db") as store:
        run_id = store.start_run(kind="verify", fingerprint="f", backend="gloo", demo=True, profile=None,
                                 nccl_version=None, driver_version=None, torch_version=None, nccltune_version="0",
                                 hostname="h", topology={}, config={})
        store.finish_run(run_id, status="ok", summary={
            "passed": True, "reason": "bus bandwidth as expected", "expectation": "baseline",
            "rows": [{"size_bytes": 4096, "measured_gbps": 0.5, "expected_gbps": 0.49, "allowed_pct": 10.0,
                      "drift_pct": 2.0, "ok": True}]})
    for extra in ((), ("--json",)):
        got = subprocess.run([sys.executable, "-m", "nccltune", "report", "--run", str(run_id), "--state-dir",
                              str(tmp_path), *extra], env=_env(), capture_output=True, text=True, timeout=60,
                             check=False)
        assert got.returncode == 0, got.stderr
        assert "Traceback" not in got.stderr
    assert "measured 0.5" in subprocess.run(
        [sys.executable, "-m", "nccltune", "report", "--run", str(run_id), "--state-dir", str(tmp_path)],
        env=_env(), capture_output=True, text=True, timeout=60, check=False).stdout
