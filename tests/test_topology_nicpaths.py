"""Final GPU-NIC paths and the NIC per GPU, against expectations worked out by hand.

The raw types are the ones tests/test_topology_paths.py checks. The final types follow NCCL
2.28's `paths.cc:ncclTopoComputePaths` (P2C, then PXN, then the GDR detour through the CPU) and
the NIC per GPU `topo.cc:ncclTopoGetLocalNet`; each expectation below says how it was derived.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nccltune.cli import main
from nccltune.report.machine import topology_doc, topology_text
from nccltune.topology.nicpaths import (
    NicPathOptions,
    NicPaths,
    _mirror_bits,
    compute_nic_paths,
    merge_path_type,
)
from nccltune.topology.paths import compute_paths
from nccltune.topology.source import load_topology

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ROOT / "topologies"


def _nic_paths(name: str, options: NicPathOptions | None = None) -> NicPaths:
    topo = load_topology(str(TOPOLOGIES / name))
    return compute_nic_paths(topo, compute_paths(topo), options)


def _rows(r: NicPaths, nics: list[str], *, via: bool = True) -> list[str]:
    def cell(g: int, n: str) -> str:
        p = r.paths[(g, n)]
        return p.final_type + (f"@{p.via_gpu}" if via and p.via_gpu is not None else "")
    return [" ".join(cell(g, n) for n in nics) for g in r.gpus]


def _raw_rows(r: NicPaths, nics: list[str]) -> list[str]:
    return [" ".join(r.paths[(g, n)].raw_type for n in nics) for g in r.gpus]


def _pxn_rows(nics: int, own: str, groups: list[list[int]] | None = None) -> list[str]:
    """GPU i: `own` to the NICs of its group, PXN@j to NIC j elsewhere (NIC j's local GPU is j)."""
    groups = groups or [[i] for i in range(nics)]
    group_of = {i: g for g in groups for i in g}
    return [" ".join(own if j in group_of[i] else f"PXN@{j}" for j in range(nics)) for i in range(nics)]


# -- the expectations, one per recording -----------------------------------------------------------

# HGX H100 and the Azure ND H100 v5 VM have the same shape: GPU i and NIC i under one switch (PIX,
# 48 GB/s), PHB to the three other NICs of the socket and SYS (22 GB/s) to the four of the other.
# NIC j's local GPU is GPU j (PIX beats PHB at the same 48 GB/s). For any other GPU g, GPU j is PIX
# (<= P2C with NCCL_PXN_C2C=1) to NIC j, NVLink to g, and g's own PHB/SYS is worse than PXN: PXN
# through GPU j, 56 of 64 cells. PXN pairs keep GDR (the peer's PIX distance is within PXB).
H100_NICS = [f"mlx5_{i}" for i in range(8)]
NDV5_NICS = [f"mlx5_ib{i}" for i in range(8)]
H100_FINAL = _pxn_rows(8, "PIX")

# DGX A100: GPUs 2k, 2k+1 are PXB (24 GB/s) to both NICs of their complex, SYS (16 GB/s) elsewhere.
# NIC 2k+m's local GPUs are GPUs 2k and 2k+1 (both PXB at 24); the one that picks it on some
# channel is GPU 2k+m (see the NIC choice below), so that is the PXN peer. Within a complex the
# peer's 24 GB/s is not more than the GPU's own 24 and PXB is not worse than PXN: no PXN there.
# Elsewhere SYS is worse than PXN: PXN through GPU j to NIC j. 48 of 64 cells.
A100_NICS = [f"mlx5_{i}" for i in range(8)]
A100_FINAL = _pxn_rows(8, "PXB", [[0, 1], [2, 3], [4, 5], [6, 7]])

# GH200 NVL2: GPU i reaches Grace i over C2C (450 GB/s beats its 48 GB/s PCIe link of the same one
# hop), its NIC hangs off Grace i (PHB), so PHB merged with C2C: P2C. To the other Grace's NIC the raw
# path is SYS (6 GB/s, ARM); that NIC's GPU is P2C to it (<= P2C) and NVLink to us: PXN, 48 GB/s.
GH200_NICS = ["mlx5_0", "mlx5_1"]
GH200_RAW = ["PHB SYS", "SYS PHB"]
GH200_FINAL = ["P2C PXN@1", "PXN@0 P2C"]

# (file, NICs in column order, final rows, PXN cells, NIC per GPU on channel 0)
EXPECTED: dict[str, tuple[list[str], list[str], int, list[str]]] = {
    "hgx-h100-8gpu.json": (H100_NICS, H100_FINAL, 56, H100_NICS),
    "azure-ndv5-h100-vm.xml": (NDV5_NICS, H100_FINAL, 56, NDV5_NICS),
    "dgx-a100-8gpu.json": (A100_NICS, A100_FINAL, 48, A100_NICS),
    "gh200-nvl2.xml": (GH200_NICS, GH200_FINAL, 2, GH200_NICS),
    # One virtio eth0 without GDR: PHB stays PHB (nothing below PHB, no NVLink-connected NIC GPU).
    "h200x2-nvswitch-vm.json": (["eth0"], ["PHB", "PHB"], 0, ["eth0", "eth0"]),
    # One NIC on socket 0, no GDR (no peer-memory module) and no NVLink: raw types stay.
    "pcie-4gpu-2socket.json": (["mlx5_0"], ["PHB", "PHB", "SYS", "SYS"], 0, ["mlx5_0"] * 4),
    # NVLink between the GPUs, but the I350 has no GDR and both GPUs are PHB to it: nothing to win.
    "pcie-2gpu-nvlink-bridge.json": (["eno1"], ["PHB", "PHB"], 0, ["eno1", "eno1"]),
}


def test_every_recording_has_an_expectation() -> None:
    names = {p.name for p in TOPOLOGIES.iterdir() if p.suffix in (".json", ".xml")}
    assert names == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_final_types_pxn_count_and_nic_choice(name: str) -> None:
    nics, rows, pxn, chosen = EXPECTED[name]
    r = _nic_paths(name)
    assert sorted(r.nics) == sorted(nics)
    assert _rows(r, nics) == rows
    assert r.count("PXN") == pxn
    assert [r.choice[g].nic for g in r.gpus] == chosen
    for p in r.paths.values():
        # A PXN path is as fast as the peer's own path to the NIC, and only PXN names a peer.
        assert (p.via_gpu is not None) == (p.final_type == "PXN")
        if p.via_gpu is not None:
            assert p.final_bw_gbps == r.paths[(p.via_gpu, p.nic)].final_bw_gbps


@pytest.mark.parametrize("name", ["hgx-h100-8gpu.json", "azure-ndv5-h100-vm.xml"])
def test_h100_layouts_pxn_bandwidth_beats_the_raw_path(name: str) -> None:
    r = _nic_paths(name)
    nics = H100_NICS if name.startswith("hgx") else NDV5_NICS
    # GPU0 -> NIC4 (other socket): raw SYS at Sapphire Rapids' 22 GB/s, PXN through GPU4 at 48.
    p = r.paths[(0, nics[4])]
    assert (p.raw_type, p.raw_bw_gbps, p.final_type, p.final_bw_gbps, p.via_gpu) == ("SYS", 22.0, "PXN", 48.0, 4)
    # GPU0 -> NIC1 (same socket): raw PHB at 48, PXN at 48 (chosen because PHB is worse than PXN).
    p = r.paths[(0, nics[1])]
    assert (p.raw_type, p.raw_bw_gbps, p.final_type, p.final_bw_gbps) == ("PHB", 48.0, "PXN", 48.0)
    assert r.gdr_pairs() == frozenset(r.paths)  # every pair: own PIX, or the peer's PIX for PXN
    assert all(c.local_nics == (c.nic,) and c.nics_per_gpu == 1 for c in r.choice.values())


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n != "gh200-nvl2.xml"))
def test_pxn_disabled_gives_the_raw_types_back(name: str) -> None:
    nics = EXPECTED[name][0]
    r = _nic_paths(name, NicPathOptions(pxn_disable=True))
    assert _rows(r, nics) == _raw_rows(r, nics)
    assert r.count("PXN") == 0
    assert all(p.via_gpu is None for p in r.paths.values())


