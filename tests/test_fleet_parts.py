"""A class profile's parts per measured node count and sections per NCCL version, on the CPU: exports
with sweeps of 1, 2 and 4 nodes, and of two NCCL versions, decided, applied, and what a job of 1, 2,
3 and 8 nodes gets (publish.shapes.part_for_shape, the one rule)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from test_job_precedence import PROLOG, apply_like_slurm, base_env, nccl_part, run_wrapper

from nccltune.config import Config
from nccltune.errors import InputError
from nccltune.fleet.decide import Rules, decide, dumps_profile, load_exports
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.fleet.parts import section_for, sections, shape_envs, summary_lines
from nccltune.publish.shapes import part_for_shape
from nccltune.topology.source import bundled_topologies_dir
from tests.fleet_fixtures import shaped_runs_export


def decide_for(published: Any, job: dict[str, str], nnodes: int | None) -> dict[str, str]:
    """What jobenv.decide gives a job whose own environment is `job`, of `nnodes` nodes."""
    from nccltune.delivery.jobenv import decide as decide_job
    from nccltune.publish.readback import job_env

    return decide_job(job_env(published, nnodes), job, published.set_id).environment(job)

RULES = Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0)
POLICY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
BUFF = {"NCCL_BUFFSIZE": "8388608"}  # chosen alike for every shape: the safe part
BASE = [100.0, 101.0, 99.0, 100.0, 102.0]
WIN = [113.0, 112.0, 114.0, 113.0]
LOSE = [90.0, 91.0, 89.0, 90.0]
# The finalist of each shape: Ring wins on one node, Tree on 2 nodes, the Simple protocol on 4.
RING = {**POLICY, **BUFF, "NCCL_ALGO": "Ring"}
TREE = {**POLICY, **BUFF, "NCCL_ALGO": "Tree"}
SIMPLE = {**POLICY, **BUFF, "NCCL_PROTO": "Simple"}


def _write(tmp_path: Path, docs: dict[str, dict[str, Any]]) -> list[Path]:
    paths = []
    for name, doc in docs.items():
        validate(doc, load_schema("export"))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    return paths


def _shaped(tmp_path: Path, *, demo: bool = False) -> list[Path]:
    """Nodes a and b swept on their own; a also coordinated a 2-node and a 4-node sweep."""
    return _write(tmp_path, {
        "a": shaped_runs_export("a", {1: (BASE, WIN, RING), 2: (BASE, WIN, TREE), 4: (BASE, WIN, SIMPLE)}, demo=demo),
        "b": shaped_runs_export("b", {1: (BASE, WIN, RING)}, demo=demo)})


def test_decide_makes_one_part_per_measured_node_count(tmp_path: Path) -> None:
    prof = decide(load_exports(_shaped(tmp_path)), RULES, by_node_count=True)
    validate(prof, load_schema("profile"))
    assert prof["schema_version"] == 2
    parts = {p["nnodes"]: p for p in prof["parts"]}
    assert sorted(parts) == [1, 2, 4]
    assert parts[1]["env"] == RING and parts[2]["env"] == TREE and parts[4]["env"] == SIMPLE
    # Each part is decided from the runs of its node count alone: two nodes' single-node sweeps,
    # one coordinator's run for 2 and for 4 nodes.
    assert parts[1]["node_count"] == 2 and parts[1]["trials"] == {"baseline": 10, "candidate": 8}
    assert parts[2]["node_count"] == 1 and parts[2]["trials"] == {"baseline": 5, "candidate": 4}
    assert [p["job_shape"]["label"] for p in prof["parts"]] == ["1x2", "2x2", "4x2"]
    assert all(p["chosen"] != "NCCL defaults" for p in prof["parts"])
    # The safe part: what every part chose alike; the top level is the single-node part's evidence.
    assert prof["env"] == {**POLICY, **BUFF}
    assert prof["evidence"]["node_count"] == 2 and prof["job_shape"]["measured_nnodes"] == 1
    assert prof["nccl_sections"][0]["parts"] == prof["parts"]
    dumps_profile(prof)  # within what apply accepts
    lines = summary_lines(prof)  # what `fleet decide` prints beyond the top level's verdict
    assert [line.split(":")[0] for line in lines] == [
        "NCCL unknown, 1 node(s) (1x2, 2 node(s) measured)", "NCCL unknown, 2 node(s) (2x2, 1 node(s) measured)",
        "NCCL unknown, 4 node(s) (4x2, 1 node(s) measured)", "NCCL unknown"]
    assert lines[-1].endswith("NCCL_BUFFSIZE=8388608, TORCH_NCCL_ASYNC_ERROR_HANDLING=3")

    safe, by_count = shape_envs(prof)
    got = {n: part_for_shape(safe, by_count, n) for n in (None, 1, 2, 3, 8)}
    assert got[None] == {**POLICY, **BUFF}
    assert got[1] == RING
    assert got[2] == got[3] == TREE  # the largest measured count <= the job's
    assert got[8] == SIMPLE


def test_a_part_that_loses_keeps_the_defaults_for_its_shape(tmp_path: Path) -> None:
    paths = _write(tmp_path, {
        "a": shaped_runs_export("a", {1: (BASE, WIN, RING), 2: (BASE, LOSE, TREE)}),
        "b": shaped_runs_export("b", {1: (BASE, WIN, RING)})})
    prof = decide(load_exports(paths), RULES, by_node_count=True)
    parts = {p["nnodes"]: p for p in prof["parts"]}
    assert parts[1]["env"] == RING and parts[2]["chosen"] == "NCCL defaults" and parts[2]["env"] == POLICY
    safe, by_count = shape_envs(prof)
    assert safe == POLICY  # Ring was never measured to hold across nodes: not in the safe part
    assert part_for_shape(safe, by_count, 2) == POLICY and part_for_shape(safe, by_count, 1) == RING


def test_one_shape_keeps_the_profile_of_one_group(tmp_path: Path) -> None:
    paths = _write(tmp_path, {h: shaped_runs_export(h, {1: (BASE, WIN, RING)}) for h in ("a", "b")})
    prof = decide(load_exports(paths), RULES, by_node_count=True)
    assert prof["schema_version"] == 1 and "parts" not in prof and "nccl_sections" not in prof
    assert prof["env"] == RING and sections(prof)[0]["env"] == RING
    assert shape_envs(sections(prof)[0]) == (RING, {})


def test_parts_differ_in_node_count_alone(tmp_path: Path) -> None:
    doc = shaped_runs_export("a", {1: (BASE, WIN, RING), 2: (BASE, WIN, TREE)})
    doc["runs"][1]["job"].update(label="2x1", ranks_per_node=1)
    with pytest.raises(InputError, match=r"runs of different job shapes \(1x2 in .*a\.json run 1, 2x1 here\)") as exc:
        decide(load_exports(_write(tmp_path, {"a": doc})), RULES, by_node_count=True)
    assert exc.value.exit_code == 78


def test_parts_are_asked_for_else_a_profile_has_one_shape(tmp_path: Path) -> None:
    paths = _write(tmp_path, {"a": shaped_runs_export("a", {1: (BASE, WIN, RING), 2: (BASE, WIN, TREE)}),
                              "b": shaped_runs_export("b", {1: (BASE, WIN, TREE)}, nccl="2.28.9"),
                              "c": shaped_runs_export("c", {1: (BASE, WIN, RING)}, nccl="2.27.7")})
    with pytest.raises(InputError, match=r"runs of different job shapes \(1x2 in .*a\.json run 1, 2x2 here\)") as exc:
        decide(load_exports(paths[:1]), RULES)
    assert "a part per node count with --parts" in str(exc.value)
    # NCCL versions are never pooled, asked or not: a section each, of its runs' one shape.
    prof = decide(load_exports(paths[1:]), RULES)
    validate(prof, load_schema("profile"))
    assert [(s["nccl"], [p["nnodes"] for p in s["parts"]], s["env"]) for s in prof["nccl_sections"]] == [
        ("2.28.9", [1], TREE), ("2.27.7", [1], RING)]
    assert shape_envs(prof["nccl_sections"][1]) == (RING, {1: {}})


def _versions(tmp_path: Path, *, demo: bool = False) -> list[Path]:
    """Two nodes on NCCL 2.27.7, where Ring wins, two on 2.28.9, where Tree wins (and Ring loses)."""
    old = {h: shaped_runs_export(h, {1: (BASE, WIN, RING)}, nccl="2.27.7", demo=demo) for h in ("a", "b")}
    new = {h: shaped_runs_export(h, {1: (BASE, WIN, TREE), 2: (BASE, WIN, SIMPLE)}, nccl="2.28.9", demo=demo)
           for h in ("c", "d")}
    # Node a again after its upgrade: one node, two versions, never pooled.
    new["a-upgraded"] = shaped_runs_export("a", {1: (BASE, WIN, TREE)}, nccl="2.28.9", demo=demo)
    return _write(tmp_path, {**old, **new})


def test_decide_keeps_one_section_per_nccl_version(tmp_path: Path) -> None:
    prof = decide(load_exports(_versions(tmp_path)), RULES, by_node_count=True)
    validate(prof, load_schema("profile"))
    got = {s["nccl"]: s for s in prof["nccl_sections"]}
    assert [s["nccl"] for s in prof["nccl_sections"]] == ["2.28.9", "2.27.7"]  # newest first: the top level
    assert prof["versions"]["nccl"] == "2.28.9" and prof["node_class"] == got["2.28.9"]["node_class"]
    assert got["2.27.7"]["node_class"]["id"] != got["2.28.9"]["node_class"]["id"]
    assert got["2.27.7"]["node_class"]["facts"]["nccl_version"] == "2.27.7"
    assert [(p["nnodes"], p["node_count"], p["env"]) for p in got["2.27.7"]["parts"]] == [(1, 2, RING)]
    assert [(p["nnodes"], p["node_count"], p["env"]) for p in got["2.28.9"]["parts"]] == [(1, 3, TREE),
                                                                                         (2, 2, SIMPLE)]
    # A node of either version sees its own section; of a third, the profile as it is (stale to apply).
    assert section_for(prof, "2.27.7")["env"] == RING and section_for(prof, "2.27.7")["versions"]["nccl"] == "2.27.7"
    assert section_for(prof, "2.28.9")["env"] == {**POLICY, **BUFF}
    assert section_for(prof, "2.29.1") is prof
    dumps_profile(prof)


def test_apply_writes_every_versions_section_for_the_plugins(tmp_path: Path) -> None:
    from nccltune.fleet.classtable import profile_env_text, profile_table
    from nccltune.tuner.envfile import parse_env_file

    prof = decide(load_exports(_versions(tmp_path)), RULES, by_node_count=True)
    entry = {"collective": "allreduce", "min_bytes": 0, "max_bytes": 1048575, "nnodes": 1, "nranks": 2,
             "ranks_per_node": 2, "algo": "ring", "proto": "ll128", "channels": None}
    prof["nccl_sections"][1]["tuner_table"] = [entry]
    view = section_for(prof, "2.27.7")
    table = profile_table(view, "p.json", "0123456789abcdef")
    assert table.versions() == ("2.27.7",)  # 2.28.9 has no entry: its NCCL decides
    prof["nccl_sections"][0]["tuner_table"] = [{**entry, "algo": "tree"}]
    table = profile_table(section_for(prof, "2.27.7"), "p.json", "0123456789abcdef")
    assert table.versions() == ("2.27.7", "2.28.9")
    assert [(e.nccl, e.algo) for e in table.entries] == [("2.27.7", "ring"), ("2.28.9", "tree")]
    values = parse_env_file(profile_env_text(prof, "p.json") or "", "env")
    assert {(v.nccl, v.scope, v.name, v.value) for v in values} == {
        ("2.28.9", "all", "NCCL_BUFFSIZE", "8388608"), ("2.28.9", "single", "NCCL_ALGO", "Tree"),
        ("2.28.9", "multi", "NCCL_PROTO", "Simple"),
        ("2.27.7", "all", "NCCL_BUFFSIZE", "8388608"), ("2.27.7", "all", "NCCL_ALGO", "Ring")}
    one = tmp_path / "one"
    one.mkdir()
    one_version = decide(load_exports(_shaped(one)), RULES, by_node_count=True)
    assert profile_env_text(one_version, "p.json") is None  # the env files carry it


def test_a_node_applies_the_section_of_its_nccl(tmp_path: Path) -> None:
    from nccltune.fleet.apply import ProfileRefused, check_profile

    prof = decide(load_exports(_versions(tmp_path)), RULES, by_node_count=True)
    node = _gpu_node(tmp_path)
    check_profile(prof, "p.json", node, "2.27.7")
    check_profile(prof, "p.json", node, "2.28.9")
    with pytest.raises(ProfileRefused, match=r"stale profile: NCCL 2\.28\.9 \(profile\) vs 2\.29\.1") as exc:
        check_profile(prof, "p.json", node, "2.29.1")
    assert exc.value.code == "stale"


def test_apply_publishes_every_part_end_to_end(tmp_path: Path) -> None:
    """decide -> apply -> what a job of 1, 2, 3 and 8 nodes gets from the published set, as
    read_set/job_env give it and as each shell launcher applies it (its files and their lists)."""
    from nccltune.fleet.apply import apply_profile
    from nccltune.publish.readback import job_env, read_set

    prof = decide(load_exports(_shaped(tmp_path, demo=True)), RULES, by_node_count=True)
    path = tmp_path / "profile.json"
    path.write_text(dumps_profile(prof))
    cfg = Config(state_dir=str(tmp_path / "state"))
    got = apply_profile(cfg, path, demo=str(bundled_topologies_dir() / "h200x2-nvswitch-vm.json"))
    assert "not in the published set" not in got.note
    assert got.published.nodes_env == {2: {"NCCL_ALGO": "Tree"}, 4: {"NCCL_PROTO": "Simple"}}
    published = read_set(cfg.publish_dir)
    assert published is not None
    own = {k: v for k, v in published.env.items() if k.startswith("NCCLTUNE_")}
    assert published.single_node_env == {"NCCL_ALGO": "Ring"}
    assert published.nodes_env == {2: {"NCCL_ALGO": "Tree"}, 4: {"NCCL_PROTO": "Simple"}}
    assert all("# node counts: 2 4\n" in published.texts[name] for name in ("nccl.sh", "nccl.env"))
    doc = json.loads(published.texts["nccl.json"])
    validate(doc, json.loads((REPO / "schemas" / "env.schema.json").read_text()))
    assert doc["scopes"]["nodes_2"]["files"] == ["nccl-nodes-2.sh", "nccl-nodes-2.env"]
    assert "2 to 3 nodes" in doc["scopes"]["nodes_2"]["applies_to"]
    assert "4 nodes or more" in doc["scopes"]["nodes_4"]["applies_to"]
    safe, by_count = shape_envs(section_for(prof, None))
    for nnodes, tuned in ((None, {**POLICY, **BUFF}), (1, RING), (2, TREE), (3, TREE), (8, SIMPLE)):
        assert job_env(published, nnodes) == {**tuned, **own} == {**part_for_shape(safe, by_count, nnodes), **own}
    if os.geteuid() != 0:
        return  # the launchers trust only root-owned files
    state = Path(cfg.publish_dir)
    for parent in (state, *state.parents):
        if parent == tmp_path.parent:
            break
        parent.chmod(0o755)
    for nnodes in (1, 2, 3, 8):
        wanted = nccl_part(decide_for(published, {}, nnodes))
        ran = run_wrapper("sh", tmp_path, state, ["--nnodes", str(nnodes), "train.py"], {})
        assert nccl_part(dict(item.decode().split("=", 1) for item in ran.stdout.split(b"\0") if item)) == wanted
        prolog = subprocess.run(["sh", str(PROLOG), str(state / "nccl.env")], capture_output=True, text=True,
                                timeout=60, check=True, env=base_env(SLURM_JOB_NUM_NODES=str(nnodes)))
        assert nccl_part(apply_like_slurm({}, prolog.stdout)) == wanted


def _gpu_node(tmp_path: Path) -> Any:
    from nccltune.fleet.member import load_fleet_node

    demo = load_fleet_node(Config(state_dir=str(tmp_path / "state")), str(bundled_topologies_dir()
                                                                           / "h200x2-nvswitch-vm.json"))
    return dataclasses.replace(demo, demo=False)  # the recorded GPU node, its NCCL as the worker reports it


def test_each_node_publishes_its_nccls_section_and_every_section_for_the_plugins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes, on NCCL 2.27.7 and 2.28.9, apply one profile: each publishes its own version's
    parts, and both the tuner table and the env plugin's file with both versions' sections."""
    from nccltune.fleet import classtable as fleet_table
    from nccltune.fleet.apply import publish_loaded, read_profile
    from nccltune.publish.readback import job_env, read_set
    from nccltune.tuner.build import ENV_PLUGIN, BuildResult
    from nccltune.tuner.envfile import parse_env_file
    from nccltune.tuner.table import parse_table

    def built(out_dir: Path, **_kw: Any) -> BuildResult:  # no compiler run: a stand-in library
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "lib.so").write_bytes(b"\x7fELF stand-in")
        return BuildResult(True, out_dir / "lib.so", "cc", what=ENV_PLUGIN.what)

    monkeypatch.setattr(fleet_table, "build_plugin", built)
    monkeypatch.setattr(fleet_table, "build_env_plugin", built)
    prof = decide(load_exports(_versions(tmp_path)), RULES, by_node_count=True)
    entry = {"collective": "allreduce", "min_bytes": 0, "max_bytes": 1048575, "nnodes": 1, "nranks": 2,
             "ranks_per_node": 2, "algo": "ring", "proto": "ll128", "channels": None}
    for section, algo in zip(prof["nccl_sections"], ("tree", "ring"), strict=True):
        section["tuner_table"] = [{**entry, "algo": algo}]
    prof["tuner_table"] = prof["nccl_sections"][0]["tuner_table"]
    path = tmp_path / "profile.json"
    path.write_text(dumps_profile(prof))
    node = _gpu_node(tmp_path)
    for nccl, single_node, every_job in (("2.27.7", {}, RING), ("2.28.9", {"NCCL_ALGO": "Tree"}, {**POLICY, **BUFF})):
        cfg = Config(state_dir=str(tmp_path / f"state-{nccl}"))
        publish_loaded(cfg, node, nccl, read_profile(path))
        published = read_set(cfg.publish_dir)
        assert published is not None
        tuned = {k: v for k, v in published.env.items() if not k.startswith(("NCCLTUNE_", "NCCL_TUNER", "NCCL_ENV"))}
        assert tuned == every_job and published.single_node_env == single_node
        assert {k: v for k, v in job_env(published, 1).items() if k in RING or k in TREE} == {**every_job,
                                                                                                **single_node}
        table = parse_table(Path(published.env["NCCLTUNE_TUNER_TABLE"]).read_text(), "table")
        assert table.versions() == (nccl, *({"2.27.7", "2.28.9"} - {nccl}))  # the node's own NCCL first
        assert {(e.nccl, e.algo) for e in table.entries} == {("2.28.9", "tree"), ("2.27.7", "ring")}
        values = parse_env_file(Path(published.env["NCCLTUNE_ENV_TABLE"]).read_text(), "env")
        assert {v.nccl for v in values} == {"2.27.7", "2.28.9"}
        assert Path(published.env["NCCL_ENV_PLUGIN"]).read_bytes().startswith(b"\x7fELF")


