"""The topology model: fingerprint, semantic diff, the `topo` command, and model details."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import GOLDEN, TOPOLOGIES

from nccltune.cli import main
from nccltune.hw.types import Gpu, GpuProcess, Snapshot
from nccltune.topology.diff import diff_trees
from nccltune.topology.fingerprint import topology_fingerprint
from nccltune.topology.model import XNode, from_snapshot
from nccltune.topology.ncclxml import load_xml, parse_xml, render_xml
from nccltune.topology.paths import compute_paths
from nccltune.topology.snapshot import load_snapshot

NAMES = sorted(p.stem for p in TOPOLOGIES.glob("*.json"))
NCCL_DUMP = GOLDEN / "h200x2-nvswitch-vm.nccl-dump.xml"


def _snap(name: str) -> Snapshot:
    return load_snapshot(TOPOLOGIES / f"{name}.json")


def _fp(snap: Snapshot) -> str:
    return topology_fingerprint(from_snapshot(snap))


def _with_gpus(snap: Snapshot, gpus: tuple[Gpu, ...]) -> Snapshot:
    return dataclasses.replace(snap, nvml=dataclasses.replace(snap.nvml, gpus=gpus))


# -- fingerprint -----------------------------------------------------------------------------------

def _reordered(snap: Snapshot) -> Snapshot:
    """The same node enumerated in another order: GPUs, their links, PCI devices, NICs, NUMA nodes."""
    gpus = tuple(reversed([dataclasses.replace(g, nvlinks=tuple(reversed(g.nvlinks))) for g in snap.nvml.gpus]))
    nvml = dataclasses.replace(snap.nvml, gpus=gpus, p2p=tuple(reversed(snap.nvml.p2p)))
    sysfs = dataclasses.replace(snap.sysfs, pci=tuple(reversed(snap.sysfs.pci)), nics=tuple(reversed(snap.sysfs.nics)),
                                numa_nodes=tuple(reversed(snap.sysfs.numa_nodes)))
    return dataclasses.replace(snap, nvml=nvml, sysfs=sysfs)


def _volatile(snap: Snapshot) -> Snapshot:
    """What changes from one reading to the next on an unchanged node."""
    # GPUs drop the link *generation* when idle; the width stays (a narrower link is a fault).
    gpus = tuple(dataclasses.replace(g, pcie_cur_gen=1,
                                     processes=(GpuProcess(pid=4242, used_memory_bytes=1 << 30),))
                 for g in snap.nvml.gpus)
    pci = tuple(dataclasses.replace(d, current_link_speed="2.5 GT/s PCIe", current_link_width=1)
                for d in snap.sysfs.pci)
    return dataclasses.replace(_with_gpus(snap, gpus), sysfs=dataclasses.replace(snap.sysfs, pci=pci),
                               recorded_at="2030-01-01T00:00:00+00:00", hostname="elsewhere",
                               description="same box, another day")


@pytest.mark.parametrize("name", NAMES)
def test_fingerprint_ignores_order_and_volatile_readings(name: str) -> None:
    snap = _snap(name)
    fp = _fp(snap)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert _fp(_reordered(snap)) == fp
    assert _fp(_volatile(snap)) == fp
    assert _fp(_volatile(_reordered(snap))) == fp


@pytest.mark.parametrize("name", NAMES)
def test_fingerprint_changes_when_a_gpu_link_trains_narrower_than_its_maximum(name: str) -> None:
    snap = _snap(name)
    g0 = snap.nvml.gpus[0]
    assert g0.pcie_max_width
    narrow = _with_gpus(snap, (dataclasses.replace(g0, pcie_cur_width=g0.pcie_max_width // 2), *snap.nvml.gpus[1:]))
    assert _fp(narrow) != _fp(snap)


def _lose_one_nvlink(snap: Snapshot) -> Snapshot:
    g0 = snap.nvml.gpus[0]
    links = (dataclasses.replace(g0.nvlinks[0], active=False), *g0.nvlinks[1:])
    return _with_gpus(snap, (dataclasses.replace(g0, nvlinks=links), *snap.nvml.gpus[1:]))


def _drop_gpu(snap: Snapshot) -> Snapshot:
    last = snap.nvml.gpus[-1].index
    nvml = dataclasses.replace(snap.nvml, gpus=snap.nvml.gpus[:-1],
                               p2p=tuple(p for p in snap.nvml.p2p if last not in (p.gpu_a, p.gpu_b)))
    return dataclasses.replace(snap, nvml=nvml)


def _drop_nic(snap: Snapshot) -> Snapshot:
    """The last RDMA device gone (NCCL uses the RDMA devices; the IPoIB netdevs do not count)."""
    last = [n.name for n in snap.sysfs.nics if n.kind == "ib"][-1]
    return dataclasses.replace(snap, sysfs=dataclasses.replace(
        snap.sysfs, nics=tuple(n for n in snap.sysfs.nics if n.name != last)))


def _new_driver(snap: Snapshot) -> Snapshot:
    return dataclasses.replace(snap, nvml=dataclasses.replace(snap.nvml, driver_version="555.42.06"))


def _narrower_gpu_slot(snap: Snapshot) -> Snapshot:
    bus = snap.nvml.gpus[0].bus_id
    pci = tuple(dataclasses.replace(d, max_link_width=8) if d.bus_id == bus else d for d in snap.sysfs.pci)
    return dataclasses.replace(snap, sysfs=dataclasses.replace(snap.sysfs, pci=pci))


@pytest.mark.parametrize("change", [_lose_one_nvlink, _drop_gpu, _drop_nic, _new_driver, _narrower_gpu_slot],
                         ids=lambda f: f.__name__.strip("_"))
def test_fingerprint_changes_with_the_hardware(change: Any) -> None:
    snap = _snap("hgx-h100-8gpu")
    changed = change(snap)
    assert _fp(changed) != _fp(snap)
    # ... and the change survives reordering: it is the change, not the order, that counts.
    assert _fp(_reordered(changed)) == _fp(changed)


def test_fingerprint_sees_a_lost_nvlink_in_the_xml_too() -> None:
    topo = from_snapshot(_lose_one_nvlink(_snap("hgx-h100-8gpu")))
    gpu0 = next(g for g in topo.system.iter("gpu") if g.attrs["dev"] == "0")
    assert sum(int(n.attrs["count"]) for n in gpu0.children) == 17
    assert topo.gpu(0).nvlinks_active == 17 and topo.gpu(0).nvlinks_total == 18


# -- diff ------------------------------------------------------------------------------------------

def _dump() -> XNode:
    return parse_xml(NCCL_DUMP.read_text(), str(NCCL_DUMP))


def _edited(old: str, new: str, count: int = 1) -> XNode:
    text = NCCL_DUMP.read_text()
    assert old in text, old
    return parse_xml(text.replace(old, new, count), "edited")


def test_diff_of_a_file_with_itself_is_empty() -> None:
    assert diff_trees(_dump(), _dump()).as_dict() == {
        "same": True, "only_a": [], "only_b": [], "changed": [], "filled": []}


def test_diff_ignores_attribute_order() -> None:
    shuffled = _dump()
    for node in shuffled.iter():
        node.attrs = dict(reversed(list(node.attrs.items())))
    assert next(iter(shuffled.children[0].attrs)) == "modelid"
    d = diff_trees(_dump(), shuffled)
    assert d.same and not d.filled


def test_diff_ignores_what_nccl_rewrites_on_every_init() -> None:
    other = _edited('host_hash="0x2516a80326e0744"', 'host_hash="0x1234"')
    for gpu in other.iter("gpu"):
        gpu.attrs.pop("rank")
        gpu.attrs["keep"] = "1"
    d = diff_trees(_dump(), other)
    assert d.same and not d.filled and not d.changed, d.as_dict()


def test_diff_treats_link_width_0_as_16() -> None:
    d = diff_trees(_dump(), _edited('link_width="0"', 'link_width="16"', 2))
    assert d.same and not d.filled and not d.changed
    d = diff_trees(_dump(), _edited('link_width="0"', 'link_width="8"'))
    assert not d.same
    assert [str(c) for c in d.changed] == ["system/cpu[numaid=-1]/pci[0000:00:06.0] link_width: '0' -> '8'"]
    assert d.as_dict()["changed"] == [{"path": "system/cpu[numaid=-1]/pci[0000:00:06.0]", "attribute": "link_width",
                                       "a": "0", "b": "8"}]


def test_diff_sums_nvswitch_links() -> None:
    one = '        <nvlink target="fffffff:ff:ff.0" count="18" tclass="0x068000"/>\n'
    split = "".join(f'        <nvlink target="0000:0{i}:00.0" count="{c}" tclass="0x068000"/>\n'
                    for i, c in zip(range(5, 9), (5, 4, 4, 5), strict=True))
    d = diff_trees(_dump(), _edited(one, split, 2))
    assert d.same and not d.filled and not d.changed, d.as_dict()
    # One link less on GPU0 is a difference, reported with both totals.
    d = diff_trees(_dump(), _edited(one, split.replace('count="4"', 'count="3"', 1), 1))
    assert [str(c) for c in d.changed] == [
        "system/cpu[numaid=-1]/pci[0000:00:06.0]/gpu/nvlink[NVS] count: '18' -> '17'"]


def test_diff_reports_a_changed_link_speed() -> None:
    b = _edited('busid="0000:00:07.0" class="0x030200" vendor="0x10de" device="0x2335" subsystem_vendor="0x10de" '
                'subsystem_device="0x18bf" link_speed="32.0 GT/s PCIe"',
                'busid="0000:00:07.0" class="0x030200" vendor="0x10de" device="0x2335" subsystem_vendor="0x10de" '
                'subsystem_device="0x18bf" link_speed="16.0 GT/s PCIe"')
    d = diff_trees(_dump(), b)
    assert not d.same
    assert [str(c) for c in d.changed] == [
        "system/cpu[numaid=-1]/pci[0000:00:07.0] link_speed: '32.0 GT/s PCIe' -> '16.0 GT/s PCIe'"]
    # Spellings NCCL reads alike are not a change: "32 GT/s" is Gen5 too.
    assert diff_trees(_dump(), _edited('link_speed="32.0 GT/s PCIe"', 'link_speed="32 GT/s"', 2)).same


def test_diff_reports_a_missing_gpu() -> None:
    text = NCCL_DUMP.read_text()
    start = text.index('    <pci busid="0000:00:07.0"')
    end = text.index("    </pci>\n", start) + len("    </pci>\n")
    d = diff_trees(_dump(), parse_xml(text[:start] + text[end:], "one-gpu"))
    gpu1 = "system/cpu[numaid=-1]/pci[0000:00:07.0]"
    assert d.only_a == [gpu1, f"{gpu1}/gpu", f"{gpu1}/gpu/nvlink[NVS]"]
    assert d.only_b == [] and d.changed == [] and not d.same


def test_diff_of_snapshots_in_both_directions() -> None:
    a = from_snapshot(_snap("hgx-h100-8gpu")).system
    b = from_snapshot(_drop_nic(_snap("hgx-h100-8gpu"))).system
    assert len(list(b.iter("net"))) == 7
    d = diff_trees(a, b)
    assert d.only_a == ["system/cpu[numaid=1]/pci[0000:d9:00.0]/pci[0000:dc:00.0]",
                        "system/cpu[numaid=1]/pci[0000:d9:00.0]/pci[0000:dc:00.0]/nic",
                        "system/cpu[numaid=1]/pci[0000:d9:00.0]/pci[0000:dc:00.0]/nic/net[mlx5_7]"]
    assert diff_trees(b, a).only_b == d.only_a


# -- the topo command ------------------------------------------------------------------------------

def test_cli_topo_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    path = TOPOLOGIES / "h200x2-nvswitch-vm.json"
    assert main(["topo", "--input", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1
    assert doc["kind"] == "topology"
    assert doc["fingerprint"] == _fp(_snap("h200x2-nvswitch-vm"))
    assert [(g["index"], g["bus_id"], g["sm"]) for g in doc["gpus"]] == [(0, "0000:00:06.0", 90),
                                                                          (1, "0000:00:07.0", 90)]
    assert [(n["name"], n["kind"], n["bus_id"]) for n in doc["nics"]] == [("eth0", "eth", None)]
    assert doc["paths"]["GPU0"]["GPU1"] == {"type": "NVL", "bw_gbps": 370.8, "hops": 2, "nvlinks": 18}
    assert doc["paths"]["GPU1"]["eth0"] == {"type": "PHB", "bw_gbps": 1.25, "hops": 3}
    assert doc["paths"]["GPU0"]["GPU0"]["type"] == "LOC"


def test_cli_topo_text_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--input", "h200x2-nvswitch-vm"]) == 0  # a bundled name works too
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("GPU0 ", "GPU1 ", "NIC0 "))}
    assert rows["GPU0"][:3] == ["X", "NV18", "PHB"]
    assert rows["GPU1"][:3] == ["NV18", "X", "PHB"]
    assert "370.8 GB/s" in out


def test_cli_topo_xml_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--input", str(NCCL_DUMP), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == f"xml:{NCCL_DUMP}"
    assert doc["paths"]["GPU0"]["GPU1"]["type"] == "NVL"


@pytest.mark.parametrize("a,b,code", [
    ("h200x2-nvswitch-vm.json", "h200x2-nvswitch-vm.json", 0),
    ("h200x2-nvswitch-vm.json", "golden:h200x2-nvswitch-vm.xml", 0),
    # NCCL's own dump of the same machine: only attributes NCCL fills in differ.
    ("h200x2-nvswitch-vm.json", "golden:h200x2-nvswitch-vm.nccl-dump.xml", 0),
    ("hgx-h100-8gpu.json", "golden:hgx-h100-8gpu.xml", 0),
    ("hgx-h100-8gpu.json", "dgx-a100-8gpu.json", 1),
    ("h200x2-nvswitch-vm.json", "pcie-2gpu-nvlink-bridge.json", 1),
])
def test_cli_topo_diff_exit_codes(a: str, b: str, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    def where(n: str) -> str:
        return str(GOLDEN / n.split(":", 1)[1]) if n.startswith("golden:") else str(TOPOLOGIES / n)

    assert main(["topo", "diff", where(a), where(b)]) == code
    out = capsys.readouterr().out
    assert ("No semantic difference" in out) == (code == 0), out
    assert main(["topo", "diff", where(a), where(b), "--json"]) == code
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["same"] == (code == 0)


def test_cli_topo_diff_names_what_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    changed = tmp_path / "changed.xml"
    changed.write_text(NCCL_DUMP.read_text().replace('link_speed="32.0 GT/s PCIe"', 'link_speed="16.0 GT/s PCIe"', 1))
    assert main(["topo", "diff", str(NCCL_DUMP), str(changed)]) == 1
    out = capsys.readouterr().out
    assert "~ system/cpu[numaid=-1]/pci[0000:00:06.0] link_speed: '32.0 GT/s PCIe' -> '16.0 GT/s PCIe'" in out


def test_cli_topo_diff_bad_input_is_78(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.xml"
    bad.write_text('<?xml version="1.0"?>\n' + NCCL_DUMP.read_text())
    assert main(["topo", "diff", str(NCCL_DUMP), str(bad)]) == 78
    assert f"{bad}:1:" in capsys.readouterr().err
    missing = tmp_path / "missing.json"
    assert main(["topo", "diff", str(missing), str(NCCL_DUMP)]) == 78
    assert str(missing) in capsys.readouterr().err


def test_cli_topo_without_nvml_is_69(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """This node's topology needs NVML; without a driver the command exits 69 and says what to do."""

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    def no_driver() -> None:
        raise NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    binding = SimpleNamespace(NVMLError=NVMLError, nvmlInit=no_driver)
    monkeypatch.setattr("nccltune.hw.nvml._load_binding", lambda: binding)
    assert main(["topo"]) == 69
    err = capsys.readouterr().err
    assert "NVML could not be initialised" in err and "--input" in err


