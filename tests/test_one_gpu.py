"""A node with one GPU (the recording of a 1x H200 VM, tests/fixtures/h200x1-vm.json: `nccltune
topo record` there, with a description added) through
`topology.snapshot`, the same non-demo (NCCL) path a real node takes: the sweep publishes what fits
every job without a trial, --plan says there is nothing to measure, verify needs a published set
(what it checks there: test_verify_one_gpu.py), the daemon stays up
and never schedules a sweep or verify, and `topo check` runs NCCL with one rank."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import REPO
from demo_state import BASE_CONFIG

from nccltune.checks.topocheck import ONE_RANK_NOTE, check_topology_file
from nccltune.cli import main
from nccltune.config import load_config
from nccltune.daemon import Daemon, DaemonOptions, actions, scheduler
from nccltune.daemon.actions import NcclInfo
from nccltune.daemon.sdnotify import Notifier
from nccltune.fleet.jsonschema import validate
from nccltune.node import load_node
from nccltune.publish import read_set
from nccltune.store import Store
from nccltune.topology.ncclxml import render_xml

pytest.importorskip("torch")

H200X1 = Path(__file__).parent / "fixtures" / "h200x1-vm.json"
MESSAGE = "one GPU: no collective between GPUs to measure; published what fits every job"


def config(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"topology": {"snapshot": str(H200X1)}, **extra}))
    return path


def cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def test_the_recording_loads_as_a_node_of_one_rank(tmp_path: Path) -> None:
    node = load_node(load_config(config(tmp_path), required=True), None)
    assert (len(node.topo.gpus), node.nranks, node.measurable, node.demo) == (1, 1, False, False)


def test_sweep_publishes_what_fits_every_job_and_exits_0(tmp_path: Path) -> None:
    state = tmp_path / "state"
    rc, out, err = cli("sweep", "--config", config(tmp_path, sweep={"pin": {"NCCL_IB_HCA": "^mlx5_2"}}),
                       "--state-dir", state)
    assert rc == 0, err
    assert MESSAGE in out and "No trial" in out
    assert "Every-job part" in out and "Single-node part" in out
    got = read_set(state)
    assert got is not None
    topo = state / "generations" / "1" / "ncclTopology.xml"
    assert got.env == {"NCCL_TOPO_FILE": str(topo), "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                       "NCCL_IB_HCA": "^mlx5_2"}
    assert got.single_node_env == {}
    node = load_node(load_config(config(tmp_path), required=True), None)
    assert topo.read_text() == render_xml(node.topo.system)
    assert got.provenance["note"] == MESSAGE
    # Nothing measured, nothing beyond NCCL's defaults: the set says so, in nccl.json and every header.
    assert got.provenance["state"] == "defaults"
    assert "# state: defaults" in got.texts["nccl.sh"] and "# state: defaults" in got.texts["nccl.env"]
    with Store(state / "history.db") as store:
        runs = store.runs()
    assert [(r.kind, r.status) for r in runs] == [("sweep", "ok")]
    assert runs[0].summary["trials"] == 0 and runs[0].published_generation == 1


def test_sweep_json_shows_both_parts(tmp_path: Path) -> None:
    rc, out, err = cli("sweep", "--json", "--config", config(tmp_path), "--state-dir", tmp_path / "state")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["summary"] == MESSAGE and doc["trials"] == 0 and doc["sizes"] == []
    assert set(doc["published_env"]) == {"NCCL_TOPO_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert doc["single_node_env"] == {}
    assert set(doc["scopes"]) == {"every_job", "single_node"}


def test_plan_says_nothing_is_measured(tmp_path: Path) -> None:
    rc, out, err = cli("sweep", "--plan", "--config", config(tmp_path), "--state-dir", tmp_path / "state")
    assert rc == 0, err
    assert out.startswith(MESSAGE) and "runs no trial" in out
    rc, out, err = cli("sweep", "--plan", "--json", "--config", config(tmp_path), "--state-dir", tmp_path / "state")
    assert rc == 0, err
    # The plan document every plan is (schemas/plan.schema.json), measuring nothing, saying why.
    doc = json.loads(out)
    validate(doc, json.loads((REPO / "schemas" / "plan.schema.json").read_text()))
    assert doc["kind"] == "plan" and doc["nranks"] == 1 and doc["measure"] == {}
    assert doc["estimate"] == {"trials": 0, "seconds": 0.0, "most_trials": 0, "most_seconds": 0.0}
    assert doc["reason"] == MESSAGE
    assert all(p["code"] for p in doc["pruned"])
    assert not (tmp_path / "state" / "nccl.sh").exists()


def test_verify_checks_the_published_set_and_needs_one(tmp_path: Path) -> None:
    """verify there checks what NCCL runs for the published table's shapes N x 1
    (test_verify_one_gpu.py); with nothing published there is nothing to check against."""
    rc, out, err = cli("verify", "--config", config(tmp_path), "--state-dir", tmp_path / "state")
    assert (rc, out) == (1, "") and "nothing is published" in err
    assert not (tmp_path / "state" / "history.db").exists()


# -- the daemon -----------------------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    # topology.snapshot stands in for NVML for the node and for the GPUs' users, as on a GPU node.
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**BASE_CONFIG, "topology": {"snapshot": str(H200X1)}}))
    opts = DaemonOptions(config_path=cfg, overrides={"state_dir": str(tmp_path / "state")}, demo=None)
    d = Daemon(opts, notifier=Notifier(env={}), clock=lambda: 1000.0, wall_clock=dt.datetime.now,
               node_loader=actions.read_node, nccl_probe=lambda c, python: NcclInfo(version="2.28.9"))
    d.start()
    yield d
    d.close()


@pytest.fixture
def daemon_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level("INFO", logger="nccltune.daemon.service")
    return caplog


def test_the_first_publish_of_a_one_gpu_daemon_is_information_not_a_warning(daemon_log: pytest.LogCaptureFixture,
                                                                             daemon: Daemon) -> None:
    # The daemon fixture started it: what it logged then belongs to the test's setup.
    got = [(r.levelname, r.getMessage()) for r in daemon_log.get_records("setup")
           if "fits every job" in r.getMessage() or "safe environment" in r.getMessage()]
    assert got == [("INFO", f"published what fits every job (generation 1): {scheduler.ONE_GPU_WAIT}")]


def test_the_daemon_stays_up_publishes_what_fits_every_job_and_never_sweeps(daemon: Daemon,
                                                                            tmp_path: Path) -> None:
    assert daemon.state.one_gpu
    decision = daemon.decide()
    assert (decision.action, decision.reason) == (scheduler.Action.WAIT, scheduler.ONE_GPU_WAIT)
    got = read_set(tmp_path / "state")
    assert got is not None and "NCCL_TOPO_FILE" in got.env and got.single_node_env == {}
    daemon.poll()
    assert daemon.act().action is scheduler.Action.WAIT
    assert daemon.status_text == f"idle, {scheduler.ONE_GPU_WAIT}"
    with Store(tmp_path / "state" / "history.db") as store:
        assert store.runs() == []


def test_the_scheduler_neither_sweeps_nor_verifies_with_one_gpu() -> None:
    policy = scheduler.Policy(poll_interval_s=60, quiet_period_s=0, verify_interval_s=10, sweep_on_start=True)
    now = scheduler.Now(monotonic_s=1e6, local_time=dt.time(12))
    two = scheduler.State(last_verify_s=0.0, sweep_pending="nothing is published yet")
    assert scheduler.decide(two, policy, now).action is scheduler.Action.SWEEP
    one = scheduler.ranks_counted(two, 1)
    assert scheduler.decide(one, policy, now) == scheduler.Decision(scheduler.Action.WAIT, scheduler.ONE_GPU_WAIT,
                                                                    60)
    assert scheduler.first_wait(one, policy).wait_s == 60
    due = scheduler.ranks_counted(scheduler.State(last_verify_s=0.0, verify_due=True), 1)
    assert scheduler.decide(due, policy, now).action is scheduler.Action.WAIT
    assert scheduler.decide(scheduler.ranks_counted(one, 2), policy, now).action is scheduler.Action.SWEEP


# -- topo check -----------------------------------------------------------------------------------


def test_topo_check_runs_nccl_with_one_rank(tmp_path: Path) -> None:
    node = load_node(load_config(config(tmp_path), required=True), None)
    xml = tmp_path / "t.xml"
    xml.write_text(render_xml(node.topo.system))
    # Without a GPU here NCCL cannot start, but the check is no longer refused: it runs one rank
    # and reports what happened as it does for two.
    check = check_topology_file(xml, gpu_count=1, timeout_s=120)
    assert check.nranks == 1
    assert ONE_RANK_NOTE in check.notes
    assert check.trial_status in {"ok", "crashed", "error", "timeout"}
    assert check.verdict


def test_report_after_a_one_gpu_sweep_says_why_there_is_no_table(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert cli("sweep", "--config", config(tmp_path), "--state-dir", state)[0] == 0
    rc, out, err = cli("report", "--config", config(tmp_path), "--state-dir", state)
    assert rc == 0, err
    assert MESSAGE in out and "No table: it ran no trial." in out
    rc, out, err = cli("report", "--json", "--config", config(tmp_path), "--state-dir", state)
    assert rc == 0, err
    doc = json.loads(out)
    validate(doc, json.loads((REPO / "schemas" / "report.schema.json").read_text()))
    assert doc["sizes"] == [] and doc["trials"] == 0 and doc["run"]["summary"]["summary"] == MESSAGE
    rc, _out, err = cli("report", "--plot", tmp_path / "p.png", "--config", config(tmp_path), "--state-dir", state)
    assert rc == 1 and "measured nothing" in err and not (tmp_path / "p.png").exists()