def test_a_value_the_env_plugin_cannot_carry_stays_in_the_env_files(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from nccltune.fleet.classtable import profile_env_text
    from nccltune.tuner.envfile import parse_env_file

    prof = decide(load_exports(_versions(tmp_path)), RULES, by_node_count=True)
    prof["nccl_sections"][1]["env"] = {**prof["nccl_sections"][1]["env"], "NCCL_IB_HCA": "mlx5_0 mlx5_1"}
    values = parse_env_file(profile_env_text(prof, "p.json") or "", "env")
    assert ("2.27.7", "NCCL_ALGO") in {(v.nccl, v.name) for v in values}
    assert "NCCL_IB_HCA" not in {v.name for v in values}
    assert any("NCCL 2.27.7, NCCL_IB_HCA: left out of the env plugin's file" in r.getMessage() for r in caplog.records)


def test_verify_judges_a_node_by_its_nccls_section(tmp_path: Path) -> None:
    """A node on the older NCCL is compared with that version's class numbers, never the newer's."""
    from nccltune.fleet.outlier import class_reference

    paths = _write(tmp_path, {
        **{h: shaped_runs_export(h, {1: (BASE, WIN, RING)}, nccl="2.27.7") for h in ("a", "b")},
        **{h: shaped_runs_export(h, {1: ([2 * b for b in BASE], [2 * w for w in WIN], TREE)}, nccl="2.28.9")
           for h in ("c", "d")}})
    prof = decide(load_exports(paths), RULES)
    validate(prof, load_schema("profile"))
    refs = {nccl: class_reference(section_for(prof, nccl), "p.json") for nccl in ("2.27.7", "2.28.9")}
    assert refs["2.27.7"] is not None and refs["2.28.9"] is not None
    assert refs["2.27.7"].class_id == prof["nccl_sections"][1]["node_class"]["id"]
    medians = {nccl: {round(st.median_gbps) for st in ref.sizes.values()} for nccl, ref in refs.items() if ref}
    assert medians == {"2.27.7": {113}, "2.28.9": {226}}


def test_fleet_decide_parts_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nccltune.cli import main

    exports = [str(p) for p in _shaped(tmp_path)]
    refused = tmp_path / "refused.json"
    assert main(["fleet", "decide", *exports, "--out", str(refused)]) == 78
    assert "--parts" in capsys.readouterr().err and not refused.exists()
    out = tmp_path / "class.json"
    assert main(["fleet", "decide", *exports, "--out", str(out), "--parts"]) == 0
    prof = json.loads(out.read_text())
    assert sorted(p["nnodes"] for p in prof["parts"]) == [1, 2, 4]
    assert "4 node(s) (4x2, 1 node(s) measured)" in capsys.readouterr().out