# -- model details ---------------------------------------------------------------------------------

def _without_remote_type(snap: Snapshot) -> Snapshot:
    gpus = tuple(dataclasses.replace(g, nvlinks=tuple(dataclasses.replace(n, remote_type=None) for n in g.nvlinks))
                 for g in snap.nvml.gpus)
    return _with_gpus(snap, gpus)


@pytest.mark.parametrize("name", ["pcie-2gpu-nvlink-bridge", "h200x2-nvswitch-vm", "hgx-h100-8gpu"])
def test_nvlink_class_without_nvmls_remote_type(name: str) -> None:
    """An old binding without nvmlDeviceGetNvLinkRemoteDeviceType gives remote_type None.

    NCCL then reads the remote's class from sysfs and assumes an NVSwitch only when it cannot:
    the bridge's peer is a GPU we know (0x030200), the VM's invisible switch stays 0x068000.
    """
    topo = from_snapshot(_without_remote_type(_snap(name)))
    assert render_xml(topo.system) == (GOLDEN / f"{name}.xml").read_text()
    assert compute_paths(topo) == compute_paths(from_snapshot(_snap(name)))


def test_bridge_without_remote_type_has_no_nvswitch() -> None:
    topo = from_snapshot(_without_remote_type(_snap("pcie-2gpu-nvlink-bridge")))
    assert {n.attrs["tclass"] for n in topo.system.iter("nvlink")} == {"0x030200"}
    p = compute_paths(topo).gpu_gpu[(0, 1)]
    assert (p.type, p.hops, p.bw_gbps) == ("NVL", 1, 240.0)


