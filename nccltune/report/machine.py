"""The node's views: its topology (`nccltune topo`), a topology file's check (`topo check`) and
doctor's findings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..names import format_size
from ..topology.fingerprint import topology_fingerprint
from ..topology.model import NicInfo, Topology
from ..topology.nicpaths import NicPaths, compute_nic_paths
from ..topology.paths import PathMatrix

if TYPE_CHECKING:  # the views only; rendering runs no sweep, verify or check
    from ..checks.doctor import Finding
    from ..checks.topocheck import TopoCheck



def _cell(path_type: str, nvlinks: int) -> str:
    return f"NV{nvlinks}" if path_type == "NVL" and nvlinks else path_type


def topology_doc(topo: Topology, paths: PathMatrix, *, with_nics: bool = True) -> dict[str, Any]:
    """The topology as one JSON document; `paths` has GPU-GPU, GPU-NIC and NIC-NIC cells (NICs
    in NCCL's tree only, none under `--no-nics`)."""
    shown = {n.name for n in topo.nics if n.name in paths.nics} if with_nics else set()
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
             "numa_node": n.numa_node, "gdr": n.gdr} for n in topo.nics if n.name in shown]
    matrix: dict[str, dict[str, Any]] = {}
    for (a, b), p in paths.gpu_gpu.items():
        matrix.setdefault(f"GPU{a}", {})[f"GPU{b}"] = {
            "type": p.type, "bw_gbps": p.bw_gbps, "hops": p.hops, "nvlinks": p.nvlinks}
    for (a, name), p in paths.gpu_nic.items():
        if name in shown:
            matrix.setdefault(f"GPU{a}", {})[name] = {"type": p.type, "bw_gbps": p.bw_gbps, "hops": p.hops}
    for (x, y), p in paths.nic_nic.items():
        if x in shown and y in shown:
            matrix.setdefault(x, {})[y] = {"type": p.type, "bw_gbps": p.bw_gbps, "hops": p.hops}
    # Beside the raw types in `paths`, keyed the same way: what NCCL makes of each GPU-NIC path
    # (P2C, PXN through `via_gpu`, the GDR reroute), and the NIC it gives each GPU.
    nic_paths = compute_nic_paths(topo, paths)
    final: dict[str, dict[str, Any]] = {}
    for (a, name), fp in sorted(nic_paths.paths.items()):
        final.setdefault(f"GPU{a}", {})[name] = {
            "raw_type": fp.raw_type, "final_type": fp.final_type, "final_bw_gbps": fp.final_bw_gbps,
            "via_gpu": fp.via_gpu, "gdr": fp.gdr}
    nic_choice = {f"GPU{g}": {"nic": c.nic, "local_nics": list(c.local_nics), "nics_per_gpu": c.nics_per_gpu,
                              "channel_nics": list(c.channel_nics)} for g, c in sorted(nic_paths.choice.items())}
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
        "nic_paths": final,
        "nic_choice": nic_choice,
        "nic_paths_model": {"nccl_version": ".".join(map(str, nic_paths.options.nccl_version)),
                            "pxn_cells": nic_paths.count("PXN"), "p2c_cells": nic_paths.count("P2C")},
    }


