"""Fleet decisions on the CPU: exports of two demo nodes of one class (recordings that differ only
in serials and bus numbers) pooled into one class profile, per collective and size, with its
tuner table, applied on a node of the class, and refused on a node of another class, for a stale
or malformed profile, and for exports of two classes. Two demo sweeps (all_reduce and all_gather,
with the per-size stage) are made once for the module."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nccltune.errors import InputError
from nccltune.fleet.decide import Export, Rules, decide, dumps_profile, load_exports
from nccltune.fleet.jsonschema import SCHEMA_DIR, SchemaViolation, load_schema, validate
from nccltune.publish import read_published
from nccltune.store import Store
from nccltune.sweep.plan import PER_SIZE_VARS
from nccltune.topology.model import from_snapshot
from nccltune.topology.nodeclass import class_id_of, node_class
from nccltune.topology.snapshot import load_snapshot
from tests.demo_state import BASE_CONFIG, SHORT_CONFIG, SWEEP_S, clean_env
from tests.fleet_fixtures import h200x2_export, load, sibling, write

ROOT = Path(__file__).resolve().parents[1]
# The shared demo config, measuring all_reduce and all_gather, with the per-size stage (the CPU demo
# computes the table without loading it) and no variable of its own (the per-size candidates are
# what the class pools): 11 trials of two collectives per node.
FLEET_CONFIG = copy.deepcopy(BASE_CONFIG)
del FLEET_CONFIG["sweep"]["variables"]
FLEET_CONFIG["sweep"].update({"profile": "both", "profiles": {"both": {"all_reduce": {"4KiB": 1, "1MiB": 1},
                                                                      "all_gather": {"4KiB": 1, "1MiB": 1}}},
                              "exclude": [n for n in BASE_CONFIG["sweep"]["exclude"] if n not in PER_SIZE_VARS]})
FLEET_CONFIG["tuner"] = {"plugin": "auto"}


def nccltune(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True,
                          env=clean_env(), timeout=SWEEP_S, cwd=cwd)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two demo nodes of one class, each swept once into its own state dir, and their exports."""
    root = tmp_path_factory.mktemp("fleet")
    (root / "config.yaml").write_text(yaml.safe_dump(FLEET_CONFIG, sort_keys=False))
    nodes = []
    for seed in (1, 2):
        snap = write(sibling(load("h200x2-nvswitch-vm"), seed=seed), root / f"node{seed}.json")
        state = root / f"state{seed}"
        got = nccltune("sweep", "--demo", str(snap), "--config", "config.yaml", "--state-dir", str(state), cwd=root)
        assert got.returncode == 0, got.stderr
        export = root / f"node{seed}.export.json"
        got = nccltune("export", "--demo", str(snap), "--config", "config.yaml", "--state-dir", str(state),
                       "--out", str(export), cwd=root)
        assert got.returncode == 0, got.stderr
        nodes.append({"snapshot": snap, "state": state, "export": export})
    got = nccltune("fleet", "decide", str(nodes[0]["export"]), str(nodes[1]["export"]), "--out", "profile.json",
                   "--config", "config.yaml", cwd=root)
    assert got.returncode == 0, got.stderr
    return {"root": root, "nodes": nodes, "profile": root / "profile.json", "decide_out": got.stdout}


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _digests(state: Path) -> dict[str, str]:
    """nccl.sh, nccl.env, nccl.json and ncclTopology.xml (when there is one)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(state.glob("nccl*"))}


# -- export --------------------------------------------------------------------------------------


def test_export_matches_its_schema_and_the_store(fleet: dict[str, Any]) -> None:
    node = fleet["nodes"][0]
    doc = _json(node["export"])
    validate(doc, load_schema("export"))
    assert doc["kind"] == "export" and doc["schema_version"] == 1 and doc["demo"] is True
    assert doc["hostname"] == "gpu-node-001"  # the demo node is named by its snapshot
    topo = from_snapshot(load_snapshot(node["snapshot"]))
    assert doc["node_class"]["id"] == node_class(topo).id
    (run,) = doc["runs"]
    assert run["kind"] == "sweep" and run["status"] == "ok" and run["nranks"] == 2
    phases = [t["phase"] for t in run["trials"]]
    assert phases.count("baseline") == 3 and "final" in phases
    first = run["trials"][0]
    assert first["env"] == {} and first["measurements"]
    assert {"size_bytes", "busbw_gbps", "algbw_gbps", "time_us", "correct", "collective", "channels"} \
        <= set(first["measurements"][0])
    assert {m["collective"] for m in first["measurements"]} == {"all_reduce", "all_gather"}
    per_size = [t for t in run["trials"] if t["label"].startswith("per size: ")]
    assert len(per_size) == 6 and all(t["phase"] == "screen" for t in per_size)
    assert doc["versions"]["driver"] == "580.159.04"


def test_export_is_deterministic_and_selects_runs(fleet: dict[str, Any]) -> None:
    node = fleet["nodes"][0]
    base = ("export", "--demo", str(node["snapshot"]), "--config", "config.yaml", "--state-dir", str(node["state"]))
    again = nccltune(*base, cwd=fleet["root"])
    assert again.returncode == 0 and again.stdout == node["export"].read_text()
    one = nccltune(*base, "--run", "1", cwd=fleet["root"])
    assert one.returncode == 0 and json.loads(one.stdout)["runs"][0]["id"] == 1
    missing = nccltune(*base, "--run", "99", cwd=fleet["root"])
    assert missing.returncode == 78 and "no run 99" in missing.stderr
    # Another node's snapshot over this node's history: no sweep of that topology.
    other = nccltune("export", "--demo", str(fleet["nodes"][1]["snapshot"]), "--config", "config.yaml",
                     "--state-dir", str(node["state"]), cwd=fleet["root"])
    assert other.returncode == 1 and "no ok sweep of topology" in other.stderr


def _demo_history(path: Path, trials: int, *, sizes: int = 16, bad: dict[str, Any] | None = None) -> Any:
    """A history of one ok demo sweep of `trials` trials on the 2x H200 recording (the node
    write_export is given), every trial with `sizes` measurements; `bad`: one more trial's
    fields (env, measurements) as the store keeps them and fleet decide refuses them."""
    from nccltune.fleet.export import NodeIdentity
    from nccltune.records import Measurement
    from nccltune.topology.fingerprint import topology_fingerprint

    topo = from_snapshot(load_snapshot(ROOT / "topologies" / "h200x2-nvswitch-vm.json"))
    ladder = [4096 << i for i in range(sizes)]
    with Store(path) as store:
        run = store.start_run(kind="sweep", fingerprint=topology_fingerprint(topo), backend="gloo", demo=True,
                              profile="balanced", nccl_version=None, driver_version=topo.driver_version,
                              torch_version=None, nccltune_version="0", hostname="vm", topology={}, config={})
        for seq in range(1, trials + 1):
            store.add_trial(run, seq=seq, phase="baseline" if seq % 4 == 1 else "final", label=f"trial {seq}",
                            env={} if seq % 4 == 1 else {"NCCL_ALGO": "Ring"}, status="ok", wall_s=1.0,
                            measurements=[Measurement(s, 10.0, 1.0, 1.5 + seq % 3) for s in ladder])
        if bad is not None:
            store.add_trial(run, seq=trials + 1, phase="final", label="bad", status="ok",
                            **{"env": {}, "measurements": [Measurement(4096, 10.0, 1.0, 1.5)], **bad})
        store.finish_run(run, status="ok", summary={}, chosen_env={}, published_generation=None, rows=[])
    return NodeIdentity(topo, topo, "vm", True)


def test_export_streams_one_trial_at_a_time(tmp_path: Path) -> None:
    """The memory an export takes does not grow with the history: the peak while writing twice the
    trials is about the same, and far below the document; the bytes are dumps_export's."""
    import io
    import tracemalloc

    from nccltune.fleet.export import dumps_export, write_export

    class Counting(io.RawIOBase):
        def __init__(self) -> None:
            self.size = 0

        def write(self, b: Any) -> int:
            self.size += len(b)
            return len(b)

    peaks, sizes = [], []
    for trials in (150, 300):
        node = _demo_history(tmp_path / f"h{trials}.db", trials)
        with Store(tmp_path / f"h{trials}.db") as store:
            sink = Counting()
            tracemalloc.start()
            written = write_export(store, node, sink)  # type: ignore[arg-type]
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            sizes.append(sink.size)
            assert written.size == sink.size and written.runs == 1
            whole = io.BytesIO()
            write_export(store, node, whole)
        assert whole.getvalue().decode() == dumps_export(json.loads(whole.getvalue()))
    assert sizes[1] > 1.9 * sizes[0] and sizes[0] > 500_000
    assert peaks[1] < 1.3 * peaks[0] and peaks[1] < sizes[1] / 4, (peaks, sizes)