def test_gh200_p2c_where_raw_is_phb_and_pxn_c2c_gates_the_cross_paths() -> None:
    r = _nic_paths("gh200-nvl2.xml")
    assert _raw_rows(r, GH200_NICS) == GH200_RAW
    assert r.count("P2C") == 2
    own = r.paths[(0, "mlx5_0")]
    assert (own.raw_type, own.final_type, own.final_bw_gbps, own.gdr) == ("PHB", "P2C", 48.0, True)
    cross = r.paths[(0, "mlx5_1")]
    assert (cross.raw_type, cross.raw_bw_gbps, cross.final_type, cross.via_gpu, cross.gdr) == (
        "SYS", 6.0, "PXN", 1, True)
    # NCCL_PXN_C2C=0: a peer must be <= PXB to its NIC, and P2C is not: the cross paths stay SYS.
    off = _nic_paths("gh200-nvl2.xml", NicPathOptions(pxn_c2c=False))
    assert _rows(off, GH200_NICS) == ["P2C SYS", "SYS P2C"]
    # NCCL_PXN_DISABLE=1 leaves P2C alone (it is not a PXN path).
    assert _rows(_nic_paths("gh200-nvl2.xml", NicPathOptions(pxn_disable=True)), GH200_NICS) == ["P2C SYS", "SYS P2C"]
    # NCCL_NET_GDR_C2C=0: a P2C distance is no longer counted as C2C, and P2C is above PXB: no GDR,
    # so the own path is sent through the CPU (C2C merged with PHB, still P2C) and PXN is undone.
    no_c2c = _nic_paths("gh200-nvl2.xml", NicPathOptions(net_gdr_c2c=False))
    assert not no_c2c.gdr_pairs()
    assert _rows(no_c2c, GH200_NICS) == ["P2C SYS", "SYS P2C"]


