"""Raw NCCL path types and bandwidths, against matrices worked out by hand and NCCL's own log.

Every expectation below was derived from the snapshot's PCI tree as NCCL sees it (switch
upstream ports are `<pci>` nodes, a device on a root port hangs off its `<cpu>`, one `<cpu>` per
NUMA node) with NCCL 2.28's rules (paths.cc, ncclTopoSetPaths): a GPU/NIC to its switch is PIX, PCI to
PCI is PXB, a PCI hop touching a CPU is PHB, CPU to CPU is SYS, a path is its worst hop, and of
several paths NCCL keeps the one with the fewest hops, then the highest bottleneck bandwidth.
Bandwidths are NCCL's model (§1.4): NVLink per link sm90 20.6 and sm80 20 GB/s, PCIe
width x per-lane rate / 80 (Gen4 x16 = 24, Gen5 x16 = 48), inter-socket SPR 22, Ice Lake 10,
AMD 16, and a NIC's own rate (Mbps / 8000) on its NET hop.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import GOLDEN, TOPOLOGIES

from nccltune.report.machine import topology_text
from nccltune.topology.model import Topology
from nccltune.topology.ncclxml import load_xml, parse_xml
from nccltune.topology.paths import LOC_BW, PathGraph, PathMatrix, compute_paths
from nccltune.topology.source import load_topology


def _paths(name: str) -> tuple[Topology, PathMatrix]:
    topo = load_topology(str(TOPOLOGIES / f"{name}.json"))
    return topo, compute_paths(topo)


def _gpu_rows(m: PathMatrix) -> list[str]:
    return [" ".join("X" if a == b else m.gpu_gpu[(a, b)].type for b in m.gpus) for a in m.gpus]


def _nic_rows(m: PathMatrix, nics: list[str]) -> list[str]:
    return [" ".join(m.gpu_nic[(a, n)].type for n in nics) for a in m.gpus]


# -- the expected matrices, one per snapshot ------------------------------------------------------

# HGX H100: every GPU has 18 NVLinks into the NVSwitch fabric (4/5/5/4 over four switches; NCCL
# folds them into one NVS node), so every pair is GPU->NVS->GPU: NVL, 2 hops, 18 x 20.6 = 370.8.
# PCIe: GPU i and mlx5_i share one Gen5 switch (upstream 15, 3d, 4c, 5b on NUMA 0; 97, bd, cb, d9
# on NUMA 1), so GPU i <-> mlx5_i is PIX (GPU->switch->NIC, +1 hop NET = 3 hops, 48 GB/s; the
# NIC's 400 Gb/s = 50 GB/s does not cap it). Another NIC on the same socket goes
# GPU->switch->CPU->switch->NIC: PHB, 5 hops, 48 GB/s. A NIC on the other socket adds the
# CPU->CPU hop: SYS, 6 hops, capped by Sapphire Rapids' (family 6, model 143) 22 GB/s.
H100_GPU = ["X NVL NVL NVL NVL NVL NVL NVL",
            "NVL X NVL NVL NVL NVL NVL NVL",
            "NVL NVL X NVL NVL NVL NVL NVL",
            "NVL NVL NVL X NVL NVL NVL NVL",
            "NVL NVL NVL NVL X NVL NVL NVL",
            "NVL NVL NVL NVL NVL X NVL NVL",
            "NVL NVL NVL NVL NVL NVL X NVL",
            "NVL NVL NVL NVL NVL NVL NVL X"]
H100_NICS = [f"mlx5_{i}" for i in range(8)]
H100_NIC = ["PIX PHB PHB PHB SYS SYS SYS SYS",
            "PHB PIX PHB PHB SYS SYS SYS SYS",
            "PHB PHB PIX PHB SYS SYS SYS SYS",
            "PHB PHB PHB PIX SYS SYS SYS SYS",
            "SYS SYS SYS SYS PIX PHB PHB PHB",
            "SYS SYS SYS SYS PHB PIX PHB PHB",
            "SYS SYS SYS SYS PHB PHB PIX PHB",
            "SYS SYS SYS SYS PHB PHB PHB PIX"]

# DGX A100: all pairs through six NVSwitches, 2 links to each = 12 x 20 = 240 GB/s, NVL, 2 hops.
# PCIe is *not* the H100 layout: each complex is a three-level PEX88096 tree. For NUMA 3:
#   01 -> 03 -> 05 -> GPU0 (07)
#      -> 0a -> mlx5_0 (0c)
#            -> 0d -> GPU1 (0f)
#      -> 10 -> mlx5_1 (12)
# No GPU shares its last switch with a NIC, so no pair is PIX: GPU1->0d->0a->mlx5_0 crosses two
# switches (PXB, 4 hops with NET), GPU0->05->03->01->0a->mlx5_0 four (PXB, 6 hops); all stay
# below the CPU, at Gen4 x16 = 24 GB/s (the HDR NIC's 25 GB/s does not cap). NPS4 makes each
# quadrant its own NUMA node and so its own <cpu>: even the other complex on the same socket is
# across a CPU->CPU link, SYS, 9 hops, 16 GB/s (AMD). GPUs 0,1 are NUMA 3 with mlx5_0/1; 2,3 NUMA
# 1 with mlx5_2/3; 4,5 NUMA 7 with mlx5_4/5; 6,7 NUMA 5 with mlx5_6/7 (nvidia-smi topo -m of a
# DGX A100 says the same: PXB to the complex's two NICs, SYS to the rest).
A100_GPU = H100_GPU
A100_NICS = [f"mlx5_{i}" for i in range(8)]
A100_NIC = ["PXB PXB SYS SYS SYS SYS SYS SYS",
            "PXB PXB SYS SYS SYS SYS SYS SYS",
            "SYS SYS PXB PXB SYS SYS SYS SYS",
            "SYS SYS PXB PXB SYS SYS SYS SYS",
            "SYS SYS SYS SYS PXB PXB SYS SYS",
            "SYS SYS SYS SYS PXB PXB SYS SYS",
            "SYS SYS SYS SYS SYS SYS PXB PXB",
            "SYS SYS SYS SYS SYS SYS PXB PXB"]

# PCIe 4 GPUs, 2 sockets, no NVLink: GPUs 0,1 behind one PEX88048 on socket 0 and GPUs 2,3 behind
# another on socket 1, so 0-1 and 2-3 are PIX (GPU->switch->GPU, 2 hops, Gen4 x16 = 24 GB/s; the
# GPUs idle at Gen1 but the file states the maximum link). Across sockets
# GPU->switch->CPU->CPU->switch->GPU is SYS, 5 hops, Ice Lake (model 106 >= 0x55) 10 GB/s.
# The one NIC, a 100 GbE ConnectX-6 Dx on a socket-0 root port: PHB from GPUs 0,1 (4 hops, capped
# by its own 100 Gb/s = 12.5 GB/s), SYS from GPUs 2,3 (5 hops, 10 GB/s).
PCIE4_GPU = ["X PIX SYS SYS",
             "PIX X SYS SYS",
             "SYS SYS X PIX",
             "SYS SYS PIX X"]
PCIE4_NICS = ["mlx5_0"]
PCIE4_NIC = ["PHB", "PHB", "SYS", "SYS"]

# Two A100 PCIe joined by three bridges (12 links): the direct NVLink (1 hop, 12 x 20 = 240 GB/s)
# beats the 2-hop, 24 GB/s PIX route through their common switch. The only NIC, an I350 on a root
# port of the same (only) NUMA node, is GPU->switch->CPU->NIC: PHB, 4 hops, 1 Gb/s = 0.125 GB/s.
BRIDGE_GPU = ["X NVL",
              "NVL X"]
BRIDGE_NICS = ["eno1"]
BRIDGE_NIC = ["PHB", "PHB"]

# The 2x H200 VM: each GPU's 18 links go to an NVSwitch the VM cannot see, so NVL through NVS,
# 2 hops, 370.8 GB/s; the virtio eth0 hangs off the CPU, so GPU->CPU->NIC->NET: PHB, 3 hops,
# at the socket transport's default 10 Gb/s = 1.25 GB/s. (NCCL's own log, checked below.)
H200_GPU = BRIDGE_GPU
H200_NICS = ["eth0"]
H200_NIC = ["PHB", "PHB"]

EXPECTED = {
    "hgx-h100-8gpu": (H100_GPU, H100_NICS, H100_NIC),
    "dgx-a100-8gpu": (A100_GPU, A100_NICS, A100_NIC),
    "pcie-4gpu-2socket": (PCIE4_GPU, PCIE4_NICS, PCIE4_NIC),
    "pcie-2gpu-nvlink-bridge": (BRIDGE_GPU, BRIDGE_NICS, BRIDGE_NIC),
    "h200x2-nvswitch-vm": (H200_GPU, H200_NICS, H200_NIC),
}

# (path type -> (bandwidth GB/s, hops)) per snapshot, GPU-GPU and GPU-NIC apart.
BANDWIDTHS: dict[str, tuple[dict[str, tuple[float, int]], dict[str, tuple[float, int]]]] = {
    "hgx-h100-8gpu": ({"NVL": (370.8, 2)}, {"PIX": (48.0, 3), "PHB": (48.0, 5), "SYS": (22.0, 6)}),
    "dgx-a100-8gpu": ({"NVL": (240.0, 2)}, {"PXB": (24.0, -1), "SYS": (16.0, 9)}),
    "pcie-4gpu-2socket": ({"PIX": (24.0, 2), "SYS": (10.0, 5)}, {"PHB": (12.5, 4), "SYS": (10.0, 5)}),
    "pcie-2gpu-nvlink-bridge": ({"NVL": (240.0, 1)}, {"PHB": (0.125, 4)}),
    "h200x2-nvswitch-vm": ({"NVL": (370.8, 2)}, {"PHB": (1.25, 3)}),
}


def test_every_snapshot_has_an_expectation() -> None:
    assert {p.stem for p in TOPOLOGIES.glob("*.json")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_path_type_matrix(name: str) -> None:
    gpu_rows, nics, nic_rows = EXPECTED[name]
    _, m = _paths(name)
    assert m.gpus == list(range(len(gpu_rows)))
    assert sorted(m.nics) == sorted(nics)
    assert _gpu_rows(m) == gpu_rows
    assert _nic_rows(m, nics) == nic_rows


@pytest.mark.parametrize("name", sorted(BANDWIDTHS))
def test_bandwidths_and_hops(name: str) -> None:
    gpu_bw, nic_bw = BANDWIDTHS[name]
    _, m = _paths(name)
    for (a, b), p in m.gpu_gpu.items():
        if a == b:
            assert (p.type, p.bw_gbps, p.hops) == ("LOC", LOC_BW, 0)
            continue
        assert (p.bw_gbps, p.hops) == gpu_bw[p.type], (a, b, p)
    for (a, n), p in m.gpu_nic.items():
        bw, hops = nic_bw[p.type]
        assert p.bw_gbps == bw, (a, n, p)
        if hops >= 0:
            assert p.hops == hops, (a, n, p)


def test_a100_pxb_hop_counts_follow_the_switch_levels() -> None:
    # GPU1 (0f) shares the level-2 switch 0a with mlx5_0: NET, NIC, 0a, 0d, GPU = 4 hops; GPU0 (07)
    # meets it only at level 1 (01): NET, NIC, 0a, 01, 03, 05, GPU = 6 hops. Both PXB.
    _, m = _paths("dgx-a100-8gpu")
    assert (m.gpu_nic[(1, "mlx5_0")].type, m.gpu_nic[(1, "mlx5_0")].hops) == ("PXB", 4)
    assert (m.gpu_nic[(0, "mlx5_0")].type, m.gpu_nic[(0, "mlx5_0")].hops) == ("PXB", 6)
    assert (m.gpu_nic[(0, "mlx5_1")].type, m.gpu_nic[(0, "mlx5_1")].hops) == ("PXB", 6)
    assert (m.gpu_nic[(1, "mlx5_1")].type, m.gpu_nic[(1, "mlx5_1")].hops) == ("PXB", 6)


@pytest.mark.parametrize("name,links", [("hgx-h100-8gpu", 18), ("dgx-a100-8gpu", 12),
                                        ("pcie-2gpu-nvlink-bridge", 12), ("h200x2-nvswitch-vm", 18)])
def test_nvlink_count_shown_per_pair(name: str, links: int) -> None:
    topo, m = _paths(name)
    assert {p.nvlinks for (a, b), p in m.gpu_gpu.items() if a != b} == {links}
    assert f"NV{links}" in topology_text(topo, m)


def test_types_between_gpus_leave_out_refused_pairs() -> None:
    _, m = _paths("pcie-4gpu-2socket")
    assert m.types_between_gpus() == {"PIX", "SYS"}
    assert m.types_between_gpus({(0, 1), (2, 3)}) == {"SYS"}


# -- NCCL's own view of the reference machine -----------------------------------------------------

_PATH_ENTRY = re.compile(r"(GPU|NET|NVS|CPU)/([0-9a-f]+)-([0-9a-f]+) \((\d+)/([\d.]+)/([A-Z0-9]+)\)")


def _nccl_path_lines() -> dict[str, dict[str, tuple[int, str, str]]]:
    """`GPU/0-60 :GPU/0-70 (2/370.8/NVL) ...` -> {"GPU/60": {"GPU/70": (2, "370.8", "NVL")}}."""
    out: dict[str, dict[str, tuple[int, str, str]]] = {}
    for line in (GOLDEN / "h200x2-nvswitch-vm.nccl-graph-log.txt").read_text().splitlines():
        m = re.search(r"INFO ((?:GPU|NET)/[0-9a-f]+-([0-9a-f]+)) :(.*)$", line)
        if not m:
            continue
        src = f"{m.group(1).split('/')[0]}/{m.group(2)}"
        out[src] = {f"{kind}/{local}": (int(hops), bw, ptype)
                    for kind, _sys, local, hops, bw, ptype in _PATH_ENTRY.findall(m.group(3))}
    return out


def _nccl_gpu_id(bus_id: str) -> str:
    """NCCL's node id of a GPU: the bus id's hex digits as one number (busIdToInt64)."""
    return f"GPU/{int(re.sub('[:.]', '', bus_id), 16):x}"


@pytest.mark.parametrize("source", ["snapshot", "nccl-dump"])
def test_h200_paths_match_nccl_log(source: str) -> None:
    """Our paths for the reference VM equal NCCL 2.28.9's own GRAPH lines, hop for hop.

    Both from our snapshot of the VM and from NCCL's own dump of it: GPU-GPU (2/370.8/NVL) and
    GPU-NET (3/1.2/PHB), NCCL printing bandwidth with one decimal (1.25 -> "1.2").
    """
    if source == "snapshot":
        topo = load_topology(str(TOPOLOGIES / "h200x2-nvswitch-vm.json"))
    else:
        topo = load_xml(GOLDEN / "h200x2-nvswitch-vm.nccl-dump.xml")
    m = compute_paths(topo)
    nccl = _nccl_path_lines()
    ids = {g.index: _nccl_gpu_id(g.bus_id) for g in topo.gpus}
    assert set(ids.values()) == {"GPU/60", "GPU/70"}
    assert m.nics == ["eth0"]  # NET/0-0: the only network device, plugin index 0
    for a in m.gpus:
        for b in m.gpus:
            p = m.gpu_gpu[(a, b)]
            assert (p.hops, f"{p.bw_gbps:.1f}", p.type) == nccl[ids[a]][ids[b]], (a, b)
        p = m.gpu_nic[(a, "eth0")]
        assert (p.hops, f"{p.bw_gbps:.1f}", p.type) == nccl[ids[a]]["NET/0"] == (3, "1.2", "PHB")
        assert p.bw_gbps == 1.25
        # The NET line prints the same paths seen from the NIC's side.
        assert nccl["NET/0"][ids[a]] == (3, "1.2", "PHB")
    assert nccl[ids[0]][ids[1]] == (2, "370.8", "NVL")


def test_h200_paths_to_cpu_and_nvswitch_match_nccl_log() -> None:
    """The intermediate nodes too: GPU->NVS (1/370.8/NVL), GPU->CPU (1/48.0/PHB), NET->CPU (2/1.2/PHB)."""
    topo = load_xml(GOLDEN / "h200x2-nvswitch-vm.nccl-dump.xml")
    graph = PathGraph(topo)
    nccl = _nccl_path_lines()
    for idx, key in graph.gpu_keys.items():
        gpu_id = _nccl_gpu_id(topo.gpu(idx).bus_id)
        to_nvs = graph.paths_from("NVS")[key]
        to_cpu = graph.paths_from("CPU0")[key]
        assert (to_nvs.hops, f"{to_nvs.bw_gbps:.1f}", to_nvs.type) == nccl[gpu_id]["NVS/0"]
        assert (to_cpu.hops, f"{to_cpu.bw_gbps:.1f}", to_cpu.type) == nccl[gpu_id]["CPU/ffffffffffffff"]
    net_to_cpu = graph.paths_from("CPU0")["NIC:eth0"]
    # NCCL counts the NET->NIC hop; our NIC node is one hop closer, at the NIC's own rate.
    assert (net_to_cpu.hops + 1, net_to_cpu.type) == nccl["NET/0"]["CPU/ffffffffffffff"][0::2]


# -- hand-built topologies -------------------------------------------------------------------------

def _xml(tmp_path: Path, body: str, name: str = "t.xml") -> Topology:
    path = tmp_path / name
    path.write_text(body)
    return load_xml(path)


def _gpu_pci(bus: str, dev: int, links: list[tuple[str, int]], sm: int = 80,
             speed: str = "16.0 GT/s PCIe", indent: str = "    ") -> str:
    nvl = "".join(f'{indent}    <nvlink target="{t}" count="{c}" tclass="0x030200"/>\n' for t, c in links)
    gpu = (f'{indent}  <gpu dev="{dev}" sm="{sm}" rank="{dev}" gdr="1">\n{nvl}{indent}  </gpu>\n' if links
           else f'{indent}  <gpu dev="{dev}" sm="{sm}" rank="{dev}" gdr="1"/>\n')
    return (f'{indent}<pci busid="{bus}" class="0x030200" link_speed="{speed}" link_width="16">\n'
            f"{gpu}{indent}</pci>\n")


AMD_CPU = '<cpu numaid="0" arch="x86_64" vendor="AuthenticAMD" familyid="25" modelid="1">'


def test_partial_nvlink_mesh_gives_nvb(tmp_path: Path) -> None:
    """0-1 and 1-2 NVLinked directly (4 links each), 0-2 only through GPU1: NVB.

    Each GPU sits on its own root port, so the PCIe route 0->CPU->2 is also 2 hops but only
    24 GB/s (PHB); the NVLink route through GPU1 carries min(4 x 20, 4 x 20) = 80 GB/s and wins.
    """
    topo = _xml(tmp_path, (
        '<system version="1">\n'
        f"  {AMD_CPU}\n"
        + _gpu_pci("0000:01:00.0", 0, [("0000:02:00.0", 4)])
        + _gpu_pci("0000:02:00.0", 1, [("0000:01:00.0", 4), ("0000:03:00.0", 4)])
        + _gpu_pci("0000:03:00.0", 2, [("0000:02:00.0", 4)])
        + "  </cpu>\n</system>\n"))
    m = compute_paths(topo)
    assert _gpu_rows(m) == ["X NVL NVB", "NVL X NVL", "NVB NVL X"]
    for a, b in ((0, 2), (2, 0)):
        p = m.gpu_gpu[(a, b)]
        assert (p.type, p.bw_gbps, p.hops, p.nvlinks) == ("NVB", 80.0, 2, 4)
    assert (m.gpu_gpu[(0, 1)].bw_gbps, m.gpu_gpu[(0, 1)].hops) == (80.0, 1)
    assert m.types_between_gpus() == {"NVL", "NVB"}
    text = topology_text(topo, m)
    assert re.search(r"^GPU0\s+X\s+NV4\s+NVB\b", text, re.M), text


def test_equal_length_paths_are_chosen_by_bandwidth_not_type(tmp_path: Path) -> None:
    """NCCL keeps the shortest path with the most bandwidth; the path type plays no part.

    Three GPUs behind one Gen4 switch, 0-1 and 1-2 joined by a single NVLink (20 GB/s at sm80).
    0->switch->2 and 0->GPU1->2 are both 2 hops; the switch gives 24 GB/s, NVLink through GPU1
    only 20, so NCCL's BFS (paths.cc ncclTopoSetPaths: replace only on more bandwidth) says PIX.
    Preferring the lower type would have said NVB.
    """
    switch = ('    <pci busid="0000:10:00.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16">\n'
              + _gpu_pci("0000:11:00.0", 0, [("0000:12:00.0", 1)], indent="      ")
              + _gpu_pci("0000:12:00.0", 1, [("0000:11:00.0", 1), ("0000:13:00.0", 1)], indent="      ")
              + _gpu_pci("0000:13:00.0", 2, [("0000:12:00.0", 1)], indent="      ")
              + "    </pci>\n")
    topo = _xml(tmp_path, f'<system version="1">\n  {AMD_CPU}\n{switch}  </cpu>\n</system>\n')
    m = compute_paths(topo)
    assert (m.gpu_gpu[(0, 2)].type, m.gpu_gpu[(0, 2)].bw_gbps, m.gpu_gpu[(0, 2)].hops) == ("PIX", 24.0, 2)
    assert (m.gpu_gpu[(0, 1)].type, m.gpu_gpu[(0, 1)].bw_gbps, m.gpu_gpu[(0, 1)].hops) == ("NVL", 20.0, 1)
    # With 2 links per pair (40 GB/s) the NVLink route is faster and NVB comes back.
    topo2 = _xml(tmp_path, f'<system version="1">\n  {AMD_CPU}\n{switch}  </cpu>\n</system>\n'
                 .replace('count="1"', 'count="2"'), "t2.xml")
    p = compute_paths(topo2).gpu_gpu[(0, 2)]
    assert (p.type, p.bw_gbps, p.hops) == ("NVB", 40.0, 2)


def _two_sockets(cpu_attrs: str) -> str:
    gen5 = "32.0 GT/s PCIe"
    return ('<system version="1">\n'
            f'  <cpu numaid="0" {cpu_attrs}>\n' + _gpu_pci("0000:17:00.0", 0, [], speed=gen5) + "  </cpu>\n"
            f'  <cpu numaid="1" {cpu_attrs}>\n' + _gpu_pci("0000:97:00.0", 1, [], speed=gen5) + "  </cpu>\n"
            "</system>\n")


@pytest.mark.parametrize("cpu_attrs,bw", [
    ('arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143"', 22.0),  # Sapphire Rapids
    ('arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="207"', 40.0),  # Emerald Rapids
    ('arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="106"', 10.0),  # Ice Lake (SKL class)
    ('arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="79"', 6.0),  # Broadwell
    # The generations count only for family 6 (topo.cc ncclTopoAddCpu); others get Broadwell's.
    ('arch="x86_64" vendor="GenuineIntel" familyid="19" modelid="207"', 6.0),
    ('arch="x86_64" vendor="AuthenticAMD" familyid="25" modelid="1"', 16.0),
    ('arch="x86_64" vendor="CentaurHauls" familyid="7" modelid="91"', 9.0),  # Zhaoxin Yongfeng
    ('arch="x86_64" vendor="CentaurHauls" familyid="7" modelid="59"', 6.0),
    ('arch="arm64"', 6.0),
    ('arch="ppc64"', 32.0),
    # An unknown vendor leaves NCCL's LOC_BW: the socket link looks free, the PCIe links cap it.
    ('arch="x86_64" vendor="HygonGenuine" familyid="24" modelid="1"', 48.0),
])
def test_gpus_on_two_sockets_are_sys(tmp_path: Path, cpu_attrs: str, bw: float) -> None:
    topo = _xml(tmp_path, _two_sockets(cpu_attrs))
    m = compute_paths(topo)
    for pair in ((0, 1), (1, 0)):
        p = m.gpu_gpu[pair]
        # GPU -> CPU0 -> CPU1 -> GPU; Gen5 x16 (48 GB/s) on both ends.
        assert (p.type, p.hops, p.bw_gbps) == ("SYS", 3, bw)


def test_gpus_on_one_cpu_without_a_switch_are_phb(tmp_path: Path) -> None:
    body = ('<system version="1">\n'
            '  <cpu numaid="0" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">\n'
            + _gpu_pci("0000:17:00.0", 0, [], speed="32.0 GT/s PCIe")
            + _gpu_pci("0000:27:00.0", 1, [], speed="32.0 GT/s PCIe")
            + "  </cpu>\n</system>\n")
    p = compute_paths(_xml(tmp_path, body)).gpu_gpu[(0, 1)]
    assert (p.type, p.hops, p.bw_gbps) == ("PHB", 2, 48.0)


def test_pci_width_and_speed_as_nccl_models_them(tmp_path: Path) -> None:
    """link_width 0 or empty is x16; an unknown speed is Gen3 (60 per lane): 16 x 60 / 80 = 12."""
    body = _two_sockets('arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="207"')
    cases = {('link_speed="32.0 GT/s PCIe" link_width="16"', 'link_speed="32.0 GT/s PCIe" link_width="0"'): 40.0,
             ('link_speed="32.0 GT/s PCIe" link_width="16"', 'link_speed="16.0 GT/s PCIe" link_width="8"'): 12.0,
             ('link_speed="32.0 GT/s PCIe" link_width="16"', 'link_speed="" link_width="16"'): 12.0}
    for (old, new), bw in cases.items():
        topo = _xml(tmp_path, body.replace(old, new, 1))
        assert compute_paths(topo).gpu_gpu[(0, 1)].bw_gbps == bw, new


def test_nvswitch_links_add_up_to_one_nvs_node() -> None:
    """Four NVSwitch targets (5/4/4/5) and one target with count 18 model the same 370.8 GB/s."""
    base = (GOLDEN / "h200x2-nvswitch-vm.nccl-dump.xml").read_text()
    split = "".join(f'        <nvlink target="0000:0{i}:00.0" count="{c}" tclass="0x068000"/>\n'
                    for i, c in zip(range(5, 9), (5, 4, 4, 5), strict=True))
    text = base.replace('        <nvlink target="fffffff:ff:ff.0" count="18" tclass="0x068000"/>\n', split)
    assert text.count("<nvlink") == 8
    m = compute_paths(_topo_of(text))
    assert (m.gpu_gpu[(0, 1)].type, m.gpu_gpu[(0, 1)].bw_gbps, m.gpu_gpu[(0, 1)].nvlinks) == ("NVL", 370.8, 18)


def _topo_of(text: str) -> Topology:
    from nccltune.topology.model import from_xml_tree

    return from_xml_tree(parse_xml(text, "<test>"), source="test")


@pytest.mark.parametrize("spelling", ["0000:44:00.0", "0000:44:00.0".upper(), "00000000:44:00.0"])
def test_nvlink_gpu_target_is_matched_as_a_number(spelling: str) -> None:
    """NCCL matches a GPU NVLink target by its numeric bus id (busIdToInt64), so NVML's 8-digit
    domain or upper case in a target still joins the two GPUs; counts may be hex (strtol)."""
    text = (GOLDEN / "pcie-2gpu-nvlink-bridge.xml").read_text()
    text = text.replace('target="0000:44:00.0" count="12"', f'target="{spelling}" count="0xc"')
    m = compute_paths(_topo_of(text))
    # Both directions: GPU1's path to GPU0 is searched from GPU0, over GPU0's own (edited) link.
    for pair in ((0, 1), (1, 0)):
        p = m.gpu_gpu[pair]
        assert (p.type, p.hops, p.bw_gbps, p.nvlinks) == ("NVL", 1, 240.0, 12), pair
