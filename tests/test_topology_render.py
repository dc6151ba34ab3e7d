"""`nccltune topo` as a newcomer reads it: NIC-NIC cells, --no-nics, the legend, bandwidths by pair,
a narrowed PCIe link, and `topo diff` between different kinds of node."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

from conftest import TOPOLOGIES

from nccltune.cli import main
from nccltune.report.machine import topology_doc, topology_text
from nccltune.topology.paths import compute_paths
from nccltune.topology.source import load_topology


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def matrix_rows(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    header = lines[2].split()
    return {line.split()[0]: line.split() for line in lines[3:] if line.startswith(("GPU", "NIC")) and
            len(line.split()) >= len(header) - 3 and ":" not in line.split()[0]}


def test_nic_rows_have_nic_to_nic_cells() -> None:
    topo = load_topology(str(TOPOLOGIES / "dgx-a100-8gpu.json"))
    paths = compute_paths(topo)
    rows = matrix_rows(topology_text(topo, paths))
    # NIC0 and NIC1 (mlx5_0, mlx5_1) share the PCIe switches of GPU0/GPU1; NIC2 is on another socket.
    nic0 = rows["NIC0"]
    assert nic0[1 + 8:1 + 8 + 8] == ["X", "PXB", "SYS", "SYS", "SYS", "SYS", "SYS", "SYS"]
    assert "?" not in nic0
    doc = topology_doc(topo, paths)
    assert doc["paths"]["mlx5_0"]["mlx5_1"]["type"] == "PXB"


def test_no_nics_leaves_out_every_nic_row_and_column() -> None:
    rc, out, err = run("topo", "--input", str(TOPOLOGIES / "dgx-a100-8gpu.json"), "--no-nics")
    assert rc == 0, err
    matrix = out.split("Legend")[0]
    assert "NIC" not in matrix and "?" not in matrix
    rc, out, err = run("topo", "--input", str(TOPOLOGIES / "dgx-a100-8gpu.json"), "--no-nics", "--json")
    doc = json.loads(out)
    assert doc["nics"] == [] and all(k.startswith("GPU") for row in doc["paths"].values() for k in row)


def test_legend_says_phb_is_what_nvidia_smi_calls_node() -> None:
    topo = load_topology(str(TOPOLOGIES / "pcie-4gpu-2socket.json"))
    text = topology_text(topo, compute_paths(topo))
    assert "PHB through a CPU host bridge (what nvidia-smi topo -m calls NODE" in text


def test_the_bandwidth_line_names_its_pairs() -> None:
    topo = load_topology(str(TOPOLOGIES / "pcie-4gpu-2socket.json"))
    text = topology_text(topo, compute_paths(topo))
    line = next(x for x in text.splitlines() if x.startswith("GPU-GPU bandwidth"))
    assert "(GPU0-GPU1, GPU2-GPU3)" in line and "(GPU0-GPU2, GPU0-GPU3, GPU1-GPU2, GPU1-GPU3)" in line
    dgx = load_topology(str(TOPOLOGIES / "dgx-a100-8gpu.json"))
    assert "240 GB/s (all 28 pairs)" in topology_text(dgx, compute_paths(dgx))


def test_a_pcie_link_narrower_than_its_maximum_shows_its_width() -> None:
    topo = load_topology(str(TOPOLOGIES / "pcie-4gpu-2socket.json"))
    g0 = topo.gpus[0]
    assert g0.pcie_max_width == 16
    topo.gpus[0] = dataclasses.replace(g0, pcie_cur_width=8, pcie_cur_gen=1)
    topo.gpus[1] = dataclasses.replace(topo.gpus[1], pcie_cur_width=16, pcie_cur_gen=1)  # idle: gen only
    lines = topology_text(topo, compute_paths(topo)).splitlines()
    assert next(x for x in lines if x.startswith("GPU0:")).endswith("PCIe Gen4 x16 (running at x8)")
    assert "running" not in next(x for x in lines if x.startswith("GPU1:"))


def test_diff_between_node_types_starts_with_a_summary_and_json_is_structured() -> None:
    a, b = str(TOPOLOGIES / "dgx-a100-8gpu.json"), str(TOPOLOGIES / "pcie-4gpu-2socket.json")
    rc, out, _err = run("topo", "diff", a, b)
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith(f"Different node types: {a} is 8x NVIDIA A100-SXM4-40GB, NVLink, 8 NIC(s), "
                            f"{b} is 4x NVIDIA L40S, PCIe only, 1 NIC(s);")
    rc, js, _err = run("topo", "diff", a, b, "--json")
    doc = json.loads(js)
    assert doc["summary"] == first
    assert doc["changed"] and all(set(c) == {"path", "attribute", "a", "b"} for c in doc["changed"])
    text_changes = [line[2:] for line in out.splitlines() if line.startswith("~ ")]
    assert len(text_changes) == len(doc["changed"])
    one = doc["changed"][0]
    assert text_changes[0].startswith(f"{one['path']} {one['attribute']}")


def test_diff_of_one_kind_of_node_has_no_summary() -> None:
    a = str(TOPOLOGIES / "h200x2-nvswitch-vm.json")
    rc, out, _err = run("topo", "diff", a, a)
    assert rc == 0 and out.startswith("No semantic difference")