@pytest.mark.parametrize("version", [(2, 28), (2, 29), (2, 30)])
def test_recordings_agree_across_the_version_differences(version: tuple[int, int]) -> None:
    # The 2.29 (P2C only on local NICs) and 2.30 (PXN needs the peer's GDR) changes do not move any
    # cell of the bundled recordings: one NIC per Grace, and GDR wherever PXN is used.
    for name, (nics, rows, _pxn, chosen) in EXPECTED.items():
        r = _nic_paths(name, NicPathOptions(nccl_version=version))
        assert _rows(r, nics) == rows, name
        assert [r.choice[g].nic for g in r.gpus] == chosen, name


def test_dgx_a100_nic_choice_mirrors_the_gpu_index_over_the_two_local_nics() -> None:
    r = _nic_paths("dgx-a100-8gpu.json")
    for g in range(8):
        c = r.choice[g]
        k = g // 2
        # Two local NICs (PXB, 24 GB/s each); each is local to two GPUs, so one NIC per GPU.
        assert c.local_nics == (f"mlx5_{2 * k}", f"mlx5_{2 * k + 1}")
        assert c.nics_per_gpu == 1
        # Two is a power of two: index = mirrorBits(dev, 2) = dev's low bit.
        assert c.nic == f"mlx5_{2 * k + (g & 1)}"


