"""Nodes with one GPU measure the jobs that span them: a sweep over two such nodes (the CPU demo of
the recorded 1x H200 VM, one gloo rank per node) runs trials of shape 2x1 through the real
coordinator and joiner processes, chooses per size, stores the run for that shape and publishes
nothing; export + fleet decide give a class profile for 2x1. One rank on one node is still refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from nccltune.config import load_config
from nccltune.errors import InputError
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.pipeline import SweepPipeline
from nccltune.store import Store
from nccltune.sweep.space import CATALOGUE
from nccltune.trials.launch.base import LaunchRequest
from tests.twonodes import end, kill_under, multinode_key, node_env, port_pair, wait_gone

H200X1 = REPO / "tests" / "fixtures" / "h200x1-vm.json"


def _config(tmp_path: Path, **bench: object) -> Path:
    key_file, _ = multinode_key(tmp_path)
    # The fewest trials: the baselines and the topology file alone (no variable searched).
    exclude = [name for name, t in CATALOGUE.items() if t.kind == "perf"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "sweep": {"baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1, "exclude": exclude},
        "bench": {"trial_timeout_s": 120, **bench}, "tuner": {"plugin": "keep"},
        "multinode": {"key_file": str(key_file)}}))
    return path


def test_one_rank_on_one_node_is_refused_but_not_across_nodes(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path, nranks=1), required=True)
    with pytest.raises(InputError) as err:
        SweepPipeline(cfg, demo=str(H200X1))
    assert "bench.nranks is 1" in str(err.value) and err.value.line is not None
    pipe = SweepPipeline(cfg, demo=str(H200X1), launch=LaunchRequest(nodes=2, launcher="torchrun",
                                                                     endpoint=("127.0.0.1", 29400)))
    assert pipe.measurable() and pipe.node().nranks == 1
    # The one-GPU recording alone: one rank, nothing to measure on that node by itself.
    alone = SweepPipeline(load_config(_config(tmp_path / "alone"), required=True), demo=str(H200X1))
    assert (alone.node().nranks, alone.measurable()) == (1, False)


def test_two_one_gpu_nodes_measure_their_2x1_job_and_fleet_decides_it(tmp_path: Path) -> None:
    config = _config(tmp_path)
    port = port_pair()
    coordinator_state, joiner_state, logs = tmp_path / "coordinator", tmp_path / "joiner", tmp_path / "logs"
    logs.mkdir()
    python = sys.executable
    joiner = _spawn([python, "-m", "nccltune", "sweep", "--join", f"127.0.0.1:{port}", "--demo", str(H200X1),
                     "--state-dir", str(joiner_state), "--config", str(config), "--python", python],
                    logs / "joiner")
    coordinator = _spawn([python, "-m", "nccltune", "sweep", "--demo", str(H200X1), "--nodes", "2",
                          "--launcher", "torchrun", "--rdzv-endpoint", f"127.0.0.1:{port}", "--config", str(config),
                          "--state-dir", str(coordinator_state), "--json"], logs / "coordinator")
    try:
        coordinator.wait(timeout=900)
        joiner.wait(timeout=120)
    finally:
        end(coordinator, 0)
        end(joiner, 0)
        left = wait_gone(tmp_path)
        kill_under(tmp_path)
    text = {p.name: p.read_text(errors="replace") for p in logs.iterdir()}
    assert coordinator.returncode == 0, text["coordinator.err"][-3000:]
    assert joiner.returncode == 0, text["joiner.err"][-3000:]
    assert not left, f"processes left after the sweep: {left}"

    doc = json.loads(text["coordinator.out"])
    assert doc["published"] is None and doc["backend"] == "gloo"
    assert "one GPU" not in text["coordinator.err"] + text["coordinator.out"]
    with Store(coordinator_state / "history.db") as store:
        (run,) = store.runs(limit=None)
        trials = store.trials(run.id)
    assert run.status == "ok"
    assert {k: run.summary["job"][k] for k in ("label", "nnodes", "ranks_per_node")} == \
        {"label": "2x1", "nnodes": 2, "ranks_per_node": 1}
    assert trials and all(t.status == "ok" for t in trials)
    # Every trial measured each size across the two nodes, one rank each (gloo, correct sums).
    assert all(m.busbw_gbps > 0 and m.correct for t in trials for m in t.measurements)
    assert f"Ran {len(trials)} trial(s)" in text["joiner.out"]
    # Per size: a verdict for every size the trials measured, one rank per node.
    measured = {m.size_bytes for t in trials for m in t.measurements}
    assert {r["size_bytes"] for r in doc["sizes"]} == measured and len(measured) > 1
    assert all(r["default_busbw_gbps"] > 0 for r in doc["sizes"])
    for state in (coordinator_state, joiner_state):
        assert not (state / "generations").exists()

    export = tmp_path / "coordinator.export.json"
    got = _cli("export", "--demo", str(H200X1), "--config", str(config), "--state-dir", str(coordinator_state),
               "--out", str(export))
    assert got.returncode == 0, got.stderr
    (exported,) = json.loads(export.read_text())["runs"]
    assert exported["job"]["label"] == "2x1" and exported["nranks"] == 1
    profile = tmp_path / "profile.json"
    got = _cli("fleet", "decide", str(export), "--out", str(profile), "--config", str(config))
    assert got.returncode == 0, got.stderr
    prof = json.loads(profile.read_text())
    validate(prof, load_schema("profile"))
    assert prof["job_shape"]["label"] == "2x1" and prof["job_shape"]["ranks_per_node"] == 1
    assert "job shape 2x1" in got.stdout


def _spawn(argv: list[str], log_stem: Path) -> subprocess.Popen[bytes]:
    with open(log_stem.with_suffix(".out"), "wb") as out, open(log_stem.with_suffix(".err"), "wb") as err:
        return subprocess.Popen(argv, env=node_env(), stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO,
                                start_new_session=True)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True,
                          env=node_env(), timeout=600, cwd=REPO)


def test_nccl_hostid_is_never_pinned_swept_or_published(tmp_path: Path) -> None:
    """Each node keeps its own NCCL_HOSTID: from the environment it reaches the node's own ranks
    only (not a pin, so not sent to the others nor published); a config cannot pin or sweep it."""
    cfg = load_config(_config(tmp_path), required=True)
    plan, _ = SweepPipeline(cfg, demo=True, env={"NCCL_HOSTID": "host-a", "NCCL_ALGO": "Ring"}).plan()
    assert "NCCL_HOSTID" not in plan.pinned and "NCCL_ALGO" in plan.pinned
    assert "NCCL_HOSTID" not in plan.variables
    for section in ("pin", "variables"):
        path = tmp_path / f"{section}.yaml"
        path.write_text(yaml.safe_dump({"sweep": {section: {"NCCL_HOSTID": "host-a" if section == "pin" else ["a"]}}}))
        with pytest.raises(InputError) as err:
            SweepPipeline(load_config(path, required=True), demo=True).plan()
        assert f"sweep.{section}.NCCL_HOSTID: names this node to NCCL" in str(err.value)
        assert err.value.line == 3


def test_a_class_table_for_a_job_shape_holds_entries_for_that_shape(tmp_path: Path) -> None:
    """A profile decided from sweeps over two nodes gives tuner entries for a communicator of two
    nodes (NCCL's byte counts of all_gather for all its ranks): the plugin applies an entry only
    to a communicator of the entry's shape, so entries for one node would never apply."""
    from nccltune.fleet.decide import Rules, decide, load_exports
    from tests.test_fleet import BOTH, KIB, _per_size_export

    paths = []
    for host in ("a", "b"):
        doc = _per_size_export(host, tmp_path).doc
        for run in doc["runs"]:
            run["job"] = {"label": "2x2", "nnodes": 2, "ranks_per_node": 2, "loopback": False, "launcher": "torchrun"}
        paths.append(tmp_path / f"{host}.job.json")
        paths[-1].write_text(json.dumps(doc))
    prof = decide(load_exports(paths), Rules("both", min_gain_pct=1.0, max_regression_pct=2.0, custom_profiles=BOTH))
    validate(prof, load_schema("profile"))
    assert prof["job_shape"]["label"] == "2x2"
    shapes = {(e["nnodes"], e["nranks"], e["ranks_per_node"]) for e in prof["tuner_table"]}
    assert shapes == {(2, 4, 2)}
    (gather,) = [e for e in prof["tuner_table"] if e["collective"] == "allgather"]
    assert gather["min_bytes"] == 64 * KIB // 4  # one rank's block of 4 ranks


@pytest.mark.usefixtures("nccl_probed_once")
def test_a_plan_over_two_one_gpu_nodes_measures_per_size_for_that_communicator(tmp_path: Path) -> None:
    """The recorded 1x H200 node, its NCCL path (not the demo): over two nodes the trials form a
    communicator of 2 ranks, 1 per node, so the per-size candidates (the tuner table) are planned
    for it, PAT for all_gather among them (one rank per node); NIC loopback gets no table."""
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump({"topology": {"snapshot": str(H200X1)},
                                    "sweep": {"profile": "rig", "profiles": {"rig": {"all_reduce": {"1MiB": 1},
                                                                                    "all_gather": {"1MiB": 1}}}}}))
    cfg = load_config(path, required=True)
    over_two = LaunchRequest(nodes=2, launcher="torchrun", endpoint=("127.0.0.1", 29400))
    plan, _ = SweepPipeline(cfg, launch=over_two, env={}).plan()
    assert plan.per_size is not None and plan.per_size.active, plan.per_size
    labels = {c.label for c in plan.per_size.candidates}
    assert "ring/ll" in labels and any(label.startswith("pat/") for label in labels)
    plan, _ = SweepPipeline(cfg, env={}).plan()  # the node alone: one rank, no tuner
    assert plan.per_size is not None and not plan.per_size.active