@pytest.mark.parametrize("guid,attr", [
    ("0c42:a103:00d6:3b00", "0xc42a10300d63b00"),  # NCCL writes 0x%lx: no leading zeros
    ("0000:0000:0000:0001", "0x1"),
    ("0000:0000:0000:0000", "0x0"),
    ("not-a-guid", None),
])
def test_ib_guid_is_written_like_nccl(guid: str, attr: str | None) -> None:
    snap = _snap("pcie-4gpu-2socket")
    nics = tuple(dataclasses.replace(n, guid=guid) if n.name == "mlx5_0" else n for n in snap.sysfs.nics)
    topo = from_snapshot(dataclasses.replace(snap, sysfs=dataclasses.replace(snap.sysfs, nics=nics)))
    [net] = topo.system.iter("net")
    assert net.attrs.get("guid") == attr


def test_xml_nics_are_numbered_like_nccl(tmp_path: Path) -> None:
    """A file's NICs come out in NCCL's device order (`<net dev>`), not in tree order."""
    topo = load_xml(GOLDEN / "dgx-a100-8gpu.xml")
    assert [n.name for n in topo.nics] == [f"mlx5_{i}" for i in range(8)]
    assert [n.name for n in topo.nics] == [n.name for n in from_snapshot(_snap("dgx-a100-8gpu")).nics]


def test_xml_with_garbled_affinity_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "aff.xml"
    text = (GOLDEN / "pcie-4gpu-2socket.xml").read_text().replace('affinity="00000000,ffffffff,00000000,ffffffff"',
                                                                  'affinity="zz,top"')
    path.write_text(text)
    topo = load_xml(path)
    assert topo.gpu(0).cpu_affinity is None
    assert topo.gpu(2).cpu_affinity == "32-63,96-127"


def test_snapshot_gpu_info() -> None:
    topo = from_snapshot(_snap("hgx-h100-8gpu"))
    g = topo.gpu(4)
    assert (g.bus_id, g.sm, g.numa_node, g.cpu_affinity) == ("0000:9d:00.0", 90, 1, "56-111,168-223")
    assert (g.pcie_max_gen, g.pcie_max_width, g.nvlinks_total, g.nvlinks_active) == (5, 16, 18, 18)
    assert [n.name for n in topo.nics] == [f"mlx5_{i}" for i in range(8)]
    assert {n.speed_mbps for n in topo.nics} == {400000}
    with pytest.raises(KeyError):
        topo.gpu(8)