def test_gdr_level_loc_sends_every_path_through_the_cpu() -> None:
    r = _nic_paths("azure-ndv5-h100-vm.xml", NicPathOptions(gdr_level="LOC"))
    assert not r.gdr_pairs()
    # Without GDR NCCL sends paths better than PHB through the GPU's CPU: the own PIX becomes PHB
    # (GPU -> CPU -> NIC), PXN is undone; to the other socket it is SYS.
    assert _rows(r, NDV5_NICS) == ["PHB PHB PHB PHB SYS SYS SYS SYS"] * 4 + ["SYS SYS SYS SYS PHB PHB PHB PHB"] * 4


def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "topo.xml"
    path.write_text(f'<system version="1">\n{body}</system>\n')
    return str(path)


def test_a_nic_without_gdr_is_not_reached_by_pxn(tmp_path: Path) -> None:
    text = (TOPOLOGIES / "azure-ndv5-h100-vm.xml").read_text()
    text = text.replace('name="mlx5_ib1" dev="1" speed="400000" port="1" gdr="1"',
                        'name="mlx5_ib1" dev="1" speed="400000" port="1" gdr="0"')
    path = tmp_path / "ndv5-nogdr.xml"
    path.write_text(text)
    topo = load_topology(str(path))
    for version in ((2, 28), (2, 30)):
        r = compute_nic_paths(topo, compute_paths(topo), NicPathOptions(nccl_version=version))
        # 2.28 makes GPU0->mlx5_ib1 PXN and then undoes it (no GDR: through the CPU); 2.30 never makes
        # it. GPU1's own PIX goes through its CPU too. Socket 1 GPUs stay SYS.
        column = [r.paths[(g, "mlx5_ib1")].final_type for g in r.gpus]
        assert column == ["PHB"] * 4 + ["SYS"] * 4, version
        assert r.count("PXN") == 49  # the other seven NICs keep their 7 PXN cells each
        assert r.paths[(0, "mlx5_ib2")].final_type == "PXN"


C2C_ONE_GPU_TWO_NICS = '''  <cpu numaid="0" arch="arm64">
    <pci busid="0000:01:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
      <nic>
        <net name="fast" dev="0" speed="400000" gdr="1"/>
      </nic>
    </pci>
    <pci busid="0002:01:00.0" class="0x020000" link_speed="32.0 GT/s PCIe" link_width="16">
      <nic>
        <net name="slow" dev="1" speed="100000" gdr="1"/>
      </nic>
    </pci>
    <pci busid="0009:01:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
      <gpu dev="0" sm="90" gdr="1">
        <c2c bw="45000" count="10"/>
      </gpu>
    </pci>
  </cpu>
'''


def test_p2c_on_every_nic_in_2_28_and_only_on_the_closest_from_2_29(tmp_path: Path) -> None:
    topo = load_topology(_write(tmp_path, C2C_ONE_GPU_TWO_NICS))
    raw = compute_paths(topo)
    # Both NICs hang off the Grace: raw PHB, 48 GB/s to `fast` (PCIe Gen5 x16 below its 50 GB/s),
    # 12.5 GB/s to `slow` (100 Gb/s). The GPU's only local NIC is `fast` (highest bandwidth).
    old = compute_nic_paths(topo, raw, NicPathOptions(nccl_version=(2, 28)))
    new = compute_nic_paths(topo, raw, NicPathOptions(nccl_version=(2, 29)))
    assert [old.paths[(0, n)].raw_type for n in ("fast", "slow")] == ["PHB", "PHB"]
    assert [old.paths[(0, n)].final_type for n in ("fast", "slow")] == ["P2C", "P2C"]
    assert [new.paths[(0, n)].final_type for n in ("fast", "slow")] == ["P2C", "PHB"]
    assert old.choice[0].local_nics == new.choice[0].local_nics == ("fast",)


