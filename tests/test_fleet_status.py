"""`nccltune fleet status` on hand-made exports of one class: which NCCL/driver/torch each node
runs and what is in force there by the upgrade rule (docs/upgrades.md): the profile on the nodes
of its versions, its safe part on upgraded ones, the canary the profile names, the rule's outcome
from the canary's upgrade gate; the JSON document against its schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from nccltune.fleet.decide import Rules, decide, dumps_profile, load_exports
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.fleet.status import (
    IN_FORCE_OWN,
    IN_FORCE_PROFILE,
    IN_FORCE_SAFE,
    STATUS_KIND,
    export_paths,
    fleet_status,
    hardware_class,
    render,
)
from nccltune.topology.nodeclass import class_id_of
from tests.demo_state import clean_env
from tests.fleet_fixtures import h200x2_export

REPO = Path(__file__).resolve().parents[1]
RING = {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def _export(tmp_path: Path, host: str, nccl: str, torch: str = "2.11.0", *, where: str = "exports",
            gate: dict[str, Any] | None = None) -> Path:
    sizes = [1 << 20, 1 << 24]

    def trial(seq: int, phase: str, env: dict[str, str], busbw: float) -> dict[str, Any]:
        return {"seq": seq, "phase": phase, "label": "x", "env": env, "status": "ok", "reason": None, "wall_s": 1.0,
                "measurements": [{"size_bytes": s, "time_us": 1.0, "algbw_gbps": busbw, "busbw_gbps": busbw,
                                  "algo": None, "proto": None, "correct": True} for s in sizes]}

    trials = [trial(i + 1, "baseline", {}, b) for i, b in enumerate([100, 101, 99])]
    trials += [trial(10 + i, "final", RING, c) for i, c in enumerate([110, 111])]
    doc = h200x2_export(host, trials)
    doc["versions"].update({"nccl": nccl, "torch": torch})
    # The NCCL version is a fact of the class: an upgraded node has a new class id.
    doc["node_class"]["facts"]["nccl_version"] = nccl
    doc["node_class"]["id"] = class_id_of(doc["node_class"]["facts"])
    doc["runs"][0].update({"nccl_version": nccl, "torch_version": torch})
    if gate is not None:
        doc["upgrade_gate"] = gate
    validate(doc, load_schema("export"))
    path = tmp_path / where / f"{host}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def _status(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", "fleet", "status", *args], capture_output=True,
                          text=True, env=clean_env(), timeout=120, cwd=cwd)


def _gate(slower: list[str]) -> dict[str, Any]:
    return {"run_id": 2, "previous_run_id": 1, "previous_versions": {"nccl": "2.28.9", "driver": "580.159.04",
                                                                     "torch": "2.11.0"},
            "compared": 4, "slower": slower}


def _fleet(tmp_path: Path, gate: dict[str, Any] | None = None) -> tuple[Path, Path, str]:
    """The profile decided from nodes a and b on NCCL 2.28.9; since then a (the canary: the lowest
    hostname of the profile's nodes) and c run 2.29.1, b and d still 2.28.9."""
    old = [_export(tmp_path, host, "2.28.9", where="old") for host in ("gpu-b", "gpu-a")]
    for host in ("gpu-b", "gpu-d"):
        _export(tmp_path, host, "2.28.9")
    _export(tmp_path, "gpu-c", "2.29.1", torch="2.12.0")
    _export(tmp_path, "gpu-a", "2.29.1", torch="2.12.0", gate=gate)
    profile = decide(load_exports(old), Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    class_id = profile["node_class"]["id"]
    (profiles / f"{class_id}.json").write_text(dumps_profile(profile))
    return tmp_path / "exports", profiles, class_id


def profile_facts(profiles: Path, class_id: str) -> dict[str, Any]:
    facts: dict[str, Any] = json.loads((profiles / f"{class_id}.json").read_text())["node_class"]["facts"]
    return facts


def test_status_shows_versions_and_what_is_in_force_per_node(tmp_path: Path) -> None:
    exports, profiles, class_id = _fleet(tmp_path)
    got = _status(str(exports), "--profiles", str(profiles), "--json", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    document = json.loads(got.stdout)
    assert document["kind"] == STATUS_KIND and document["schema_version"] == 1
    validate(document, json.loads((REPO / "schemas" / f"{STATUS_KIND}.schema.json").read_text()))
    [cls] = document["classes"]
    assert cls["class"] == hardware_class(profile_facts(profiles, class_id))
    assert cls["profile_versions"]["nccl"] == "2.28.9" and cls["profile"].endswith(f"{class_id}.json")
    nodes = {n["hostname"]: n for n in cls["nodes"]}
    assert [n["hostname"] for n in cls["nodes"]] == ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]
    assert nodes["gpu-b"]["in_force"] == nodes["gpu-d"]["in_force"] == IN_FORCE_PROFILE
    assert nodes["gpu-c"]["versions"] == {"nccl": "2.29.1", "driver": "580.159.04", "torch": "2.12.0"}
    # Upgraded nodes serve the safe part; the profile's node of lowest hostname is the class's canary.
    assert nodes["gpu-a"]["in_force"] == nodes["gpu-c"]["in_force"] == IN_FORCE_SAFE
    assert cls["canary"] == "gpu-a"
    assert nodes["gpu-a"]["canary"] is True and nodes["gpu-c"]["canary"] is False
    assert "nccl 2.28.9 (profile) vs 2.29.1 (node)" in nodes["gpu-c"]["why"]
    # The canary's export has no upgrade gate yet: nothing measured, the safe part stays.
    assert cls["upgrade"]["outcome"] == "safe" and "not re-measured" in cls["upgrade"]["why"]
    # What they serve: the wiring and error handling, not the old version's algorithm pin.
    assert cls["safe_part"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert "NCCL_ALGO" in cls["left_out_after_upgrade"]
    text = _status(str(exports), "--profiles", str(profiles), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    line = next(x for x in text.stdout.splitlines() if x.strip().startswith("gpu-a:"))
    assert "NCCL 2.29.1" in line and "torch 2.12.0" in line and "canary" in line
    # The canary's export decided under the new version: the upgraded nodes run its profile, the
    # others keep the old one (each node the profile of its versions).
    canary = load_exports([exports / "gpu-a.json"])
    new = decide(canary, Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    (profiles / f"{new['node_class']['id']}.json").write_text(dumps_profile(new))
    after = _status(str(exports), "--profiles", str(profiles), "--json", cwd=tmp_path)
    assert after.returncode == 0, after.stderr
    [cls] = json.loads(after.stdout)["classes"]
    assert cls["upgrade"] is None  # every node runs the profile of its versions
    assert {n["hostname"]: n["in_force"] for n in cls["nodes"]} == dict.fromkeys(
        ("gpu-a", "gpu-b", "gpu-c", "gpu-d"), IN_FORCE_PROFILE)
    assert {n["hostname"]: n["canary"] for n in cls["nodes"]} == dict.fromkeys(("gpu-a", "gpu-b", "gpu-c", "gpu-d"),
                                                                                False)
    assert next(n for n in cls["nodes"] if n["hostname"] == "gpu-c")["why"].endswith(f"{new['node_class']['id']}.json")


def test_the_canarys_upgrade_gate_decides_keep_or_safe(tmp_path: Path) -> None:
    """The canary's export carries its upgrade gate: no size slower beyond noise keeps the old
    profile, one slower keeps the safe part (fleet.upgrade.upgrade_outcome)."""
    exports, profiles, _ = _fleet(tmp_path / "clean", _gate([]))
    [cls] = fleet_status(export_paths([exports]), profiles)
    assert (cls.outcome, cls.canary) == ("keep", "gpu-a")
    slower = "defaults all_reduce 1048576 B -12.0% (noise 2.0%)"
    exports, profiles, _ = _fleet(tmp_path / "slower", _gate([slower]))
    classes = fleet_status(export_paths([exports]), profiles)
    assert classes[0].outcome == "safe"
    assert f"upgrade: safe (the canary measured 1 size(s) slower than under the previous versions beyond noise: " \
           f"{slower})" in render(classes)


def test_without_a_profile_each_node_keeps_its_own_choice(tmp_path: Path) -> None:
    exports, _, _ = _fleet(tmp_path)
    got = _status(str(exports / "gpu-a.json"), str(exports / "gpu-c.json"), "--json", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    [cls] = json.loads(got.stdout)["classes"]
    assert cls["profile"] is None
    assert {n["in_force"] for n in cls["nodes"]} == {IN_FORCE_OWN}


def test_bad_input_is_refused_with_its_name(tmp_path: Path) -> None:
    exports, _, _ = _fleet(tmp_path)
    missing = _status(str(tmp_path / "nope.json"), cwd=tmp_path)
    assert missing.returncode == 78 and "nope.json" in missing.stderr
    twice = tmp_path / "twice"
    twice.mkdir()
    (twice / "again.json").write_text((exports / "gpu-a.json").read_text())
    dup = _status(str(exports), str(twice), cwd=tmp_path)
    assert dup.returncode == 78 and "node gpu-a is also in" in dup.stderr
    (twice / "again.json").write_text("{")
    bad = _status(str(twice), cwd=tmp_path)
    assert bad.returncode == 78 and "again.json" in bad.stderr