@pytest.mark.parametrize(("fault", "message"), [
    ("lone surrogate", "run 1 trial 41 ($.runs[0].trials[40].env.NCCL_ALGO): a text without a UTF-8 form"),
    ("negative busbw", "run 1 trial 41 ($.runs[0].trials[40].measurements[0].busbw_gbps): -1.5 is below the "
                       "minimum 0"),
])
def test_an_export_decide_would_refuse_is_refused_and_nothing_written(tmp_path: Path, fault: str,
                                                                      message: str) -> None:
    """What the store keeps and decide refuses (a text with no UTF-8 form, a number its schema does
    not allow): the export says which run and trial, exit 78, and writes nothing, to a file or stdout."""
    from nccltune.records import Measurement

    bad: dict[str, Any] = ({"env": {"NCCL_ALGO": "Ring\udcff"}} if fault == "lone surrogate"
                           else {"measurements": [Measurement(4096, 10.0, 1.0, -1.5)]})
    state = tmp_path / "state"
    state.mkdir()
    _demo_history(state / "history.db", 40, bad=bad)
    snapshot = ROOT / "topologies" / "h200x2-nvswitch-vm.json"
    out = tmp_path / "node.export.json"
    for to_file in (True, False):
        got = nccltune("export", "--demo", str(snapshot), "--state-dir", str(state),
                       *(("--out", str(out)) if to_file else ()), cwd=tmp_path)
        assert got.returncode == 78, got.stderr
        assert message in got.stderr and "fleet decide` refuses" in got.stderr and "Traceback" not in got.stderr
        assert got.stdout == "" and not out.exists() and sorted(tmp_path.glob(".node.export.json.tmp-*")) == []