def topology_text(topo: Topology, paths: PathMatrix, *, with_nics: bool = True) -> str:
    """A matrix in the spirit of `nvidia-smi topo -m`, in NCCL's path types.

    The NICs shown are those in NCCL's tree (none under `--no-nics`): a NIC the tree leaves out
    has no path to show, only question marks.
    """
    nics = [n for n in topo.nics if n.name in paths.nics] if with_nics else []
    cols = [f"GPU{g.index}" for g in topo.gpus] + [f"NIC{i}" for i in range(len(nics))]
    header = ["", *cols, "CPU Affinity", "NUMA Affinity"]
    rows = [header]
    for g in topo.gpus:
        row = [f"GPU{g.index}"]
        for h in topo.gpus:
            p = paths.gpu_gpu.get((g.index, h.index))
            row.append("X" if g.index == h.index else _cell(p.type, p.nvlinks) if p else "?")
        for n in nics:
            p = paths.gpu_nic.get((g.index, n.name))
            row.append(p.type if p else "?")
        row += [g.cpu_affinity or "N/A", str(g.numa_node) if g.numa_node is not None else "N/A"]
        rows.append(row)
    for i, n in enumerate(nics):
        row = [f"NIC{i}"]
        for g in topo.gpus:
            p = paths.gpu_nic.get((g.index, n.name))
            row.append(p.type if p else "?")
        for j, m in enumerate(nics):
            q = paths.nic_nic.get((n.name, m.name))
            row.append("X" if j == i else q.type if q else "?")
        row += ["", str(n.numa_node) if n.numa_node is not None else "N/A"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"Topology of {topo.source}" + (f" (driver {topo.driver_version})" if topo.driver_version else "")]
    lines.append("")
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())
    lines.append("")
    for g in topo.gpus:
        pcie = (f"PCIe Gen{g.pcie_max_gen} x{g.pcie_max_width}" if g.pcie_max_gen else "PCIe ?")
        # Only the width: an idle GPU lowers its PCIe generation to save power, but a narrower
        # link than the slot's (a riser, a badly seated card) stays narrow under load.
        if g.pcie_cur_width and g.pcie_max_width and g.pcie_cur_width < g.pcie_max_width:
            pcie += f" (running at x{g.pcie_cur_width})"
        nvl = f", NVLink {g.nvlinks_active}/{g.nvlinks_total} active" if g.nvlinks_total else ""
        lines.append(f"GPU{g.index}: {g.name or 'GPU'} {g.bus_id} sm{g.sm or '?'} {pcie}{nvl}")
    for i, n in enumerate(nics):
        speed = f"{n.speed_mbps / 1000:g} Gb/s" if n.speed_mbps else "speed unknown"
        lines.append(f"NIC{i}: {n.name} ({n.kind}, {n.bus_id or 'not PCI'}, {speed})")
    bw_line = _gpu_bandwidth_line(paths)
    if bw_line:
        lines.append(bw_line)
    lines.append(f"Fingerprint: {topology_fingerprint(topo)}")
    if nics:
        lines.append("")
        lines += _final_nic_lines(topo, compute_nic_paths(topo, paths), nics)
    lines.append("")
    lines.append("Legend (NCCL path types): X self; NV# NVLink (direct or through NVSwitch), # links;")
    lines.append("  NVB NVLink through another GPU; PIX one PCIe switch; PXB several switches;")
    lines.append("  PHB through a CPU host bridge (what nvidia-smi topo -m calls NODE, or PHB for the same")
    lines.append("  bridge); SYS across CPU sockets; P2C GPU over C2C to its CPU,")
    lines.append("  NIC on that CPU; PXN to the NIC through GPU # over NVLink (PXN@#).")
    return "\n".join(lines)


def _gpu_bandwidth_line(paths: PathMatrix, *, most_pairs: int = 6) -> str | None:
    """The GPU-GPU bandwidths NCCL models, each with the pairs that have it ("all N pairs" when
    one bandwidth covers every pair; at most `most_pairs` named, then how many more)."""
    by_bw: dict[float, list[str]] = {}
    for (a, b), p in sorted(paths.gpu_gpu.items()):
        if a < b:
            by_bw.setdefault(p.bw_gbps, []).append(f"GPU{a}-GPU{b}")
    if not by_bw:
        return None
    parts = []
    for bw, pairs in sorted(by_bw.items()):
        if len(by_bw) == 1:
            named = f"all {len(pairs)} pairs" if len(pairs) > 1 else pairs[0]
        else:
            named = ", ".join(pairs[:most_pairs]) + (f" and {len(pairs) - most_pairs} more"
                                                     if len(pairs) > most_pairs else "")
        parts.append(f"{bw:g} GB/s ({named})")
    return "GPU-GPU bandwidth as NCCL models it: " + "; ".join(parts)