def test_two_equal_nics_beside_one_gpu_are_used_by_channel(tmp_path: Path) -> None:
    body = '''  <cpu numaid="0" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
    <pci busid="0000:10:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">
      <pci busid="0000:11:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
        <nic>
          <net name="a" dev="0" speed="400000" gdr="1"/>
        </nic>
      </pci>
      <pci busid="0000:12:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
        <nic>
          <net name="b" dev="1" speed="400000" gdr="1"/>
        </nic>
      </pci>
      <pci busid="0000:13:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
        <gpu dev="0" sm="90" gdr="1"/>
      </pci>
    </pci>
  </cpu>
'''
    topo = load_topology(_write(tmp_path, body))
    r = compute_nic_paths(topo, compute_paths(topo))
    c = r.choice[0]
    # Both PIX at 48 GB/s; each NIC has this one GPU: netsPerGpu = ceil(2 / 1) = 2, so channel 0
    # takes local[mirrorBits(0, 2) + 0] = a and channel 1 takes local[1] = b.
    assert (c.local_nics, c.nics_per_gpu, c.channel_nics, c.nic) == (("a", "b"), 2, ("a", "b"), "a")


def test_merge_path_type_and_mirror_bits() -> None:
    assert merge_path_type("C2C", "PHB") == "P2C"
    assert merge_path_type("PHB", "C2C") == "P2C"
    assert merge_path_type("C2C", "SYS") == "SYS"
    assert merge_path_type("PIX", "PHB") == "PHB"
    assert [_mirror_bits(v, 4) for v in range(4)] == [0, 2, 1, 3]
    assert _mirror_bits(3, 8) == 6
    assert _mirror_bits(5, 1) == 0


# -- shown by `nccltune topo` ----------------------------------------------------------------------


def test_topo_json_has_final_types_beside_the_raw_ones() -> None:
    topo = load_topology(str(TOPOLOGIES / "azure-ndv5-h100-vm.xml"))
    doc = topology_doc(topo, compute_paths(topo))
    assert doc["paths"]["GPU0"]["mlx5_ib4"] == {"type": "SYS", "bw_gbps": 22.0, "hops": 6}
    assert doc["nic_paths"]["GPU0"]["mlx5_ib4"] == {"raw_type": "SYS", "final_type": "PXN", "final_bw_gbps": 48.0,
                                                    "via_gpu": 4, "gdr": True}
    assert doc["nic_paths"]["GPU0"]["mlx5_ib0"]["final_type"] == "PIX"
    assert doc["nic_choice"]["GPU3"] == {"nic": "mlx5_ib3", "local_nics": ["mlx5_ib3"], "nics_per_gpu": 1,
                                         "channel_nics": ["mlx5_ib3"]}
    assert doc["nic_paths_model"] == {"nccl_version": "2.28", "pxn_cells": 56, "p2c_cells": 0}


def test_topo_text_shows_the_final_matrix_and_the_nic_per_gpu() -> None:
    topo = load_topology(str(TOPOLOGIES / "gh200-nvl2.xml"))
    text = topology_text(topo, compute_paths(topo))
    assert "GPU-NIC paths as NCCL 2.28 uses them" in text
    lines = text.splitlines()
    raw_gpu0 = next(line for line in lines if line.startswith("GPU0 "))
    assert raw_gpu0.split()[:4] == ["GPU0", "X", "NV18", "PHB"]
    final_gpu0 = next(line for line in lines if line.startswith("  GPU0 "))
    assert final_gpu0.split() == ["GPU0", "P2C", "PXN@1"]
    assert "NIC NCCL picks per GPU (channel 0): GPU0->NIC0, GPU1->NIC1" in text


def test_cli_topo_loads_the_xml_recordings(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("azure-ndv5-h100-vm.xml", "gh200-nvl2.xml"):
        assert main(["topo", "--input", str(TOPOLOGIES / name), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["kind"] == "topology"
        assert len(doc["gpus"]) == (8 if "ndv5" in name else 2)
        assert set(doc["nic_choice"]) == {f"GPU{g['index']}" for g in doc["gpus"]}
