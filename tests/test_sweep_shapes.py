"""A sweep for another job shape (NIC loopback, several nodes) through the real pipeline: the plan
prunes network variables for that shape, the trials run with the shape's launch, the run is
stored with its shape and node class, and nothing is published on this node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def run_cli(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "nccltune", *args, "--state-dir", str(state)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


def test_a_loopback_plan_judges_network_variables_for_that_shape(tmp_path: Path) -> None:
    single = run_cli("sweep", "--demo", "--plan", "--json", state=tmp_path / "a")
    loop = run_cli("sweep", "--demo", "--plan", "--json", "--loopback", state=tmp_path / "b")
    assert single.returncode == 0 and loop.returncode == 0, (single.stderr, loop.stderr)
    one, other = json.loads(single.stdout), json.loads(loop.stdout)
    assert one["job_shape"] == {"nnodes": 1, "loopback": False}
    assert other["job_shape"] == {"nnodes": 1, "loopback": True}
    reasons = {(p["name"], p["value"]): p["reason"] for p in other["pruned"]}
    single_reasons = {(p["name"], p["value"]): p["reason"] for p in one["pruned"]}
    assert single_reasons[("NCCL_NET_GDR_LEVEL", "*")].startswith("single-node sweep")
    # Judged on the recorded node's GPU-NIC paths: the VM's one Ethernet NIC has no GDR.
    assert reasons[("NCCL_NET_GDR_LEVEL", "PHB")].startswith("no GPU-NIC pair can use GDR")
    assert "NIC loopback" in reasons[("NCCL_PXN_DISABLE", "1")]
    assert not (tmp_path / "b" / "nccl.json").exists()


def test_a_loopback_sweep_is_stored_with_its_shape_and_publishes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    swept = run_cli("sweep", "--demo", "--loopback", "--json", state=state)
    assert swept.returncode == 0, swept.stderr
    doc = json.loads(swept.stdout)
    assert doc["published"] is None
    assert not (state / "nccl.json").exists() and not (state / "current").exists()
    history = run_cli("history", "--json", state=state)
    assert history.returncode == 0, history.stderr
    run = json.loads(history.stdout)["runs"][0]
    assert run["status"] == "ok"
    job = run["summary"]["job"]
    assert job["label"].endswith("loopback") and job["loopback"] is True and job["nnodes"] == 2
    assert job["launcher"] == "local" and job["node_class"]
    assert "class profile decides" in run["summary"]["not_published"]
