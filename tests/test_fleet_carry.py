"""`nccltune fleet upgrade` end to end on CPU: a class profile decided under NCCL 2.28.9, its nodes
gpu-a (the canary) and gpu-c upgraded to 2.29.1, and for each outcome of the upgrade rule the
profile written for the new class id, applied on a node of that class, and shown in force by
`fleet status`; the refusals (exit 78); `fleet decide`'s warning on a gate that found sizes slower."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from nccltune.cli import main
from nccltune.config import Config
from nccltune.fleet.apply import load_profile, publish_loaded
from nccltune.fleet.decide import Rules, decide, dumps_profile, load_exports
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.fleet.status import IN_FORCE_PROFILE, IN_FORCE_SAFE, export_paths, fleet_status
from nccltune.fleet.upgrade import SAFE_PART
from nccltune.publish.readback import read_set
from nccltune.topology.nodeclass import class_id_of
from nccltune.topology.source import bundled_topologies_dir
from tests.fleet_fixtures import h200x2_export

TUNED = {"NCCL_ALGO": "Ring", "NCCL_IB_HCA": "mlx5_0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
SAFE = {"NCCL_IB_HCA": "mlx5_0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
ENTRY = {"collective": "allreduce", "min_bytes": 0, "max_bytes": 1048575, "nnodes": 1, "nranks": 2,
         "ranks_per_node": 2, "algo": "ring", "proto": "ll128", "channels": None}
SLOWER = "defaults all_reduce 1048576 B -12.0% (noise 2.0%)"


def _export(where: Path, host: str, nccl: str, *, driver: str = "580.159.04", gate: list[str] | None = None,
            gate_from: str = "2.28.9") -> Path:
    def trial(seq: int, phase: str, env: dict[str, str], busbw: float) -> dict[str, Any]:
        return {"seq": seq, "phase": phase, "label": "x", "env": env, "status": "ok", "reason": None, "wall_s": 1.0,
                "measurements": [{"size_bytes": s, "time_us": 1.0, "algbw_gbps": busbw, "busbw_gbps": busbw,
                                  "algo": None, "proto": None, "correct": True} for s in (1 << 20, 1 << 24)]}

    trials = [trial(i + 1, "baseline", {}, b) for i, b in enumerate([100, 101, 99])]
    trials += [trial(10 + i, "final", TUNED, c) for i, c in enumerate([110, 111])]
    doc = h200x2_export(host, trials)
    doc["versions"].update(nccl=nccl, driver=driver)
    doc["node_class"]["facts"].update(nccl_version=nccl, driver_version=driver)
    doc["node_class"]["id"] = class_id_of(doc["node_class"]["facts"])
    doc["runs"][0].update(nccl_version=nccl, driver_version=driver)
    if gate is not None:
        doc["upgrade_gate"] = {"run_id": 2, "previous_run_id": 1, "compared": 4, "slower": gate,
                               "previous_versions": {"nccl": gate_from, "driver": "580.159.04", "torch": None}}
    path = where / f"{host}.json"
    where.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def _class(tmp_path: Path, gate: list[str] | None, *, canary: bool = True) -> tuple[Path, Path, Path]:
    """(the old profile, the upgraded nodes' exports, a directory of profiles holding the old one)."""
    old = [_export(tmp_path / "old", host, "2.28.9") for host in ("gpu-b", "gpu-a")]
    profile = decide(load_exports(old), Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    assert profile["env"] == TUNED
    profile["tuner_table"] = [ENTRY]  # as a per-size stage would have chosen it under 2.28.9
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    path = profiles / f"{profile['node_class']['id']}.json"
    path.write_text(dumps_profile(profile))
    exports = tmp_path / "upgraded"
    if canary:
        _export(exports, "gpu-a", "2.29.1", gate=gate)
    _export(exports, "gpu-c", "2.29.1")
    return path, exports, profiles


def _gpu_node(tmp_path: Path) -> Any:
    from nccltune.fleet.member import load_fleet_node

    demo = load_fleet_node(Config(state_dir=str(tmp_path / "state")),
                           str(bundled_topologies_dir() / "h200x2-nvswitch-vm.json"))
    return dataclasses.replace(demo, demo=False)  # the recorded GPU node, its NCCL as the worker reports it


def _applied(tmp_path: Path, profiles: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """What a node of the new class (NCCL 2.29.1) publishes from the profiles directory."""
    cfg = Config(state_dir=str(tmp_path / "node-state"))
    node = _gpu_node(tmp_path)
    publish_loaded(cfg, node, "2.29.1", load_profile(profiles, node, "2.29.1"))
    published = read_set(cfg.publish_dir)
    assert published is not None
    env = {k: v for k, v in published.env.items() if not k.startswith(("NCCLTUNE_", "NCCL_TUNER"))}
    return env, published.provenance


def _upgrade(old: Path, exports: Path, out: Path, *extra: str) -> int:
    return main(["fleet", "upgrade", str(old), str(exports), "--out", str(out), *extra])


def _written(profiles: Path, old: Path) -> dict[str, Any]:
    [new] = [p for p in profiles.glob("*.json") if p != old]
    doc: dict[str, Any] = json.loads(new.read_text())
    validate(doc, load_schema("profile"))
    return doc


def test_keep_carries_the_old_values_to_the_new_class_and_apply_publishes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, exports, profiles = _class(tmp_path, gate=[])
    assert _upgrade(old, exports, profiles) == 0
    said = capsys.readouterr().out
    assert "Upgrade outcome: keep (the canary measured no size slower beyond noise (4 compared))" in said
    assert "the tuner table (1 entry, NCCL 2.28.9's section) is not carried" in said
    doc = _written(profiles, old)
    assert doc["env"] == TUNED and doc["tuner_table"] == [] and doc["versions"]["nccl"] == "2.29.1"
    upgrade = doc["provenance"]["upgrade"]
    assert (upgrade["outcome"], upgrade["canary"], upgrade["gate"]["compared"]) == ("keep", "gpu-a", 4)
    assert upgrade["from"]["sha256"] == hashlib.sha256(old.read_bytes()).hexdigest()
    env, prov = _applied(tmp_path, profiles)
    assert env == TUNED and "part" not in prov["class_profile"]
    [cls] = fleet_status(export_paths([exports]), profiles)
    nodes = {n.hostname: n for n in cls.nodes}
    assert {h: n.in_force for h, n in nodes.items()} == {"gpu-a": IN_FORCE_PROFILE, "gpu-c": IN_FORCE_PROFILE}
    assert nodes["gpu-c"].why.endswith(f"fleet upgrade keep of {old.name}") and cls.outcome is None


def test_a_driver_upgrade_keeps_the_tuner_table_of_the_same_nccl(tmp_path: Path) -> None:
    from nccltune.fleet.apply import read_profile
    from nccltune.fleet.carry import carry, upgraded_class

    old, _exports, _profiles = _class(tmp_path, gate=[])
    gate = tmp_path / "driver"
    export = _export(gate, "gpu-a", "2.28.9", driver="590.1", gate=[])
    carried = carry(upgraded_class(read_profile(old), load_exports([export])), None)
    assert carried.outcome == "keep" and carried.doc["tuner_table"] == [ENTRY] and carried.notes == []
    assert carried.doc["versions"]["driver"] == "590.1"


def test_safe_writes_the_safe_part_alone_and_says_so_where_it_is_published(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, exports, profiles = _class(tmp_path, gate=[SLOWER])
    assert _upgrade(old, exports, profiles) == 0
    said = capsys.readouterr().out
    assert "Upgrade outcome: safe (the canary measured 1 size(s) slower" in said
    assert "left out: NCCL_ALGO, the tuner table" in said
    doc = _written(profiles, old)
    assert doc["env"] == SAFE and doc["tuner_table"] == [] and doc["schema_version"] == 1
    assert doc["provenance"]["upgrade"]["part"] == SAFE_PART
    env, prov = _applied(tmp_path, profiles)
    # verify reads the part and compares the node with its own last sweep, not the class's numbers.
    assert env == SAFE and prov["class_profile"]["part"] == SAFE_PART
    [cls] = fleet_status(export_paths([exports]), profiles)
    assert {n.in_force for n in cls.nodes} == {IN_FORCE_SAFE} and not any(n.canary for n in cls.nodes)
    assert cls.outcome == "safe" and SLOWER in (cls.outcome_why or "")


def test_new_decides_the_upgraded_nodes_by_fleet_decides_rule(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    old, exports, profiles = _class(tmp_path, gate=[SLOWER])
    assert _upgrade(old, exports, profiles, "--decide") == 0
    assert "Upgrade outcome: new (the canary's profile for the new versions (" in capsys.readouterr().out
    doc = _written(profiles, old)
    by_decide = decide(load_exports(sorted(exports.glob("*.json"))),
                       Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    assert (doc["chosen"], doc["env"]) == (by_decide["chosen"], by_decide["env"])
    assert doc["evidence"]["exports_sha256"] == by_decide["evidence"]["exports_sha256"]
    assert doc["provenance"]["upgrade"]["outcome"] == "new"
    env, prov = _applied(tmp_path, profiles)
    assert env == by_decide["env"] and "part" not in prov["class_profile"]
    [cls] = fleet_status(export_paths([exports]), profiles)
    assert {n.in_force for n in cls.nodes} == {IN_FORCE_PROFILE} and cls.outcome is None


@pytest.mark.parametrize(("canary", "said"), [
    (True, "carries no upgrade_gate: it has not re-measured"),
    (False, "the canary gpu-a's export is not among those given"),
])
def test_nothing_compared_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], canary: bool,
                                         said: str) -> None:
    old, exports, profiles = _class(tmp_path, gate=None, canary=canary)
    assert _upgrade(old, exports, profiles) == 78
    err = capsys.readouterr().err
    assert "upgrade outcome safe" in err and said in err and "Nothing written" in err
    assert list(profiles.glob("*.json")) == [old]


def test_a_gate_against_other_versions_than_the_profiles_is_no_reading_of_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, exports, profiles = _class(tmp_path, gate=None)
    _export(exports, "gpu-a", "2.29.1", gate=[], gate_from="2.27.7")  # its last sweep before was under 2.27.7
    assert _upgrade(old, exports, profiles) == 78
    assert "compared with NCCL 2.27.7, driver 580.159.04, not the profile's NCCL 2.28.9" in capsys.readouterr().err


def test_exports_not_of_one_upgraded_class_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, exports, profiles = _class(tmp_path, gate=[])
    mixed = _export(tmp_path / "mixed", "gpu-b", "2.28.9")
    assert main(["fleet", "upgrade", str(old), str(exports), str(mixed), "--out", str(profiles)]) == 78
    assert "gpu-b.json: node class" in capsys.readouterr().err
    assert _upgrade(old, mixed, profiles) == 78
    assert "is the profile's own" in capsys.readouterr().err
    other = json.loads((exports / "gpu-c.json").read_text())
    other["node_class"]["facts"]["gpu_count"] = 8
    other["node_class"]["id"] = class_id_of(other["node_class"]["facts"])
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert _upgrade(old, tmp_path / "other.json", profiles) == 78
    assert "another kind of node than the profile" in capsys.readouterr().err
    assert list(profiles.glob("*.json")) == [old]


def test_fleet_decide_warns_of_a_gate_that_found_sizes_slower(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    _old, exports, _profiles = _class(tmp_path, gate=[SLOWER])
    with caplog.at_level(logging.WARNING):
        assert main(["fleet", "decide", str(exports / "gpu-a.json"), "--out", str(tmp_path / "p.json")]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("gpu-a's upgrade gate found 1 size(s) slower beyond noise under NCCL 2.29.1" in w and SLOWER in w
               for w in warned)


def test_keep_of_a_profile_of_several_nccl_versions_carries_its_own_versions_section(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old_exports = [_export(tmp_path / f"old-{nccl}", host, nccl) for nccl in ("2.27.7", "2.28.9")
                   for host in ("gpu-a", "gpu-b")]
    profile = decide(load_exports(old_exports), Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    assert [s["nccl"] for s in profile["nccl_sections"]] == ["2.28.9", "2.27.7"]
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    old = profiles / "old.json"
    old.write_text(dumps_profile(profile))
    exports = tmp_path / "upgraded"
    _export(exports, "gpu-a", "2.29.1", gate=[])
    assert _upgrade(old, exports, profiles) == 0
    assert "the sections of NCCL 2.27.7 are not carried: nodes on those versions keep old.json" in \
        capsys.readouterr().out
    doc = _written(profiles, old)
    [section] = doc["nccl_sections"]
    assert (section["nccl"], section["node_class"]) == ("2.29.1", doc["node_class"])
    env, _prov = _applied(tmp_path, profiles)
    assert env == TUNED
