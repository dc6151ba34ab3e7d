"""Node class: identical machines share one; a lost NVLink, a GPU fewer, a NIC moved to another
PCIe parent, or another driver each make another class, and the reason names the fact."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nccltune.topology.fingerprint import topology_fingerprint
from nccltune.topology.model import from_snapshot
from nccltune.topology.nodeclass import describe_difference, differing_facts, node_class
from nccltune.topology.snapshot import load_snapshot
from tests.fleet_fixtures import load, sibling, write


def _class(doc: dict[str, Any], tmp_path: Path, name: str = "snap.json", nccl: str | None = "2.28.9"):
    topo = from_snapshot(load_snapshot(write(doc, tmp_path / name)))
    return node_class(topo, nccl_version=nccl), topo


@pytest.mark.parametrize("name", ["h200x2-nvswitch-vm", "hgx-h100-8gpu"])
def test_identical_nodes_with_other_serials_and_bus_numbers_share_a_class(name: str, tmp_path: Path) -> None:
    a_doc = load(name)
    b_doc = sibling(a_doc, seed=3)
    # The rewrite really changed what identifies the unit, bus ids included.
    assert a_doc["nvml"]["gpus"][0]["uuid"] != b_doc["nvml"]["gpus"][0]["uuid"]
    assert a_doc["nvml"]["gpus"][0]["bus_id"] != b_doc["nvml"]["gpus"][0]["bus_id"]
    a, ta = _class(a_doc, tmp_path, "a.json")
    b, tb = _class(b_doc, tmp_path, "b.json")
    assert topology_fingerprint(ta) != topology_fingerprint(tb)  # the node fingerprint sees the renumbering
    assert a.id == b.id, describe_difference(a.facts, b.facts)
    assert len(a.id) == 16 and int(a.id, 16) >= 0
    assert a.facts["gpu_count"] == len(a_doc["nvml"]["gpus"])


def test_ib_guids_and_nic_names_do_not_count(tmp_path: Path) -> None:
    doc = load("hgx-h100-8gpu")
    other = copy.deepcopy(doc)
    for nic in other["sysfs"]["nics"]:
        nic["name"] = nic["name"].replace("mlx5_", "ibdev") if nic["kind"] == "ib" else nic["name"] + "x"
        if nic.get("guid"):
            nic["guid"] = "0000:1111:2222:3333"
    assert _class(doc, tmp_path, "a.json")[0].id == _class(other, tmp_path, "b.json")[0].id


def _lose_nvlink(doc: dict[str, Any]) -> None:
    doc["nvml"]["gpus"][1]["nvlinks"][4]["active"] = False


def _drop_gpu(doc: dict[str, Any]) -> None:
    gone = doc["nvml"]["gpus"].pop()
    doc["nvml"]["p2p"] = [p for p in doc["nvml"]["p2p"] if gone["index"] not in (p["gpu_a"], p["gpu_b"])]
    doc["sysfs"]["pci"] = [p for p in doc["sysfs"]["pci"] if p["bus_id"] != gone["bus_id"]]


def _move_nic(doc: dict[str, Any]) -> None:
    # mlx5_0 leaves the switch it shares with GPU 0 for the switch of mlx5_1 (another PCIe parent).
    dev = next(p for p in doc["sysfs"]["pci"] if p["bus_id"] == "0000:18:00.0")
    dev["path"] = ["pci0000:3c", "0000:3c:01.0", "0000:3d:00.0", "0000:3e:01.0", "0000:18:00.0"]


def _other_driver(doc: dict[str, Any]) -> None:
    doc["nvml"]["driver_version"] = "570.86.15"


@pytest.mark.parametrize(("change", "fact"), [
    (_lose_nvlink, "nvlink"), (_drop_gpu, "gpu_count"), (_move_nic, "nic_placement"),
    (_other_driver, "driver_version"),
])
def test_a_real_difference_changes_the_class_and_is_named(change: Any, fact: str, tmp_path: Path) -> None:
    doc = load("hgx-h100-8gpu")
    changed = sibling(doc, seed=2)  # other serials too: only the change may matter
    base = copy.deepcopy(doc)
    change(base)
    a, _ = _class(doc, tmp_path, "a.json")
    b, _ = _class(base, tmp_path, "b.json")
    assert a.id != b.id
    assert fact in differing_facts(a.facts, b.facts)
    assert fact in describe_difference(a.facts, b.facts, a_name="profile", b_name="this node")
    assert _class(changed, tmp_path, "c.json")[0].id == a.id


def test_nccl_version_is_an_input_of_the_class(tmp_path: Path) -> None:
    doc = load("h200x2-nvswitch-vm")
    a, _ = _class(doc, tmp_path, nccl="2.28.9")
    b, _ = _class(doc, tmp_path, nccl="2.27.3")
    assert a.id != b.id
    assert differing_facts(a.facts, b.facts) == ["nccl_version"]


def test_topo_shows_the_class_in_text_and_json() -> None:
    env_run = [sys.executable, "-m", "nccltune", "topo", "--input", "hgx-h100-8gpu"]
    text = subprocess.run(env_run, capture_output=True, text=True, check=True).stdout
    doc = json.loads(subprocess.run([*env_run, "--json"], capture_output=True, text=True, check=True).stdout)
    cls = doc["node_class"]
    assert len(cls["id"]) == 16 and cls["facts"]["gpu_count"] == 8
    assert f"Node class: {cls['id']}" in text