# The child: nccltune's command line with fleet decide's size bound lowered, as a history far
# larger than that bound would meet it.
SMALL_BOUND = """
import sys
from nccltune.fleet import document
document.MAX_DOCUMENT_BYTES = int(sys.argv.pop(1))
from nccltune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_export_larger_than_decide_reads_is_refused_and_nothing_written(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    _demo_history(state / "history.db", 40)
    snapshot = ROOT / "topologies" / "h200x2-nvswitch-vm.json"
    out = tmp_path / "node.export.json"
    base = ["export", "--demo", str(snapshot), "--state-dir", str(state)]
    whole = nccltune(*base, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    size = len(whole.stdout.encode())
    for bound, ok in ((size, True), (size - 1, False)):
        for to_file in (True, False):
            out.unlink(missing_ok=True)
            got = subprocess.run([sys.executable, "-c", SMALL_BOUND, str(bound), *base,
                                  *(("--out", str(out)) if to_file else ())], capture_output=True, text=True,
                                 env=clean_env(PYTHONPATH=str(ROOT)), timeout=SWEEP_S, cwd=tmp_path)
            if ok:
                assert got.returncode == 0, got.stderr
                assert (out.read_text() if to_file else got.stdout) == whole.stdout
                continue
            assert got.returncode == 78, got.stderr
            assert f"the export would be larger than {bound} bytes, the most `nccltune fleet decide` reads" \
                in got.stderr
            assert got.stdout == "" and not out.exists() and sorted(tmp_path.glob(".node.export.json.tmp-*")) == []


# -- decide --------------------------------------------------------------------------------------


def test_profile_pools_both_nodes(fleet: dict[str, Any]) -> None:
    prof = _json(fleet["profile"])
    validate(prof, load_schema("profile"))
    exports = [_json(n["export"]) for n in fleet["nodes"]]
    assert prof["node_class"] == exports[0]["node_class"] == exports[1]["node_class"]
    assert [n["hostname"] for n in prof["evidence"]["nodes"]] == ["gpu-node-001", "gpu-node-002"]
    ok_baselines = sum(1 for e in exports for r in e["runs"] for t in r["trials"]
                       if t["phase"] == "baseline" and t["status"] == "ok")
    assert ok_baselines == 6
    assert {s["samples"] for s in prof["evidence"]["baseline"]} == {ok_baselines}
    assert {s["collective"] for s in prof["evidence"]["baseline"]} == {"all_reduce", "all_gather"}
    assert {k.split(":")[0] for k in prof["evidence"]["rules"]["weights"]} == {"all_reduce", "all_gather"}
    # The per-size trials pooled per candidate over both nodes, judged per collective: the table's
    # entries are the wins, for one node of the class; Tree (all_reduce only) never wins all_gather.
    table = prof["evidence"]["table"]
    assert table["collectives"] == ["allreduce", "allgather"]
    assert len(table["candidates"]) == 6
    assert all(c["nodes"] == 2 and c["samples"] == 2 and c["counted"] for c in table["candidates"])
    tree = [c for c in table["candidates"] if c["label"].startswith("tree/")]
    assert len(tree) == 3 and all(c["env"]["NCCL_ALGO"] == "allreduce:Tree" for c in tree)
    assert not any(w["label"].startswith("tree/") for w in table["wins"] if w["collective"] == "allgather")
    assert {(e["collective"], e["nnodes"], e["nranks"], e["ranks_per_node"]) for e in prof["tuner_table"]} \
        <= {("allreduce", 1, 2, 2), ("allgather", 1, 2, 2)}
    assert {e["collective"] for e in prof["tuner_table"]} == {w["collective"] for w in table["wins"]}
    assert any("CPU demo" in n for n in table["notes"])
    assert f"Tuner table: {table['status']}" in fleet["decide_out"]
    assert prof["job_shape"]["ranks_per_node"] == 2 and prof["job_shape"]["max_nnodes"] is None
    assert prof["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the policy goes with any choice
    assert "NCCL_TOPO_FILE" not in prof["env"]
    assert f"Class {prof['node_class']['id']}" in fleet["decide_out"]
    for cand in prof["evidence"]["candidates"]:
        if cand["nodes"] < 2:
            assert not cand["eligible"] and "of 2 node(s)" in cand["reason"]


def test_exports_of_two_classes_are_refused_with_the_fact(fleet: dict[str, Any], tmp_path: Path) -> None:
    lost = load("h200x2-nvswitch-vm")
    lost["nvml"]["gpus"][0]["nvlinks"][3]["active"] = False
    other = _json(fleet["nodes"][1]["export"])
    other["node_class"] = node_class(from_snapshot(load_snapshot(write(lost, tmp_path / "lost.json")))).as_dict()
    (tmp_path / "other.json").write_text(json.dumps(other))
    got = nccltune("fleet", "decide", str(fleet["nodes"][0]["export"]), str(tmp_path / "other.json"),
                   "--out", str(tmp_path / "p.json"), cwd=tmp_path)
    assert got.returncode == 78
    assert "other.json" in got.stderr and "nvlink" in got.stderr
    assert not (tmp_path / "p.json").exists()


def test_malformed_exports_are_refused_with_file_and_element(fleet: dict[str, Any], tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"kind": "nccltune-export",\n  "runs": [}\n')
    got = nccltune("fleet", "decide", str(broken), "--out", str(tmp_path / "p.json"), cwd=tmp_path)
    assert got.returncode == 78 and f"{broken}:2:" in got.stderr
    bad = _json(fleet["nodes"][0]["export"])
    bad["runs"][0]["trials"][1]["measurements"][2]["busbw_gbps"] = "fast"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    got = nccltune("fleet", "decide", str(tmp_path / "bad.json"), "--out", str(tmp_path / "p.json"), cwd=tmp_path)
    assert got.returncode == 78
    assert "bad.json: $.runs[0].trials[1].measurements[2].busbw_gbps: expected number" in got.stderr
    twice = nccltune("fleet", "decide", str(fleet["nodes"][0]["export"]), str(fleet["nodes"][0]["export"]),
                     "--out", str(tmp_path / "p.json"), cwd=tmp_path)
    assert twice.returncode == 78 and "the same node" in twice.stderr


# -- apply ---------------------------------------------------------------------------------------


def _node_copy(fleet: dict[str, Any], tmp_path: Path, i: int = 0) -> Path:
    state = tmp_path / "state"
    shutil.copytree(fleet["nodes"][i]["state"], state, symlinks=True)
    return state


def test_apply_publishes_the_profile_and_env_names_it(fleet: dict[str, Any], tmp_path: Path) -> None:
    state = _node_copy(fleet, tmp_path, 1)
    before = read_published(state)
    assert before is not None
    prof = _json(fleet["profile"])
    got = nccltune("apply", str(fleet["profile"]), "--demo", str(fleet["nodes"][1]["snapshot"]),
                   "--config", str(fleet["root"] / "config.yaml"), "--state-dir", str(state), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    env, prov = read_published(state) or ({}, {})
    assert prov["generation"] == before[1]["generation"] + 1
    # The daemon's own fingerprint of this node's settings: it does not re-tune over the profile.
    assert prov["tuning_fingerprint"] == before[1]["tuning_fingerprint"]
    expected = dict(prof["env"])
    if prof["topology_file"]:
        # The generation's own copy, as every decider publishes it; the stable copy holds the same XML.
        own = state / "generations" / str(prov["generation"]) / "ncclTopology.xml"
        expected["NCCL_TOPO_FILE"] = str(own)
        assert own.read_text().startswith("<system")
        assert (state / "ncclTopology.xml").read_bytes() == own.read_bytes()
    assert env == expected
    shown = nccltune("env", "--state-dir", str(state), cwd=tmp_path)
    assert shown.returncode == 0
    assert f"class profile profile.json (class {prof['node_class']['id']}" in shown.stdout
    for name, value in expected.items():
        assert f"export {name}='{value}'" in shown.stdout


def test_a_sweep_by_hand_keeps_the_profile_in_force_published(fleet: dict[str, Any], tmp_path: Path) -> None:
    state = _node_copy(fleet, tmp_path, 1)
    common = ["--demo", str(fleet["nodes"][1]["snapshot"]), "--state-dir", str(state)]
    assert nccltune("apply", str(fleet["profile"]), *common, "--config", str(fleet["root"] / "config.yaml"),
                    cwd=tmp_path).returncode == 0
    applied = _digests(state)
    # The shortest sweep (the baselines and the topology file alone): whether a finished sweep
    # publishes depends on the profile in force, not on what the sweep searched.
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump(SHORT_CONFIG, sort_keys=False))
    got = nccltune("sweep", "--json", *common, "--config", str(short), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["published"] is None and "class profile profile.json" in doc["not_published"]
    assert _digests(state) == applied  # the class's decision stays in force, byte for byte
    with Store(state / "history.db") as store:
        run = store.runs(limit=1, kind="sweep")[0]
    assert run.id == doc["run_id"] and run.published_generation is None and run.summary["not_published"]


def _refused(fleet: dict[str, Any], tmp_path: Path, profile: Path, snapshot: str) -> subprocess.CompletedProcess[str]:
    state = _node_copy(fleet, tmp_path)
    before = _digests(state)
    got = nccltune("apply", str(profile), "--demo", snapshot, "--config", str(fleet["root"] / "config.yaml"),
                   "--state-dir", str(state), cwd=tmp_path)
    assert got.returncode == 78, got.stderr
    assert _digests(state) == before  # what was published (and the topology XML) stays byte for byte
    return got


def test_profile_of_another_class_is_refused(fleet: dict[str, Any], tmp_path: Path) -> None:
    got = _refused(fleet, tmp_path, fleet["profile"], "hgx-h100-8gpu")
    assert "profile is for node class" in got.stderr and "gpu_count: 2 (profile) vs 8 (this node)" in got.stderr


def test_stale_profile_is_refused(fleet: dict[str, Any], tmp_path: Path) -> None:
    prof = _json(fleet["profile"])
    prof["versions"]["driver"] = prof["node_class"]["facts"]["driver_version"] = "570.86.15"
    prof["node_class"]["id"] = class_id_of(prof["node_class"]["facts"])
    path = tmp_path / "stale.json"
    path.write_text(json.dumps(prof))
    got = _refused(fleet, tmp_path, path, str(fleet["nodes"][0]["snapshot"]))
    assert "stale profile: driver 570.86.15 (profile) vs 580.159.04 (this node)" in got.stderr


def test_a_nic_loopback_profile_is_never_applied(fleet: dict[str, Any], tmp_path: Path) -> None:
    prof = _json(fleet["profile"])
    prof["job_shape"].update(label="1x2-nic-loopback", loopback=True)
    path = tmp_path / "loopback.json"
    path.write_text(json.dumps(prof))
    got = _refused(fleet, tmp_path, path, str(fleet["nodes"][0]["snapshot"]))
    assert "measured through the NICs of one node" in got.stderr and "loopback.json" in got.stderr


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["env"].__setitem__("NCCL_ALGO", "Ring;rm -rf /"), "forbidden character ';'"),
    (lambda p: p.pop("tuner_table"), "$: missing required key 'tuner_table'"),
    (lambda p: p["tuner_table"].insert(0, {"collective": "allreduce"}), "$.tuner_table[0]: missing required key"),
    (lambda p: p.__setitem__("demo", False), "a GPU profile cannot be applied to a demo node"),
    (lambda p: p["node_class"]["facts"].__setitem__("gpu_count", 8), "$.node_class.id: "),
    # Off the allow-list of what may be published: NCCL's identity variables, nccltune's own, a test hook.
    (lambda p: p["env"].__setitem__("NCCL_HOSTID", "node-a"), "env: NCCL_HOSTID: names this node to NCCL"),
    (lambda p: p["env"].__setitem__("NCCL_COMM_ID", "10.0.0.1:5000"), "env: NCCL_COMM_ID: is the address of one"),
    (lambda p: p["env"].__setitem__("NCCLTUNE_WORKER_FAULT", "hang"), "env: NCCLTUNE_WORKER_FAULT: is nccltune's own"),
    (lambda p: p["env"].__setitem__("NCCLTUNE_ENV_FILE", "/x/nccl.sh"), "env: NCCLTUNE_ENV_FILE: is nccltune's own"),
    (lambda p: p["env"].__setitem__("NCCLTUNE_DISABLE", "1"), "env: NCCLTUNE_DISABLE: is nccltune's own"),
    # The publisher's own: each node's tuner files, and what names code.
    (lambda p: p["env"].__setitem__("NCCL_TUNER_PLUGIN", "/tmp/x.so"), "env: NCCL_TUNER_PLUGIN: names this node's own"),
    (lambda p: p["env"].__setitem__("NCCL_NET_PLUGIN", "/tmp/x.so"), "env: NCCL_NET_PLUGIN: nccltune does not publish"),
])
def test_malformed_or_unsafe_profile_is_refused(fleet: dict[str, Any], tmp_path: Path, change: Any,
                                                message: str) -> None:
    prof = copy.deepcopy(_json(fleet["profile"]))
    change(prof)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(prof))
    got = _refused(fleet, tmp_path, path, str(fleet["nodes"][0]["snapshot"]))
    assert message in got.stderr and "bad.json" in got.stderr


# -- the choice rules on pooled samples, without a sweep ---------------------------------------------


def _synthetic_export(host: str, base: list[float], cand: list[float], tmp_path: Path,
                      cand_env: dict[str, str], job: dict[str, Any] | None = None) -> Export:
    """One node's export of one sweep; `job`: the run's job shape (None: the node's own ranks)."""
    sizes = [1 << 20, 1 << 24]

    def trial(seq: int, phase: str, env: dict[str, str], busbw: float) -> dict[str, Any]:
        return {"seq": seq, "phase": phase, "label": "x", "env": env, "status": "ok", "reason": None, "wall_s": 1.0,
                "measurements": [{"size_bytes": s, "time_us": 1.0, "algbw_gbps": busbw, "busbw_gbps": busbw,
                                  "algo": None, "proto": None, "correct": True} for s in sizes]}

    trials = [trial(i + 1, "baseline", {}, b) for i, b in enumerate(base)]
    trials += [trial(10 + i, "final", cand_env, c) for i, c in enumerate(cand)]
    doc = h200x2_export(host, trials)
    if job is not None:
        doc["runs"][0]["job"] = job
    validate(doc, load_schema("export"))
    path = tmp_path / f"{host}.json"
    path.write_text(json.dumps(doc))
    return load_exports([path])[0]


def test_decide_leaves_out_a_candidate_apply_would_refuse(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A candidate whose environment no node may publish (here one of NCCL's identity variables)
    is no class candidate: left out with one warning, and the class keeps what may be published."""
    bad = {"NCCL_ALGO": "Ring", "NCCL_HOSTID": "node-a", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    a = _synthetic_export("a", [100, 101, 99], [130, 131], tmp_path, bad)
    b = _synthetic_export("b", [98, 100, 102], [129, 132], tmp_path, bad)
    prof = decide([a, b], Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    assert prof["chosen"] == "NCCL defaults" and "NCCL_HOSTID" not in prof["env"]
    assert prof["evidence"]["candidates"] == []
    said = [r.getMessage() for r in caplog.records if "left out of the class" in r.getMessage()]
    assert len(said) == 1 and "NCCL_HOSTID: names this node to NCCL" in said[0] and "a.json run 1 trial 10" in said[0]
    assert "NCCL_HOSTID" not in dumps_profile(prof).split('"candidates"')[0]


def test_decide_never_writes_a_profile_apply_would_refuse(tmp_path: Path) -> None:
    """The values every candidate carries (the policy) come from the exports too: a profile apply
    would refuse is refused by decide, exit 78, nothing written."""
    ring = {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    a = _synthetic_export("a", [100, 101, 99], [110, 111], tmp_path, ring)
    b = _synthetic_export("b", [98, 100, 102], [109, 112], tmp_path, ring)
    prof = decide([a, b], Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    dumps_profile(prof)  # as decided: apply takes it
    for change, message in ((lambda p: p["env"].__setitem__("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3;x"),
                             "env: TORCH_NCCL_ASYNC_ERROR_HANDLING: value contains the forbidden character ';'"),
                            (lambda p: p["env"].update({f"NCCL_X{i}": "1" for i in range(300)}),
                             "$.env: 302 variables; at most 256"),
                            (lambda p: p.__setitem__("chosen", "x" * 5000), "$.chosen: 5000 characters"),
                            (lambda p: p["env"].__setitem__("NCCL_TOPO_FILE", "/x.xml"),
                             "NCCL_TOPO_FILE: is set per node")):
        bad = copy.deepcopy(prof)
        change(bad)
        with pytest.raises(InputError, match=re.escape(message)) as err:
            dumps_profile(bad)
        assert err.value.exit_code == 78 and "fleet decide: the profile" in str(err.value)
        assert "`nccltune apply` would refuse it" in str(err.value)


def test_pooled_samples_go_through_the_sweeps_rules(tmp_path: Path) -> None:
    ring = {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    a = _synthetic_export("a", [100, 101, 99], [110, 111], tmp_path, ring)
    b = _synthetic_export("b", [98, 100, 102], [109, 112], tmp_path, ring)
    rules = Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0)
    prof = decide([a, b], rules)
    validate(prof, load_schema("profile"))
    assert prof["env"] == ring and prof["chosen"] == "NCCL_ALGO=Ring"
    (cand,) = prof["evidence"]["candidates"]
    assert cand["eligible"] and cand["nodes"] == 2 and cand["gain_pct"] > 8
    assert {s["samples"] for s in cand["per_size"]} == {4}
    # The same candidate slower by 5% beyond the noise at every size: the max-regression rule vetoes it.
    slow = _synthetic_export("c", [100, 100, 100], [95, 95], tmp_path, ring)
    slow2 = _synthetic_export("d", [100, 100, 100], [95, 95], tmp_path, ring)
    prof = decide([slow, slow2], rules)
    assert prof["chosen"] == "NCCL defaults"
    assert "slower than the defaults" in prof["evidence"]["candidates"][0]["reason"]
    assert prof["env"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    # These exports are of the older form, without a collective per measurement: all_reduce's.
    assert {s["collective"] for s in prof["evidence"]["baseline"]} == {"all_reduce"}
    assert set(prof["evidence"]["rules"]["weights"]) == {"all_reduce:1048576", "all_reduce:16777216"}
    assert prof["tuner_table"] == [] and prof["evidence"]["table"]["status"].startswith("no per-size trials")


# -- the tuner table from pooled per-size trials ----------------------------------------------------

KIB, MIB = 1 << 10, 1 << 20
TABLE_SIZES = [64 * KIB, MIB, 16 * MIB]
BOTH = {"both": {"all_reduce": {MIB: 1.0, 16 * MIB: 1.0}, "all_gather": {64 * KIB: 1.0, MIB: 1.0}}}


def _per_size_export(host: str, tmp_path: Path, *, legacy: bool = False) -> Export:
    """A node's export with the per-size stage's trials: ring/ll wins all_gather at 64 KiB, Tree/LL128
    (all_reduce only) all_reduce at 16 MiB, 24 channels (above the defaults' 16) all_reduce at 1 MiB.
    `legacy`: as an older export writes it (no collective, channels or channel count: all_reduce only)."""
    from nccltune.sweep.pertable import SizeCandidate

    collectives = ["all_reduce"] if legacy else ["all_reduce", "all_gather"]
    seq = 0

    def trial(phase: str, label: str, env: dict[str, str], speed: dict[tuple[str, int], float]) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        jitter = 1.0 + 0.003 * (seq % 3 - 1)
        rows = []
        for c in collectives:
            for size in TABLE_SIZES:
                bw = speed.get((c, size), 100.0) * jitter
                row = {"collective": c, "size_bytes": size, "time_us": 1.0, "algbw_gbps": bw, "busbw_gbps": bw,
                       "algo": "RING", "proto": "LL" if size < MIB else "SIMPLE", "channels": 16, "correct": True}
                rows.append({k: v for k, v in row.items() if k not in ("collective", "channels")} if legacy else row)
        doc = {"seq": seq, "phase": phase, "label": label, "env": env, "status": "ok", "reason": None, "wall_s": 1.0,
               "measurements": rows}
        if not legacy:
            doc["coll_channels"] = 16
        return doc

    common = {"NCCL_TOPO_FILE": f"/var/lib/{host}/runs/00001/ncclTopology.xml", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    trials = [trial("baseline", f"defaults #{i}", {}, {}) for i in (1, 2, 3)]
    ring, tree = SizeCandidate("ring", "ll"), SizeCandidate("tree", "ll128", only=() if legacy else ("all_reduce",))
    for cand, speed in ((ring, {("all_gather", 64 * KIB): 120.0}),
                        # Tree's trial: all_gather ran with NCCL's own choice, whatever it measured.
                        (tree, {("all_reduce", 16 * MIB): 125.0, ("all_gather", MIB): 150.0}),
                        (SizeCandidate(channels=24), {("all_reduce", MIB): 130.0})):
        trials.append(trial("screen", f"per size: {cand.label}", {**common, **cand.env()}, speed))
    # The node's own whole result names its own plugin and table: never a class candidate.
    own = {**common, "NCCL_TUNER_PLUGIN": f"/var/lib/{host}/runs/00001/libnccl-tuner-nccltune.so",
           "NCCLTUNE_TUNER_TABLE": f"/var/lib/{host}/runs/00001/tuner-table.txt",
           "NCCLTUNE_TUNER_FINGERPRINT": "ab" * 8}
    trials += [trial("final", f"environment + tuner table #{i}", own, {}) for i in (1, 2)]
    doc = h200x2_export(host, trials)
    validate(doc, load_schema("export"))
    path = tmp_path / f"{host}.json"
    path.write_text(json.dumps(doc))
    return load_exports([path])[0]


def test_the_class_table_pools_per_collective_and_size(tmp_path: Path) -> None:
    import math

    exports = [_per_size_export(h, tmp_path) for h in ("a", "b")]
    prof = decide(exports, Rules("both", min_gain_pct=1.0, max_regression_pct=2.0, custom_profiles=BOTH))
    validate(prof, load_schema("profile"))
    table = prof["evidence"]["table"]
    assert table["collectives"] == ["allreduce", "allgather"] and table["default_channels"] == 16
    assert all(c["counted"] and c["nodes"] == 2 and c["samples"] == 2 for c in table["candidates"])
    wins = {(w["collective"], w["size_bytes"]): w["label"] for w in table["wins"]}
    assert wins == {("allgather", 64 * KIB): "ring/ll", ("allreduce", 16 * MIB): "tree/ll128 (allreduce only)"}
    assert prof["tuner_table"] == [
        {"collective": "allreduce", "min_bytes": math.isqrt(MIB * 16 * MIB), "max_bytes": 16 * MIB, "nnodes": 1,
         "nranks": 2, "ranks_per_node": 2, "algo": "tree", "proto": "ll128", "channels": None},
        # all_gather's range in NCCL's own count, one rank's block of the 2 ranks' measured sizes
        {"collective": "allgather", "min_bytes": 64 * KIB // 2, "max_bytes": (math.isqrt(64 * KIB * MIB) - 1) // 2,
         "nnodes": 1,
         "nranks": 2, "ranks_per_node": 2, "algo": "ring", "proto": "ll", "channels": None}]
    # The raise that won all_reduce at 1 MiB is a single-node setting: not in a class profile.
    assert any("24 channels won at allreduce 1MiB" in n and "any number of nodes" in n for n in table["notes"])
    # No node's own whole result (its plugin and table paths) is a candidate for the class environment.
    assert not any("NCCL_TUNER_PLUGIN" in c["env"] for c in prof["evidence"]["candidates"])
    assert "NCCL_TUNER_PLUGIN" not in prof["env"]
    # Judged with the profile's weights per collective and size.
    assert prof["evidence"]["rules"]["weights"]["all_gather:65536"] == 1.0
    assert prof["evidence"]["rules"]["weights"]["all_reduce:65536"] == 0.0
    # A candidate one node did not measure does not count.
    partial = _json(exports[1].path)
    partial["runs"][0]["trials"] = [t for t in partial["runs"][0]["trials"] if "ring/ll" not in t["label"]]
    (tmp_path / "b2.json").write_text(json.dumps(partial))
    prof = decide([exports[0], *load_exports([tmp_path / "b2.json"])],
                  Rules("both", min_gain_pct=1.0, max_regression_pct=2.0, custom_profiles=BOTH))
    ring = next(c for c in prof["evidence"]["table"]["candidates"] if c["label"] == "ring/ll")
    assert (ring["nodes"], ring["counted"]) == (1, False)
    assert {e["collective"] for e in prof["tuner_table"]} == {"allreduce"}


def test_older_exports_without_collectives_pool_as_all_reduce(tmp_path: Path) -> None:
    exports = [_per_size_export(h, tmp_path, legacy=True) for h in ("a", "b")]
    prof = decide(exports, Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    validate(prof, load_schema("profile"))
    assert {s["collective"] for s in prof["evidence"]["baseline"]} == {"all_reduce"}
    table = prof["evidence"]["table"]
    assert table["collectives"] == ["allreduce"] and table["default_channels"] is None
    assert [(e["collective"], e["algo"], e["proto"]) for e in prof["tuner_table"]] == [("allreduce", "tree", "ll128")]
    # Without the defaults' channel count a channel candidate cannot be placed above or below it.
    assert any("channel count" in n for n in table["notes"])


def test_apply_builds_the_plugin_for_the_profiles_table(tmp_path: Path) -> None:
    from nccltune.config import Config, TunerConfig
    from nccltune.fleet.classtable import profile_tuner
    from nccltune.tuner.build import find_compiler
    from nccltune.tuner.table import parse_table

    exports = [_per_size_export(h, tmp_path) for h in ("a", "b")]
    unkeyed = decide(exports, Rules("both", min_gain_pct=1.0, max_regression_pct=2.0, custom_profiles=BOTH))
    fp = "0123456789abcdef"
    # A table applies only to the NCCL it was measured with: a profile that names none is refused.
    assert unkeyed["versions"]["nccl"] is None
    with pytest.raises(InputError, match=r"versions\.nccl: the profile names no NCCL version") as no_version:
        profile_tuner(Config(), unkeyed, "p.json", fp, {})
    assert no_version.value.exit_code == 78
    prof = {**unkeyed, "versions": {**unkeyed["versions"], "nccl": "2.28.9"}}
    if find_compiler() is not None:
        tuner, note = profile_tuner(Config(), prof, "p.json", fp, {})
        assert tuner is not None and note == "tuner table of 2 entries"
        table = parse_table(tuner.table_text, "t")
        assert table.fingerprint == fp  # the node's own tuning fingerprint, which the plugin checks
        assert table.versions() == ("2.28.9",)  # the class's NCCL: the table's one section
        assert [(e.collective, e.algo, e.proto, e.min_bytes) for e in table.entries] == [
            (e["collective"], e["algo"], e["proto"], e["min_bytes"]) for e in prof["tuner_table"]]
        assert tuner.plugin_bytes().startswith(b"\x7fELF")
    kept, why = profile_tuner(Config(tuner=TunerConfig("keep")), prof, "p.json", fp, {})
    assert kept is None and why is not None and "tuner.plugin is keep" in why
    foreign = {"NCCL_TUNER_PLUGIN": "/opt/site/libnccl-tuner-site.so", "NCCL_CONF_FILE": "/nonexistent"}
    kept, why = profile_tuner(Config(), prof, "p.json", fp, foreign)
    assert kept is None and why is not None and "already set and kept" in why
    kept, why = profile_tuner(Config(), {**prof, "demo": True}, "p.json", fp, {})
    assert kept is None and why is not None and "CPU demo" in why
    assert profile_tuner(Config(), {**prof, "tuner_table": []}, "p.json", fp, {}) == (None, None)
    overlapping = {**prof, "tuner_table": [prof["tuner_table"][0], prof["tuner_table"][0]]}
    with pytest.raises(InputError, match="tuner_table: entry 1: size range overlaps entry 0") as exc:
        profile_tuner(Config(), overlapping, "p.json", fp, {})
    assert exc.value.exit_code == 78


def test_a_profile_is_for_the_job_shape_its_runs_measured(tmp_path: Path) -> None:
    from nccltune.errors import InputError

    ring = {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    rules = Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0)

    def export(host: str, job: dict[str, Any] | None) -> Export:
        return _synthetic_export(host, [100, 101, 99], [110, 111], tmp_path, ring, job)

    # A node's own sweep: one node measured, the values fit jobs of any number of these nodes.
    single = decide([export("a", None), export("b", None)], rules)
    assert single["job_shape"] == {"ranks_per_node": 2, "measured_nnodes": 1, "min_nnodes": 1, "max_nnodes": None,
                                   "label": "1x2", "loopback": False}
    # A sweep over two nodes (its coordinator's export): for jobs of that shape.
    two = {"label": "2x4", "nnodes": 2, "ranks_per_node": 4, "loopback": False, "launcher": "torchrun"}
    prof = decide([export("c", two)], rules)
    validate(prof, load_schema("profile"))
    assert prof["job_shape"] == {"ranks_per_node": 4, "measured_nnodes": 2, "min_nnodes": 2, "max_nnodes": 2,
                                 "label": "2x4", "loopback": False}
    loop = {"label": "2x1-nic-loopback", "nnodes": 2, "ranks_per_node": 1, "loopback": True, "launcher": "local"}
    prof = decide([export("d", loop)], rules)
    validate(prof, load_schema("profile"))
    assert prof["job_shape"]["label"] == "2x1-nic-loopback" and prof["job_shape"]["loopback"] is True
    # Shapes do not pool, whichever comes first; the reason names both and where they are.
    with pytest.raises(InputError, match=r"runs of different job shapes \(2x4 in .*c\.json run 1, 1x2 here\)"):
        decide([export("c", two), export("a", None)], rules)
    with pytest.raises(InputError, match=r"different job shapes \(2x1-nic-loopback in .*d\.json run 1, 2x4 here"):
        decide([export("d", loop), export("c", two)], rules)


# -- the schema files ----------------------------------------------------------------------------------


def test_schema_files_are_the_ones_the_code_reads() -> None:
    for name in ("export", "profile"):
        shipped = (ROOT / "schemas" / f"{name}.schema.json").read_bytes()
        assert shipped == (SCHEMA_DIR / f"{name}.schema.json").read_bytes()
        assert json.loads(shipped)["$schema"].startswith("https://json-schema.org/")
    with pytest.raises(SchemaViolation, match=r"\$\.tuner_table\[0\]\.nnodes: 0 is below the minimum 1"):
        doc = {"collective": "allreduce", "min_bytes": 0, "max_bytes": 1, "nnodes": 0, "nranks": 8,
               "ranks_per_node": 8, "algo": "ring", "proto": "simple", "channels": None}
        validate({"tuner_table": [doc]}, {"type": "object", "properties": {"tuner_table": {
            "type": "array", "items": load_schema("profile")["$defs"]["tuner_entry"]}}})
    with pytest.raises(ValueError, match="unsupported keyword"):
        validate(1, {"oneOf": []})


def test_apply_picks_this_classes_profile_from_a_directory(fleet: dict[str, Any], tmp_path: Path) -> None:
    prof = _json(fleet["profile"])
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    state = _node_copy(fleet, tmp_path)
    run = ("apply", str(profiles), "--demo", str(fleet["nodes"][0]["snapshot"]), "--config",
           str(fleet["root"] / "config.yaml"), "--state-dir", str(state))
    before = _digests(state)
    missing = nccltune(*run, cwd=tmp_path)
    assert missing.returncode == 78 and f"no profile for this node's class {prof['node_class']['id']}" in missing.stderr
    assert _digests(state) == before
    shutil.copy(fleet["profile"], profiles / f"{prof['node_class']['id']}.json")
    got = nccltune(*run, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert (read_published(state) or ({}, {}))[1]["note"].startswith(f"class profile {prof['node_class']['id']}.json")


def test_export_of_a_gpu_node_swept_without_nics(tmp_path: Path) -> None:
    """The sweep fingerprints the tree it used (topology.with_nics: false leaves NICs out); the
    class still counts the NICs, and NCCL versions of older runs keep them out of the export."""
    from nccltune.fleet.export import build_export, node_identity
    from nccltune.fleet.member import FleetNode
    from nccltune.records import Measurement
    from nccltune.store import Store
    from nccltune.topology.fingerprint import topology_fingerprint

    snap = load_snapshot(ROOT / "topologies" / "hgx-h100-8gpu.json")
    bare, full = from_snapshot(snap, with_nics=False), from_snapshot(snap)
    with Store(tmp_path / "history.db") as store:
        for nccl in ("2.27.3", "2.28.9"):
            run = store.start_run(kind="sweep", fingerprint=topology_fingerprint(bare), backend="nccl", demo=False,
                                  profile="balanced", nccl_version=nccl, driver_version=full.driver_version,
                                  torch_version="2.9.0", nccltune_version="0.2.0", hostname="gpu001",
                                  topology={"gpus": 8}, config={"bench": {"nranks": None, "gpus": None}})
            store.add_trial(run, seq=1, phase="baseline", label="defaults #1", env={}, status="ok", reason=None,
                            wall_s=1.0, nccl=None, measurements=[Measurement(1 << 20, 10.0, 100.0, 175.0)])
            store.finish_run(run, status="ok", chosen_env={}, published_generation=1)
        doc = build_export(store, node_identity(FleetNode(bare, full, False)))
    validate(doc, load_schema("export"))
    assert doc["topology_fingerprint"] == topology_fingerprint(bare)
    assert doc["node_class"]["id"] == node_class(full, nccl_version="2.28.9").id
    assert len(doc["node_class"]["facts"]["nics"]) == 8
    assert [r["nccl_version"] for r in doc["runs"]] == ["2.28.9"] and doc["runs"][0]["nranks"] == 8
    assert doc["versions"] == {"nccltune": doc["versions"]["nccltune"], "nccl": "2.28.9",
                               "driver": full.driver_version, "torch": "2.9.0"}


def test_topo_and_export_name_the_same_class(fleet: dict[str, Any]) -> None:
    node = fleet["nodes"][0]
    exported = _json(node["export"])["node_class"]["id"]
    got = nccltune("topo", "--demo", str(node["snapshot"]), "--json", cwd=fleet["root"])
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["node_class"]["id"] == exported
    assert doc["node_class_nccl"] == {"version": None, "source": "a CPU demo runs no NCCL"}
    text = nccltune("topo", "--demo", str(node["snapshot"]), cwd=fleet["root"]).stdout
    assert f"Node class: {exported} (no NCCL version: a CPU demo runs no NCCL)" in text


def test_the_class_takes_the_nccl_version_the_worker_reports(tmp_path: Path) -> None:
    """On a GPU node `topo` (and the daemon, and the metrics) take the NCCL version from the worker
    interpreter; an export takes the one the worker reported in its runs: one definition."""
    from nccltune.config import Config, with_overrides
    from nccltune.fleet.member import FleetNode, worker_nccl

    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps({{'event': 'probe', 'torch_version': '2.9.0', "
                    "'nccl_version': '2.28.9', 'nccl_lib': None}))\n")
    fake.chmod(0o755)
    got = worker_nccl(with_overrides(Config(), **{"bench.python": str(fake)}), False)
    assert got.version == "2.28.9" and got.source == f"as the worker interpreter {fake} reports it"
    assert worker_nccl(Config(), True).version is None  # the CPU demo runs no NCCL
    topo = from_snapshot(load_snapshot(ROOT / "topologies" / "hgx-h100-8gpu.json"))
    gpu_node = FleetNode(topo, topo, False)
    assert gpu_node.node_class(got.version).id == node_class(topo, nccl_version="2.28.9").id
    assert gpu_node.node_class(got.version).id != gpu_node.node_class(None).id
    assert FleetNode(topo, topo, True).node_class("2.28.9").id == node_class(topo).id
