"""What the sysfs reader tells the topology about the CPU, and when it may ask the live node.

/proc/cpuinfo has no "arch" line, so a recorded tree's architecture has to come from the keys
each architecture prints; only on the node's own "/" may the interpreter answer instead. The
arch ends up as `<cpu arch>`, which NCCL requires and uses for the inter-socket bandwidth.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import TOPOLOGIES

from nccltune.hw.sysfs import SysfsReader
from nccltune.topology.model import from_snapshot
from nccltune.topology.paths import compute_paths
from nccltune.topology.snapshot import load_snapshot

CPUINFO = {
    # What each architecture's kernel prints for one processor (abridged, real key spellings).
    "aarch64": ("processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm aes\n"
                "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd4f\n"),
    "ppc64le": ("processor\t: 0\ncpu\t\t: POWER9, altivec supported\nclock\t\t: 3800.000000MHz\n"
                "revision\t: 2.3 (pvr 004e 1203)\n"),
    "x86_64": ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
               "model name\t: Intel(R) Xeon(R) Platinum 8480C\nphysical id\t: 0\n"),
    "s390x": "vendor_id       : IBM/S390\n# processors    : 4\nprocessor 0: version = FF, identification = 0\n",
}


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> str:
    """The interpreter's answer, made unmistakable so a test can tell where arch came from."""
    monkeypatch.setattr("nccltune.hw.sysfs.platform.machine", lambda: "interpreter-arch")
    return "interpreter-arch"


@pytest.mark.parametrize("arch", sorted(CPUINFO))
def test_arch_of_a_recorded_tree_comes_from_its_cpuinfo(tmp_path: Path, machine: str, arch: str) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(CPUINFO[arch] * 2)
    assert SysfsReader(tmp_path).read().cpu.arch == arch


def test_arch_without_cpuinfo_is_the_default(tmp_path: Path, machine: str) -> None:
    assert SysfsReader(tmp_path).read().cpu.arch == "x86_64"


@pytest.mark.parametrize("spelling", ["/", "/.", "//", "/proc/.."])
def test_live_root_asks_the_interpreter(machine: str, spelling: str) -> None:
    assert SysfsReader(spelling).read().cpu.arch == machine


def test_symlink_to_root_is_live(tmp_path: Path, machine: str) -> None:
    link = tmp_path / "hostroot"
    link.symlink_to("/")
    assert os.path.realpath(link) == "/"
    assert SysfsReader(link).read().cpu.arch == machine


def test_address_list_only_on_the_live_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """has_ipv4 comes from the kernel's address list, which says nothing about a fixture tree."""
    calls: list[int] = []

    def spy() -> set[str]:
        calls.append(1)
        return {"eth0"}

    monkeypatch.setattr("nccltune.hw.sysfs._ipv4_interfaces", spy)
    net = tmp_path / "sys/devices/virtual/net/eth0"
    net.mkdir(parents=True)
    (net / "operstate").write_text("up\n")
    (tmp_path / "sys/class/net").mkdir(parents=True)
    (tmp_path / "sys/class/net/eth0").symlink_to("../../devices/virtual/net/eth0")
    [nic] = SysfsReader(tmp_path).read().nics
    assert (nic.name, nic.has_ipv4) == ("eth0", None) and calls == []
    link = tmp_path / "hostroot"
    link.symlink_to("/")
    SysfsReader(link).read()
    assert calls == [1]


@pytest.mark.parametrize("arch,xml_arch,bw", [("aarch64", "arm64", 6.0), ("ppc64le", "ppc64", 32.0)])
def test_arch_reaches_the_xml_and_the_socket_bandwidth(arch: str, xml_arch: str, bw: float) -> None:
    """NCCL's dictionary knows x86_64/arm64/ppc64; the socket link is 6 (ARM) or 32 (POWER) GB/s."""
    import dataclasses

    snap = load_snapshot(TOPOLOGIES / "pcie-4gpu-2socket.json")
    cpu = dataclasses.replace(snap.sysfs.cpu, arch=arch, vendor=None, family=None, model=None)
    snap = dataclasses.replace(snap, sysfs=dataclasses.replace(snap.sysfs, cpu=cpu))
    topo = from_snapshot(snap)
    assert {c.attrs["arch"] for c in topo.system.iter("cpu")} == {xml_arch}
    p = compute_paths(topo).gpu_gpu[(0, 2)]
    assert (p.type, p.bw_gbps) == ("SYS", min(bw, 24.0))
