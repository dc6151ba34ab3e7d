"""The daemon's watcher: polls in, events out, with the node loader, NCCL probe and busy query injected."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from demo_state import SNAPSHOT

from nccltune.config import Config, TopologyConfig
from nccltune.daemon import actions
from nccltune.daemon.actions import NcclInfo, Node
from nccltune.daemon.watcher import (
    DEMO_BUSY_FILE,
    ConfigRejected,
    ConfigReloaded,
    GpusBusy,
    GpusIdle,
    NcclChanged,
    NodeReadable,
    NodeUnreadable,
    TopologyChanged,
    Watcher,
    describe_change,
    gpu_users,
)
from nccltune.errors import InputError
from nccltune.hw.types import GpuProcess
from nccltune.topology.fingerprint import topology_facts
from nccltune.topology.snapshot import load_snapshot, snapshot_to_json
from nccltune.topology.source import bundled_topologies_dir, load_topology


def _edited_snapshot(tmp_path: Path, edit: Callable[[dict[str, Any]], None], name: str = "edited.json") -> Path:
    snap = json.loads(SNAPSHOT.read_text())
    edit(snap)
    path = tmp_path / name
    path.write_text(json.dumps(snap))
    return path


def _link_down(snap: dict[str, Any]) -> None:
    snap["nvml"]["gpus"][1]["nvlinks"][0]["active"] = False


def _demo_node(path: Path) -> Node:
    return actions.read_node(Config(), str(path))


class Readings:
    """What the injected callables answer, changed by the test between polls."""

    def __init__(self, node: Node) -> None:
        self.node: Node | Exception = node
        self.users: list[int] | Exception = []
        self.nccl = NcclInfo()
        self.probes = 0
        self.lib_stat: tuple[int, int] | None = None
        self.config: Config | Exception = Config()

    def load_node(self) -> Node:
        if isinstance(self.node, Exception):
            raise self.node
        return self.node

    def probe(self) -> NcclInfo:
        self.probes += 1
        return self.nccl

    def gpu_users(self, node: Node) -> list[int]:
        if isinstance(self.users, Exception):
            raise self.users
        return list(self.users)

    def load_config(self) -> Config:
        if isinstance(self.config, Exception):
            raise self.config
        return self.config

    def watcher(self) -> Watcher:
        w = Watcher(self.load_node, self.probe, self.gpu_users, self.load_config,
                    stat_library=lambda path: self.lib_stat)
        w.start()
        return w


def test_a_changed_topology_is_an_event_with_what_changed(tmp_path: Path) -> None:
    before = _demo_node(SNAPSHOT)
    readings = Readings(before)
    w = readings.watcher()
    assert w.poll() == [GpusIdle()]
    after = _demo_node(_edited_snapshot(tmp_path, _link_down))
    readings.node = after
    events = w.poll()
    assert events == [GpusIdle(), TopologyChanged(before.fingerprint, after.fingerprint, (
        "gpus 0000:00:07.0: nvlinks_active 18 -> 17", "nvlinks 0000:00:07.0->NVS: count 18 -> 17"))]
    assert w.node is after
    assert w.poll() == [GpusIdle()]  # compared with the new node from now on


def test_an_unreadable_node_is_reported_each_poll_and_its_return_once() -> None:
    readings = Readings(_demo_node(SNAPSHOT))
    w = readings.watcher()

    class NVMLError_GpuIsLost(Exception):  # as pynvml names it: not an NccltuneError
        pass

    readings.node = NVMLError_GpuIsLost("GPU is lost")
    assert w.poll() == [NodeUnreadable("NVML error: GPU is lost")]
    readings.node = InputError("snapshot.json", "not JSON", line=1)
    (unreadable,) = w.poll()
    assert isinstance(unreadable, NodeUnreadable)
    assert unreadable.why.startswith("cannot read the node: ") and "not JSON" in unreadable.why
    readings.node = _demo_node(SNAPSHOT)
    assert w.poll() == [NodeReadable(), GpusIdle()]
    assert w.poll() == [GpusIdle()]
    # the process query failing after the node was read is the node failing too
    readings.users = NVMLError_GpuIsLost("GPU is lost")
    assert w.poll() == [NodeUnreadable("NVML error: GPU is lost")]
    readings.users = []
    assert w.poll() == [NodeReadable(), GpusIdle()]


def test_busy_gpus_are_seen_at_each_poll_and_by_the_cheap_check() -> None:
    readings = Readings(_demo_node(SNAPSHOT))
    w = readings.watcher()
    readings.users = [4242, 4343]
    assert w.poll() == [GpusBusy((4242, 4343))]
    assert w.check_busy() == GpusBusy((4242, 4343))
    readings.users = []
    assert w.check_busy() == GpusIdle()
    readings.users = RuntimeError("NVML went away")
    assert w.check_busy() is None  # cannot tell: the next poll judges the node


def test_a_changed_nccl_library_is_probed_again() -> None:
    readings = Readings(_demo_node(SNAPSHOT))
    readings.nccl = NcclInfo(version="2.21.5", library="/opt/nccl/libnccl.so.2", library_stat=(1000, 5))
    readings.lib_stat = (1000, 5)
    w = readings.watcher()
    assert w.poll() == [GpusIdle()] and readings.probes == 1
    readings.lib_stat = (2000, 9)
    readings.nccl = NcclInfo(version="2.23.4", library="/opt/nccl/libnccl.so.2", library_stat=(2000, 9))
    assert w.poll() == [GpusIdle(), NcclChanged("/opt/nccl/libnccl.so.2", "2.21.5", "2.23.4")]
    assert readings.probes == 2 and w.nccl.version == "2.23.4"
    assert w.poll() == [GpusIdle()]
    # a library that went away is a change too
    readings.lib_stat = None
    readings.nccl = NcclInfo()
    assert w.poll() == [GpusIdle(), NcclChanged("/opt/nccl/libnccl.so.2", "2.23.4", None)]
    # no library known (no torch in the worker): nothing to compare
    assert w.poll() == [GpusIdle()] and readings.probes == 3


def test_a_config_reload_is_an_event() -> None:
    readings = Readings(_demo_node(SNAPSHOT))
    w = readings.watcher()
    readings.config = Config(state_dir="/var/lib/elsewhere")
    assert w.reload_config() == ConfigReloaded(Config(state_dir="/var/lib/elsewhere"))
    readings.config = InputError("daemon.yaml", "poll_interval_s must be >= 1", line=2)
    got = w.reload_config()
    assert isinstance(got, ConfigRejected) and "daemon.yaml:2" in got.why


# -- who uses the GPUs ----------------------------------------------------------------------------


def _busy_snapshot(tmp_path: Path) -> Path:
    snap = load_snapshot(bundled_topologies_dir() / "h200x2-nvswitch-vm.json")
    g0 = dataclasses.replace(snap.nvml.gpus[0], processes=(GpuProcess(pid=31337, used_memory_bytes=1 << 30),))
    busy = dataclasses.replace(snap, nvml=dataclasses.replace(snap.nvml, gpus=(g0, *snap.nvml.gpus[1:])))
    path = tmp_path / "busy.json"
    path.write_text(snapshot_to_json(busy))
    return path


def test_gpu_users_asks_nvml_once_per_gpu_and_leaves_out_the_daemons_own(tmp_path: Path) -> None:
    node = actions.read_node(Config(topology=TopologyConfig(snapshot=str(SNAPSHOT))), None)
    assert not node.demo
    asked: list[list[int]] = []

    def nvml_pids(indices: Iterable[int]) -> dict[int, tuple[int, ...]]:
        asked.append(list(indices))
        return {0: (7, 8), 1: (9,)}

    assert gpu_users(node, state_dir=tmp_path, snapshot=None, nvml_pids=nvml_pids, own=lambda: {7}) == [8, 9]
    assert asked == [[0, 1]]

    def no_own() -> set[int]:
        raise AssertionError("the process tree is read only when some GPU has a process")

    assert gpu_users(node, state_dir=tmp_path, snapshot=None, nvml_pids=lambda i: {0: (), 1: ()}, own=no_own) == []


def test_gpu_users_reads_a_standing_in_snapshot_again(tmp_path: Path) -> None:
    path = _busy_snapshot(tmp_path)
    node = actions.read_node(Config(topology=TopologyConfig(snapshot=str(SNAPSHOT))), None)

    def no_nvml(indices: Iterable[int]) -> dict[int, tuple[int, ...]]:
        raise AssertionError("NVML is not asked when a snapshot stands in for it")

    assert gpu_users(node, state_dir=tmp_path, snapshot=str(path), nvml_pids=no_nvml, own=set) == [31337]
    assert gpu_users(node, state_dir=tmp_path, snapshot=str(path), nvml_pids=no_nvml, own=lambda: {31337}) == []


def test_gpu_users_in_the_demo_is_the_busy_file(tmp_path: Path) -> None:
    node = _demo_node(SNAPSHOT)
    assert gpu_users(node, state_dir=tmp_path, snapshot=None) == []
    (tmp_path / DEMO_BUSY_FILE).touch()
    assert gpu_users(node, state_dir=tmp_path, snapshot=None) == [0]


# -- describing a topology change -----------------------------------------------------------------


def test_describe_change_names_the_link_that_went_down(tmp_path: Path) -> None:
    old = topology_facts(load_topology(str(SNAPSHOT)))
    new = topology_facts(load_topology(str(_edited_snapshot(tmp_path, _link_down))))
    assert describe_change(old, new) == ["gpus 0000:00:07.0: nvlinks_active 18 -> 17",
                                         "nvlinks 0000:00:07.0->NVS: count 18 -> 17"]
    assert describe_change(old, old) == []


def test_describe_change_between_two_machines() -> None:
    a = topology_facts(load_topology("dgx-a100-8gpu"))
    b = topology_facts(load_topology("hgx-h100-8gpu"))
    changes = describe_change(a, b)
    assert "driver_version: '535.161.08' -> '550.54.15'" in changes
    assert "gpus 0000:07:00.0 is gone" in changes and "gpus 0000:1b:00.0 is new" in changes
    assert "nics mlx5_0: speed_mbps 200000 -> 400000" not in changes  # NICs are keyed by PCI address


def test_describe_change_tells_nics_without_a_pci_address_apart() -> None:
    nics = [{"name": "eth0", "bus_id": None, "speed_mbps": 1000, "kind": "eth"},
            {"name": "eth1", "bus_id": None, "speed_mbps": 1000, "kind": "eth"}]
    slower = [dict(nics[0], speed_mbps=100), nics[1]]
    assert describe_change({"nics": nics}, {"nics": slower}) == ["nics eth0: speed_mbps 1000 -> 100"]
    assert describe_change({"nics": nics}, {"nics": nics[:1]}) == ["nics eth1 is gone"]
    # Nothing that tells the entries apart: the list is still reported as changed.
    same_name = [{"x": 1}, {"x": 2}]
    assert describe_change({"pci": same_name}, {"pci": same_name[:1]}) == ["pci changed"]


def test_the_watcher_needs_a_start() -> None:
    w = Watcher(lambda: _demo_node(SNAPSHOT), NcclInfo, lambda node: [], Config)
    assert not w.started
    with pytest.raises(RuntimeError, match="start"):
        w.poll()
