"""Rendering helpers for the command line: tables and JSON documents. No I/O besides strings."""

from __future__ import annotations

import json
from typing import Any

from .topology.fingerprint import topology_fingerprint
from .topology.model import Topology
from .topology.paths import PathMatrix

SCHEMA_VERSION = 1


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps({"schema_version": SCHEMA_VERSION, **doc}, indent=2, sort_keys=False)


def _cell(path_type: str, nvlinks: int) -> str:
    return f"NV{nvlinks}" if path_type == "NVL" and nvlinks else path_type


def topology_doc(topo: Topology, paths: PathMatrix) -> dict[str, Any]:
    gpus = []
    for g in topo.gpus:
        gpus.append({
            "index": g.index, "name": g.name, "uuid": g.uuid, "bus_id": g.bus_id, "sm": g.sm,
            "numa_node": g.numa_node, "cpu_affinity": g.cpu_affinity,
            "pcie": {"max_gen": g.pcie_max_gen, "max_width": g.pcie_max_width,
                     "cur_gen": g.pcie_cur_gen, "cur_width": g.pcie_cur_width},
            "nvlinks": {"total": g.nvlinks_total, "active": g.nvlinks_active},
            "mig_enabled": g.mig_enabled, "compute_processes": list(g.processes),
        })
    nics = [{"name": n.name, "kind": n.kind, "bus_id": n.bus_id, "speed_mbps": n.speed_mbps,
             "numa_node": n.numa_node, "gdr": n.gdr} for n in topo.nics]
    matrix: dict[str, dict[str, Any]] = {}
    for (a, b), p in paths.gpu_gpu.items():
        matrix.setdefault(f"GPU{a}", {})[f"GPU{b}"] = {
            "type": p.type, "bw_gbps": p.bw_gbps, "hops": p.hops, "nvlinks": p.nvlinks}
    for (a, name), p in paths.gpu_nic.items():
        matrix.setdefault(f"GPU{a}", {})[name] = {"type": p.type, "bw_gbps": p.bw_gbps, "hops": p.hops}
    return {
        "kind": "topology",
        "source": topo.source,
        "fingerprint": topology_fingerprint(topo),
        "driver_version": topo.driver_version,
        "cuda_driver_version": topo.cuda_driver_version,
        "gpus": gpus,
        "nics": nics,
        "paths": matrix,
        "p2p_refused": [list(p) for p in sorted(topo.p2p_refused)],
    }


def topology_text(topo: Topology, paths: PathMatrix) -> str:
    """A matrix in the spirit of `nvidia-smi topo -m`, in NCCL's path types."""
    cols = [f"GPU{g.index}" for g in topo.gpus] + [f"NIC{i}" for i in range(len(topo.nics))]
    header = ["", *cols, "CPU Affinity", "NUMA Affinity"]
    rows = [header]
    for g in topo.gpus:
        row = [f"GPU{g.index}"]
        for h in topo.gpus:
            p = paths.gpu_gpu.get((g.index, h.index))
            row.append("X" if g.index == h.index else _cell(p.type, p.nvlinks) if p else "?")
        for n in topo.nics:
            p = paths.gpu_nic.get((g.index, n.name))
            row.append(p.type if p else "?")
        row += [g.cpu_affinity or "N/A", str(g.numa_node) if g.numa_node is not None else "N/A"]
        rows.append(row)
    for i, n in enumerate(topo.nics):
        row = [f"NIC{i}"]
        for g in topo.gpus:
            p = paths.gpu_nic.get((g.index, n.name))
            row.append(p.type if p else "?")
        row += ["X" if j == i else "" for j in range(len(topo.nics))]
        row += ["", str(n.numa_node) if n.numa_node is not None else "N/A"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"Topology of {topo.source}" + (f" (driver {topo.driver_version})" if topo.driver_version else "")]
    lines.append("")
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    for g in topo.gpus:
        pcie = (f"PCIe Gen{g.pcie_max_gen} x{g.pcie_max_width}" if g.pcie_max_gen else "PCIe ?")
        nvl = f", NVLink {g.nvlinks_active}/{g.nvlinks_total} active" if g.nvlinks_total else ""
        lines.append(f"GPU{g.index}: {g.name or 'GPU'} {g.bus_id} sm{g.sm or '?'} {pcie}{nvl}")
    for i, n in enumerate(topo.nics):
        speed = f"{n.speed_mbps / 1000:g} Gb/s" if n.speed_mbps else "speed unknown"
        lines.append(f"NIC{i}: {n.name} ({n.kind}, {n.bus_id or 'not PCI'}, {speed})")
    bws = sorted({p.bw_gbps for (a, b), p in paths.gpu_gpu.items() if a != b})
    if bws:
        lines.append(f"GPU-GPU bandwidth as NCCL models it: {', '.join(f'{b:g}' for b in bws)} GB/s")
    lines.append(f"Fingerprint: {topology_fingerprint(topo)}")
    lines.append("")
    lines.append("Legend (NCCL path types): X self; NV# NVLink (direct or through NVSwitch), # links;")
    lines.append("  NVB NVLink through another GPU; PIX one PCIe switch; PXB several switches;")
    lines.append("  PHB through a CPU host bridge; SYS across CPU sockets.")
    return "\n".join(lines)