def _final_nic_lines(topo: Topology, nic_paths: NicPaths, nics: Sequence[NicInfo]) -> list[str]:
    """The GPU-NIC matrix after NCCL's re-routing, and the NIC NCCL gives each GPU."""
    version = ".".join(map(str, nic_paths.options.nccl_version))
    header = ["", *[f"NIC{i}" for i in range(len(nics))]]
    rows = [header]
    for g in topo.gpus:
        row = [f"GPU{g.index}"]
        for n in nics:
            p = nic_paths.paths.get((g.index, n.name))
            row.append("?" if p is None else p.final_type + (f"@{p.via_gpu}" if p.via_gpu is not None else ""))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"GPU-NIC paths as NCCL {version} uses them (P2C, PXN, GDR re-routing):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
    index = {n.name: i for i, n in enumerate(nics)}
    picks = [f"GPU{g}->NIC{index[c.nic]}" + (f" (+{len(c.channel_nics) - 1} more by channel)"
                                              if len(c.channel_nics) > 1 else "")
             for g, c in sorted(nic_paths.choice.items())]
    if picks:
        lines.append("NIC NCCL picks per GPU (channel 0): " + ", ".join(picks))
    return lines


def topocheck_doc(check: TopoCheck) -> dict[str, Any]:
    doc = {k: v for k, v in vars(check).items() if k != "dump_diff"}
    doc["busbw_gbps"] = {str(k): v for k, v in check.busbw_gbps.items()}
    doc["dump_diff"] = check.dump_diff.as_dict() if check.dump_diff else None
    return {"kind": "topocheck", **doc}


def topocheck_text(check: TopoCheck) -> str:
    lines = [f"{'PASS' if check.passed else 'FAIL'}: {check.verdict}", f"File: {check.xml}",
             f"NCCL {check.nccl_version or '?'}; trial {check.trial_status}"
             + (f" ({check.trial_reason})" if check.trial_reason else "")]
    if check.transports:
        lines.append("Transports: " + ", ".join(f"{k} x{v}" for k, v in sorted(check.transports.items())))
    for g in check.graphs:
        lines.append(f"Graph: pattern {g['pattern']}, {g['nchannels']} channels, {g['bw_intra']} GB/s, "
                     f"{g['type_intra']}/{g['type_inter']}")
    for size, ap in sorted(check.algo_proto.items(), key=lambda kv: int(kv[0])):
        bw = check.busbw_gbps.get(int(size))
        lines.append(f"AllReduce {format_size(int(size))}: {ap}" + (f", {bw:.1f} GB/s busbw" if bw else ""))
    if check.correct is not None:
        lines.append(f"Result check: {'correct' if check.correct else 'WRONG'}")
    for h in check.hints:
        lines.append(f"Hint: {h}")
    for w in check.warnings:
        lines.append(f"NCCL WARN: {w}")
    if check.dump_diff is not None:
        d = check.dump_diff
        if d.same:
            lines.append(f"NCCL's re-dump ({check.dump}) matches the file "
                         f"({len(d.filled)} attribute(s) filled in by NCCL).")
        else:
            lines.append("NCCL's re-dump differs from the file:")
            lines.extend(f"  - {p} (only in the file)" for p in d.only_a)
            lines.extend(f"  + {p} (only in NCCL's re-dump)" for p in d.only_b)
            lines.extend(f"  ~ {c}" for c in d.changed)
    lines.extend(f"Note: {n}" for n in check.notes)
    if check.log_dir:
        lines.append(f"NCCL logs: {check.log_dir}")
    return "\n".join(lines)


def doctor_doc(topo: Topology, findings: Sequence[Finding]) -> dict[str, Any]:
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    return {"kind": "doctor", "source": topo.source, "counts": counts,
            "findings": [{"severity": f.severity, "code": f.code, "message": f.message, "fix": f.fix}
                         for f in findings]}


def doctor_text(topo: Topology, findings: Sequence[Finding]) -> str:
    if not findings:
        return f"No problems found ({topo.source})."
    lines = []
    for f in findings:
        lines.append(f"{f.severity.upper():7} [{f.code}] {f.message}")
        lines.append(f"        fix: {f.fix}")
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s) "
                 f"({topo.source})")
    return "\n".join(lines)
