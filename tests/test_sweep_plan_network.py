"""Network knobs in the plan: pruned on one node, judged on the final GPU-NIC paths across nodes.

Expectations are worked out from the final GPU-NIC types of each recording
(tests/test_topology_nicpaths.py): which (GPU, NIC) pairs use GDR at each NCCL_NET_GDR_LEVEL,
whether any path is PXN, how many NICs there are, and whether they are RDMA NICs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nccltune.hw.types import PciDevice
from nccltune.sweep.plan import SINGLE_NODE_NET_REASON, JobShape, Plan, build_plan, socket_auto_threads
from nccltune.sweep.space import CATALOGUE, validate_value
from nccltune.topology.model import Topology
from nccltune.topology.paths import compute_paths
from nccltune.topology.source import load_topology

TOPOLOGIES = Path(__file__).resolve().parents[1] / "topologies"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
NET_KNOBS = [n for n, t in CATALOGUE.items() if t.scope == "net"]
DEFAULT_GDR = "same GPU-NIC pairs use GDR as with NCCL's default on this topology"
SAME_AS_LOC = "same effect as NCCL_NET_GDR_LEVEL=LOC on this topology"
NO_GDR = "no GPU-NIC pair can use GDR here (a NIC or GPU without GPUDirect RDMA support)"
RDMA_NOT_SOCKETS = "RDMA NICs present: NCCL uses the IB transport, not sockets"


def _plan(name: str, shape: JobShape | None = None) -> Plan:
    topo = load_topology(str(TOPOLOGIES / name))
    return build_plan(topo, compute_paths(topo), env={}, config_pins={}, unpin=[], variables={}, exclude=[],
                      policy={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, sizes=[1 << 20], backend="nccl",
                      nranks=len(topo.gpus), shape=shape)


def _pruned(plan: Plan, name: str) -> dict[str, str]:
    return {p.value: p.reason for p in plan.pruned if p.name == name}


def _net_vars(plan: Plan) -> dict[str, list[str]]:
    return {k: v for k, v in plan.variables.items() if k in NET_KNOBS}


TWO_NODES = JobShape(nnodes=2)


def test_socket_knobs_are_in_the_catalogue_as_network_knobs() -> None:
    assert {"NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"} <= set(NET_KNOBS)
    assert validate_value("NCCL_SOCKET_NTHREADS", "16") is None
    assert validate_value("NCCL_SOCKET_NTHREADS", "17") is not None  # NCCL's MAX_THREADS is 16
    assert validate_value("NCCL_NSOCKS_PERTHREAD", "64") is None
    assert validate_value("NCCL_NSOCKS_PERTHREAD", "0") is not None


@pytest.mark.parametrize("name", ["azure-ndv5-h100-vm.xml", "gh200-nvl2.xml"])
def test_one_node_still_prunes_every_network_knob(name: str) -> None:
    for plan in (_plan(name), _plan(name, JobShape())):
        assert not _net_vars(plan)
        for knob in NET_KNOBS:
            assert _pruned(plan, knob) == {"*": SINGLE_NODE_NET_REASON}, knob
        assert plan.shape.nnodes == 1 and not plan.shape.crosses_nic


@pytest.mark.parametrize("name", ["azure-ndv5-h100-vm.xml", "hgx-h100-8gpu.json", "gh200-nvl2.xml"])
def test_rail_nodes_with_gdr_everywhere(name: str) -> None:
    plan = _plan(name, TWO_NODES)
    # GDR pairs by level: every pair at PXB (the own PIX or P2C-as-C2C path, and the peer's for PXN);
    # also every pair from PIX (H100) or C2C (GH200) up; none at LOC, NVL, NVB. Two classes: LOC
    # stands for "no GDR", the default covers the rest.
    assert _net_vars(plan) == {
        "NCCL_NET_GDR_LEVEL": ["LOC"],
        "NCCL_NET_GDR_READ": ["0"],
        "NCCL_PXN_DISABLE": ["1"],  # some GPU-NIC paths are PXN
        "NCCL_CROSS_NIC": ["0", "1"],  # several NICs; 2 is NCCL's default
        "NCCL_IB_QPS_PER_CONNECTION": ["2", "4"],
    }
    assert _pruned(plan, "NCCL_NET_GDR_LEVEL") == {
        "NVL": SAME_AS_LOC, "NVB": SAME_AS_LOC,
        "PIX": DEFAULT_GDR, "PXB": DEFAULT_GDR, "PHB": DEFAULT_GDR, "SYS": DEFAULT_GDR,
    }
    assert _pruned(plan, "NCCL_NET_GDR_READ") == {
        "1": "NCCL already uses GDR reads on sm80 and newer (its auto setting)"}
    for knob in ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"):
        assert _pruned(plan, knob) == {"1": RDMA_NOT_SOCKETS, "2": RDMA_NOT_SOCKETS, "4": RDMA_NOT_SOCKETS}
    assert _pruned(plan, "NCCL_PXN_DISABLE") == {}
    assert _pruned(plan, "NCCL_CROSS_NIC") == {}
    assert any("through a peer GPU" in n for n in plan.notes)


def test_dgx_a100_pix_gives_no_gdr_because_no_pair_is_pix() -> None:
    plan = _plan("dgx-a100-8gpu.json", TWO_NODES)
    # Every GPU is PXB to its complex's NICs and PXN (through a PXB peer) elsewhere: no distance is
    # PIX, so PIX enables GDR on no pair, like LOC.
    assert plan.variables["NCCL_NET_GDR_LEVEL"] == ["LOC"]
    assert _pruned(plan, "NCCL_NET_GDR_LEVEL") == {
        "NVL": SAME_AS_LOC, "NVB": SAME_AS_LOC, "PIX": SAME_AS_LOC,
        "PXB": DEFAULT_GDR, "PHB": DEFAULT_GDR, "SYS": DEFAULT_GDR,
    }
    assert plan.variables["NCCL_PXN_DISABLE"] == ["1"]


def test_socket_node_with_one_nic() -> None:
    # The 2x H200 VM: one virtio eth0, no RDMA, no GDR, no PXN.
    plan = _plan("h200x2-nvswitch-vm.json", TWO_NODES)
    assert _net_vars(plan) == {"NCCL_SOCKET_NTHREADS": ["1", "2", "4"], "NCCL_NSOCKS_PERTHREAD": ["1", "2", "4"]}
    assert set(_pruned(plan, "NCCL_NET_GDR_LEVEL").values()) == {NO_GDR}
    assert set(_pruned(plan, "NCCL_NET_GDR_READ").values()) == {
        "no GPU-NIC pair uses GDR here, so GDR reads change nothing"}
    assert _pruned(plan, "NCCL_PXN_DISABLE") == {
        "1": "no GPU reaches a NIC through a peer GPU (no PXN path), so PXN cannot change anything"}
    assert _pruned(plan, "NCCL_CROSS_NIC") == {"0": "one NIC: a ring has no other NIC to cross to",
                                               "1": "one NIC: a ring has no other NIC to cross to"}
    assert set(_pruned(plan, "NCCL_IB_QPS_PER_CONNECTION").values()) == {
        "no RDMA NIC: NCCL uses the socket transport, which has no queue pairs"}


def test_roce_nic_without_gdr() -> None:
    # One ConnectX-6 Dx (RDMA, so IB transport) without a peer-memory module: no GDR, no PXN, one NIC;
    # only the queue pairs remain.
    plan = _plan("pcie-4gpu-2socket.json", TWO_NODES)
    assert _net_vars(plan) == {"NCCL_IB_QPS_PER_CONNECTION": ["2", "4"]}
    assert set(_pruned(plan, "NCCL_NET_GDR_LEVEL").values()) == {NO_GDR}
    assert set(_pruned(plan, "NCCL_SOCKET_NTHREADS").values()) == {RDMA_NOT_SOCKETS}


def test_loopback_counts_as_crossing_a_nic_but_leaves_no_peer_for_pxn() -> None:
    loop = _plan("azure-ndv5-h100-vm.xml", JobShape(loopback=True))
    two = _plan("azure-ndv5-h100-vm.xml", TWO_NODES)
    assert loop.shape.crosses_nic
    # With P2P and SHM off NCCL trims the other GPUs from each rank's topology: no PXN. Without PXN
    # the cross-socket paths are SYS and the same-socket ones PHB, beyond every GDR level but SYS
    # (PHB keeps the same-socket pairs): GDR now has four classes, LOC, PHB, SYS and the default.
    assert _pruned(loop, "NCCL_PXN_DISABLE") == {
        "1": "NIC loopback: each rank's topology holds only its own GPU, so no peer GPU can relay"}
    expected = {k: v for k, v in _net_vars(two).items() if k not in ("NCCL_PXN_DISABLE", "NCCL_NET_GDR_LEVEL")}
    assert {k: v for k, v in _net_vars(loop).items() if k != "NCCL_NET_GDR_LEVEL"} == expected
    assert loop.variables["NCCL_NET_GDR_LEVEL"] == ["LOC", "PHB", "SYS"]
    assert _pruned(loop, "NCCL_NET_GDR_LEVEL") == {
        "NVL": SAME_AS_LOC, "NVB": SAME_AS_LOC, "PIX": DEFAULT_GDR, "PXB": DEFAULT_GDR}


def test_c2c_and_p2c_gdr_levels_match_the_default_on_grace() -> None:
    topo = load_topology(str(TOPOLOGIES / "gh200-nvl2.xml"))
    plan = build_plan(topo, compute_paths(topo), env={}, config_pins={}, unpin=[],
                      variables={"NCCL_NET_GDR_LEVEL": ["C2C", "P2C", "LOC"]}, exclude=[], policy={},
                      sizes=[1], backend="nccl", nranks=2, shape=TWO_NODES)
    # C2C: the P2C paths count as C2C (NCCL_NET_GDR_C2C=1), so all four pairs keep GDR: the default.
    # P2C likewise. LOC: none.
    assert plan.variables["NCCL_NET_GDR_LEVEL"] == ["LOC"]
    assert _pruned(plan, "NCCL_NET_GDR_LEVEL") == {"C2C": DEFAULT_GDR, "P2C": DEFAULT_GDR}


def _with_nic_vendor(vendor: str | None) -> Topology:
    """The recorded one-GPU VM (its eth0 a virtio device, no PCI function of its own), or the
    same node with eth0 a PCI function of `vendor`."""
    topo = load_topology(str(FIXTURES / "h200x1-vm.json"))
    snap = topo.snapshot
    assert snap is not None
    if vendor is None:
        return topo
    bus = "0000:00:05.0"
    nics = tuple(dataclasses.replace(n, bus_id=bus) if n.name == "eth0" else n for n in snap.sysfs.nics)
    pci = (*snap.sysfs.pci, PciDevice(bus_id=bus, class_code="0x020000", path=("pci0000:00", bus), vendor=vendor))
    sysfs = dataclasses.replace(snap.sysfs, nics=nics, pci=pci)
    return dataclasses.replace(topo, snapshot=dataclasses.replace(snap, sysfs=sysfs))


@pytest.mark.parametrize(("vendor", "auto"), [(None, False), ("0x15b3", False), ("0x1d0f", True), ("0x1ae0", True)])
def test_nccl_starts_socket_helper_threads_of_its_own_choice_only_on_aws_and_gcp_nics(
        vendor: str | None, auto: bool) -> None:
    # net_socket.cc: 2 x 8 on AWS ENA (0x1d0f), 4 x 1 on gVNIC (0x1ae0), no helper thread elsewhere
    # (the VM's virtio eth0, a Mellanox NIC as Ethernet).
    assert socket_auto_threads(_with_nic_vendor(vendor)) is auto


def test_a_topology_without_a_sysfs_reading_does_not_say_whether_nccl_starts_helper_threads() -> None:
    assert socket_auto_threads(load_topology(str(TOPOLOGIES / "azure-ndv5-h100-vm.xml"))) is None
    assert _plan("azure-ndv5-h100-vm.xml", TWO_NODES).inert_alone == {}


@pytest.mark.parametrize(("vendor", "inert"), [(None, True), ("0x1d0f", False)])
def test_the_plan_says_sockets_per_thread_alone_are_the_defaults_where_nccl_starts_no_helper_thread(
        vendor: str | None, inert: bool) -> None:
    topo = _with_nic_vendor(vendor)
    plan = build_plan(topo, compute_paths(topo), env={}, config_pins={}, unpin=[], variables={}, exclude=[],
                      policy={}, sizes=[1 << 20], backend="nccl", nranks=1, shape=TWO_NODES)
    assert ("NCCL_NSOCKS_PERTHREAD" in plan.inert_alone) is inert
