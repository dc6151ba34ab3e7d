"""A sweep for another job shape (NIC loopback, several nodes) through the real pipeline: the plan
prunes network variables for that shape, the trials run with the shape's launch, the run is
stored with its shape and node class, and nothing is published on this node; two nodes through
the command line, from the sweep to a class profile for their shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import REPO

from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.store import Store
from nccltune.sweep.space import CATALOGUE
from nccltune.trials.worker import FAULT_VAR
from tests.demo_state import SHORT_CONFIG
from tests.twonodes import end, kill_under, multinode_key, node_env, port_pair, processes_in, wait_gone


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
    # The shortest sweep: what is stored and published depends on the shape, not on what was searched.
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(SHORT_CONFIG))
    swept = run_cli("sweep", "--demo", "--loopback", "--json", "--config", str(config), state=state)
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


# -- two nodes through the command line ------------------------------------------------------------

# Every trial's bound, which the hung trial waits out: a normal trial of four gloo ranks over two
# torchrun agents takes 7-9 s on a two-core machine that runs the rest of the suite beside it.
TRIAL_TIMEOUT_S = 30
KILLED_WITHIN_S = 30  # a trial's processes, on either node, once the next trial has started
SWEEP_DEADLINE_S = 900  # the whole two-node sweep on a loaded two-core machine, with one hang


def _trial_of(cwd: Path) -> str | None:
    """The trial directory (trial-NNN) a process runs in, on either node."""
    return next((p.name for p in (cwd, *cwd.parents) if p.name.startswith("trial-")), None)


def _watch(coordinator: subprocess.Popen[bytes], coordinator_runs: Path, root: Path) -> set[tuple[str, str]]:
    """Wait for the coordinator's sweep; meanwhile, note every process of a trial (either node)
    still running KILLED_WITHIN_S after the coordinator started the next trial."""
    first_seen: dict[str, float] = {}
    late: set[tuple[str, str]] = set()
    deadline = time.monotonic() + SWEEP_DEADLINE_S
    while coordinator.poll() is None and time.monotonic() < deadline:
        now = time.monotonic()
        for trial_dir in coordinator_runs.glob("*/trial-*"):
            first_seen.setdefault(trial_dir.name, now)
        for cwd in processes_in(root).values():
            trial = _trial_of(cwd)
            following = f"trial-{int(trial[6:]) + 1:03d}" if trial else None
            if following in first_seen and now - first_seen[following] > KILLED_WITHIN_S:
                late.add((str(trial), str(cwd)))
        time.sleep(1.0)
    return late


def test_a_sweep_over_two_nodes_is_stored_on_the_coordinator_and_decided_for_its_shape(tmp_path: Path) -> None:
    """`nccltune sweep --nodes 2` and `nccltune sweep --join` as two processes with their own state,
    joined by torchrun's c10d rendezvous over the loopback (gloo, two ranks per node). The joining
    node hangs in the NCCL_ALGO=Ring trial (its own environment holds the fault, the coordinator's
    does not): that trial is killed on both nodes and recorded, the sweep goes on, the run is stored
    on the coordinator with its shape and class, nothing is published on either node, and
    export + fleet decide give a profile for two nodes."""
    exclude = [name for name, t in CATALOGUE.items() if t.kind == "perf" and name != "NCCL_ALGO"]
    key_file, _ = multinode_key(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "sweep": {"baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1,
                  "variables": {"NCCL_ALGO": ["Ring"]}, "exclude": exclude},
        "bench": {"trial_timeout_s": TRIAL_TIMEOUT_S}, "tuner": {"plugin": "keep"},
        "multinode": {"key_file": str(key_file)}}))
    port = port_pair()
    coordinator_state, joiner_state, logs = tmp_path / "coordinator", tmp_path / "joiner", tmp_path / "logs"
    logs.mkdir()
    python = sys.executable
    # --demo: the joining node has no GPU here; it runs up to the demo's ranks.
    joiner = _spawn([python, "-m", "nccltune", "sweep", "--join", f"127.0.0.1:{port}", "--demo", "--state-dir",
                     str(joiner_state), "--config", str(config), "--python", python, "-v"],
                    node_env(**{FAULT_VAR: "hang:NCCL_ALGO=Ring"}), logs / "joiner")
    coordinator = _spawn([python, "-m", "nccltune", "sweep", "--demo", "--nodes", "2", "--launcher", "torchrun",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--config", str(config), "--state-dir",
                          str(coordinator_state), "--json"], node_env(), logs / "coordinator")
    try:
        late = _watch(coordinator, coordinator_state / "runs", tmp_path)
        assert coordinator.poll() is not None, "the two-node sweep did not finish in time"
        joiner.wait(timeout=120)
    finally:
        end(coordinator, 0)
        end(joiner, 0)
        left = wait_gone(tmp_path)
        kill_under(tmp_path)
    text = {p.name: p.read_text(errors="replace") for p in logs.iterdir()}
    assert coordinator.returncode == 0, text["coordinator.err"][-3000:]
    assert joiner.returncode == 0, text["joiner.err"][-3000:]
    assert not late, f"trial processes outlived their trial: {sorted(late)}"
    assert not left, f"processes left after the sweep: {left}"

    # The run, on the coordinator, with the job shape and the node class.
    assert json.loads(text["coordinator.out"])["published"] is None
    with Store(coordinator_state / "history.db") as store:
        (run,) = store.runs(limit=None)
        trials = store.trials(run.id)
    assert run.status == "ok"
    job = {"label": "2x2", "nnodes": 2, "ranks_per_node": 2, "loopback": False, "launcher": "torchrun"}
    assert {k: run.summary["job"][k] for k in job} == job and run.summary["job"]["node_class"]
    assert run.topology["job"] == run.summary["job"]
    # Every trial ran across both nodes; the one that hung on the joining node was ended there on
    # the coordinator's word and recorded as a timeout; the trials after it ran as before.
    assert f"Ran {len(trials)} trial(s)" in text["joiner.out"]
    assert len(list((joiner_state / "join").glob("trial-*"))) == len(trials)
    (hung,) = [t for t in trials if t.env.get("NCCL_ALGO") == "Ring"]
    assert hung.status == "timeout" and f"no result within {TRIAL_TIMEOUT_S} s" in (hung.reason or "")
    assert f"trial {hung.seq}: stopping this node's agent: the coordinator ended it" in text["joiner.err"]
    others = [t for t in trials if t is not hung]
    assert [t.status for t in others] == ["ok"] * len(others)
    assert any(t.seq > hung.seq for t in others)
    assert all(m.busbw_gbps > 0 and m.correct for t in others for m in t.measurements)
    # Nothing published on either node.
    for state in (coordinator_state, joiner_state):
        assert not (state / "current").exists() and not (state / "nccl.json").exists()
        assert not (state / "generations").exists()

    # A profile for that shape: export on the coordinator, then fleet decide.
    export = tmp_path / "coordinator.export.json"
    got = run_cli("export", "--demo", "--config", str(config), "--out", str(export), state=coordinator_state)
    assert got.returncode == 0, got.stderr
    doc = json.loads(export.read_text())
    (exported,) = doc["runs"]
    assert exported["job"] == job and exported["nranks"] == 2
    profile = tmp_path / "profile.json"
    got = _cli("fleet", "decide", str(export), "--out", str(profile), "--config", str(config))
    assert got.returncode == 0, got.stderr
    prof = json.loads(profile.read_text())
    validate(prof, load_schema("profile"))
    assert prof["job_shape"] == {"ranks_per_node": 2, "measured_nnodes": 2, "min_nnodes": 2, "max_nnodes": 2,
                                 "label": "2x2", "loopback": False}
    assert prof["node_class"] == doc["node_class"]
    ok_baselines = sum(1 for t in trials if t.phase == "baseline" and t.status == "ok")
    assert {s["samples"] for s in prof["evidence"]["baseline"]} == {ok_baselines}
    assert "job shape 2x2" in got.stdout

    # Another node's export of a single-node sweep of the same class: another shape, refused.
    other = json.loads(export.read_text())
    other["hostname"] = "gpu-node-002"
    for r in other["runs"]:
        r["job"] = None
    (tmp_path / "other.export.json").write_text(json.dumps(other))
    got = _cli("fleet", "decide", str(export), str(tmp_path / "other.export.json"), "--out",
               str(tmp_path / "mixed.json"), "--config", str(config))
    assert got.returncode == 78
    assert "runs of different job shapes (2x2 in" in got.stderr and "1x2 here" in got.stderr
    assert not (tmp_path / "mixed.json").exists()


def _spawn(argv: list[str], env: dict[str, str], log_stem: Path) -> subprocess.Popen[bytes]:
    """One node's nccltune, in a session of its own, its output in log_stem.out and .err."""
    with open(log_stem.with_suffix(".out"), "wb") as out, open(log_stem.with_suffix(".err"), "wb") as err:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO,
                                start_new_session=True)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True,
                          env=node_env(), timeout=600, cwd=REPO)
