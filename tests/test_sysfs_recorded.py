"""The sysfs reader on a tree recorded from a real node (fixtures/h200x1-sysfs: a one-GPU H200 VM,
copied with bench/record_sysfs_tree.py), not on a tree generated from nccltune's own model.

Two independent witnesses from the same run: the live reader's snapshot (`nccltune topo record`,
fixtures/h200x1-sysfs.snapshot.json) and `nvidia-smi -q` (its PCI section, written out below by hand).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from nccltune.hw.sysfs import SysfsReader
from nccltune.hw.types import SysfsSnapshot

FIXTURES = Path(__file__).parent / "fixtures"
TREE = FIXTURES / "h200x1-sysfs"
GPU = "0000:00:06.0"


def _read() -> SysfsSnapshot:
    return SysfsReader(TREE).read([GPU])


def test_the_recorded_tree_reads_as_the_live_node_did() -> None:
    live = json.loads((FIXTURES / "h200x1-sysfs.snapshot.json").read_text())["sysfs"]
    got = json.loads(json.dumps(dataclasses.asdict(_read())))
    # Whether an interface has an IPv4 address is asked of the live kernel, never of a tree.
    for nic in live["nics"]:
        nic["has_ipv4"] = None
    assert got == live


def test_the_gpu_as_nvidia_smi_saw_it() -> None:
    snap = _read()
    gpu = next(d for d in snap.pci if d.bus_id == GPU)
    # nvidia-smi -q: Bus Id 00000000:00:06.0; Base Classcode 0x3, Sub Classcode 0x2;
    # Device Id 0x233510DE; Sub System Id 0x18BF10DE; PCIe Generation Max 5 Current 5; Link Width 16x 16x.
    assert gpu.class_code.startswith("0x0302")
    assert (gpu.vendor, gpu.device) == ("0x10de", "0x2335")
    assert (gpu.subsystem_vendor, gpu.subsystem_device) == ("0x10de", "0x18bf")
    assert gpu.max_link_speed == gpu.current_link_speed == "32.0 GT/s PCIe"  # PCIe Gen5
    assert gpu.max_link_width == gpu.current_link_width == 16
    # The VM's GPU sits straight on the root complex: no bridge, no switch.
    assert gpu.path == ("pci0000:00", GPU)
    # The kernel gives the GPU no NUMA node (-1); nvidia-smi topo -m: CPU affinity 0-15, one node.
    assert gpu.numa_node is None
    assert [(n.id, n.cpulist) for n in snap.numa_nodes] == [(0, "0-15")]
    assert snap.cpu.logical_cpus == 16 and snap.cpu.arch == "x86_64"


def test_the_vms_network_devices_are_not_pci_functions() -> None:
    """eth0 is a virtio device (its `device` link ends in virtio2 under 0000:00:03.0): no PCI path for
    NCCL to rank; loopback is skipped."""
    nics = {n.name: n for n in _read().nics}
    assert "lo" not in nics
    assert nics["eth0"].bus_id is None and nics["eth0"].operstate == "up"
    assert _read().gdr_module is None
