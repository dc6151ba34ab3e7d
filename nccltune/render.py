"""Rendering helpers for the command line: tables and JSON documents. No I/O besides strings.

Every JSON document has a schema in the repository's `schemas/` directory (`<kind>.schema.json`)
and follows two rules there, so that a consumer parses one shape:

- a per-size row (sweep, report, history, verify) starts with `size_bytes` and `collective`, and
  names a quantity the same way everywhere (`*_busbw_gbps`, `*_noise_pct`, `time_us`);
- numbers are rounded by what their key measures (`ROUNDING`): GB/s (10^9 bytes per second) to
  3 decimals, percentages and microseconds and seconds to 2, ratios and weights to 4.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .collectives import COLLECTIVES
from .names import DEMO_LABEL, format_size
from .publish import EVERY_JOB, SCOPE_APPLIES_TO, SCOPE_FILES, SINGLE_NODE
from .records import Measurement, ReportRow
from .store import RunRecord, TrialRecord
from .sweep.plan import candidate_code
from .sweep.select import key_label
from .topology.fingerprint import topology_fingerprint
from .topology.model import NicInfo, Topology
from .topology.nicpaths import NicPaths, compute_nic_paths
from .topology.paths import PathMatrix

if TYPE_CHECKING:  # the views only; rendering runs no sweep, verify or check
    from .compare import RunComparison
    from .doctor import Finding
    from .node import Node
    from .pipeline import SweepReport
    from .pipeline.planning import Workload
    from .pipeline.tablestage import TableOutcome
    from .sweep.plan import Plan
    from .topocheck import TopoCheck
    from .verify import VerifyResult

SCHEMA_VERSION = 1

# Key suffix -> decimals: the one rounding rule of every JSON document (see the module docstring).
ROUNDING: tuple[tuple[str, int], ...] = (("_gbps", 3), ("_pct", 2), ("_us", 2), ("_s", 2), ("ratio", 4),
                                         ("weight", 4))


def _digits(key: str | None) -> int | None:
    if key is None:
        return None
    return next((d for suffix, d in ROUNDING if key.endswith(suffix)), None)


def rounded(value: Any, digits: int | None = None) -> Any:
    """`value` with every float rounded by the key it sits under (`ROUNDING`); a map or list under
    such a key (busbw by size) takes its key's rule. Integers, strings and unruled keys stay as they are."""
    if isinstance(value, float):
        return round(value, digits) if digits is not None else value
    if isinstance(value, dict):
        return {k: rounded(v, _digits(k) if _digits(k) is not None else digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(rounded({"schema_version": SCHEMA_VERSION, **doc}), indent=2, sort_keys=False)


def size_row(size_bytes: int, collective: str, **fields: Any) -> dict[str, Any]:
    """One per-size row of a JSON document: `size_bytes` and `collective` first, then its numbers."""
    return {"size_bytes": size_bytes, "collective": collective, **fields}


def report_row(row: ReportRow) -> dict[str, Any]:
    """A sweep's report row (sweep, report, history documents)."""
    fields = {k: v for k, v in row.as_dict().items() if k not in ("size_bytes", "collective")}
    return size_row(row.size_bytes, row.collective, **fields)


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


# -- sweep plans and reports -------------------------------------------------------------------------



def _fmt_s(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def pruned_list(plan: Plan) -> list[dict[str, str]]:
    """The candidates the plan does not measure: `code` is stable for automation, `reason` the prose."""
    return [{"name": p.name, "value": p.value, "code": p.code, "reason": p.reason} for p in plan.pruned]


def _ranges(weights: dict[int, float]) -> list[tuple[int, int, float]]:
    """Consecutive sizes of equal weight as (first, last, weight), zero weights left out."""
    out: list[tuple[int, int, float]] = []
    for size, w in sorted(weights.items()):
        if out and out[-1][2] == w:
            out[-1] = (out[-1][0], size, w)
        else:
            out.append((size, size, w))
    return [r for r in out if r[2] > 0]


def workload_doc(w: Workload) -> dict[str, Any]:
    """The profile's collectives with the sizes each measures and their weights, and the ones not measured."""
    return {"collectives": [{"collective": c, "sizes": [{"size_bytes": s, "weight": wt}
                                                          for s, wt in sorted(w.sizes_of(c).items())]}
                            for c in w.collectives],
            "not_measured": dict(w.not_measured)}


def workload_lines(w: Workload) -> list[str]:
    lines = [f"Collectives of profile {w.profile} (every size of the ladder each, weighted):"]
    for c in w.collectives:
        parts = [(format_size(a) if a == b else f"{format_size(a)}-{format_size(b)}") + f" x{wt:g}"
                 for a, b, wt in _ranges(w.sizes_of(c))]
        lines.append(f"  {c}: {', '.join(parts) or 'no size weighed'}")
    for c, why in w.not_measured.items():
        lines.append(f"  {c}: not measured on this backend ({why})")
    return lines


def per_size_plan_doc(plan: Plan) -> dict[str, Any] | None:
    ps = plan.per_size
    if ps is None:
        return None
    return {"active": ps.active, "status": None if ps.active else ps.inactive_text,
            "collectives": list(ps.collectives),
            "candidates": [{"label": c.label, "env": c.env(),
                            "collectives": [t for t in ps.collectives if c.applies_to(t)]} for c in ps.candidates],
            "channels": ("half and a third more of the defaults' channel count (from the baseline)"
                         if ps.channels else None),
            "trials": ps.trial_count(), "measured_with_nccl": ps.measured_with_nccl,
            "pruned": [{"what": p.what, "code": candidate_code(p), "reason": p.reason} for p in ps.pruned],
            "notes": ps.notes}


def per_size_plan_text(plan: Plan) -> list[str]:
    ps = plan.per_size
    if ps is None:
        return []
    if not ps.active:
        return ["", f"Per size: {ps.inactive_text}"]
    lines = ["", "Per size (one trial each over every size, judged size by size, for the tuner table's "
             f"{', '.join(ps.collectives)}):"]
    lines.extend(f"  {c.label}: {' '.join(f'{k}={v}' for k, v in c.env().items())}" for c in ps.candidates)
    if ps.channels:
        lines.append("  channels: half and a third more of the defaults' channel count (NCCL_MIN/MAX_NCHANNELS, "
                     "set after the baseline)")
    lines.extend(f"  not measured: {p.what}: {p.reason}" for p in ps.pruned)
    lines.extend(f"  {n}" for n in ps.notes)
    return lines


def table_lines(table: TableOutcome) -> list[str]:
    """The tuner table beside the environment: its status, entries and the sizes each covers."""
    lines = [f"Tuner table: {table.status}"]
    if table.default_channels:
        lines.append(f"  NCCL's defaults use {table.default_channels} channels")
    if table.spans:
        width = max(len(sp.collective) for sp in table.spans)
        for sp in table.spans:
            ch = f", {sp.cell.channels} channels" if sp.cell.channels else ""
            # Ranges end below the next one's start; a collective's last ends at its largest measured size.
            end = f"{format_size(sp.max_bytes)}]" if sp.last else f"{format_size(sp.max_bytes + 1)})"
            lines.append(f"  {sp.collective:<{width}}  [{format_size(sp.min_bytes)}, {end} (measured "
                         f"{', '.join(format_size(x) for x in sp.sizes)}): {sp.cell.algo}/{sp.cell.proto}{ch}")
    elif table.choice is not None:
        lines.append("  no entries: no candidate beat NCCL's defaults beyond the noise at any size")
    if table.choice is not None and table.choice.single_node_env:
        lines.append("  single-node jobs only: " + " ".join(f"{k}={v}" for k, v in
                                                          sorted(table.choice.single_node_env.items())))
    if table.table_path:
        lines.append(f"  table file: {table.table_path}")
    lines.extend(f"  {n}" for n in table.notes)
    return lines


def plan_doc(plan: Plan, node: Node, trials: int, seconds: float, profile: str,
             workload: Workload | None = None, *, unmeasured: str | None = None) -> dict[str, Any]:
    """The plan as one document. `unmeasured`: why nothing is measured on this node (one GPU):
    the same document then measures nothing, estimates no trial and says why under `reason`."""
    return {
        "kind": "sweep-plan",
        "reason": unmeasured,
        "demo": node.demo,
        "label": DEMO_LABEL if node.demo else None,
        "backend": plan.backend,
        "nranks": plan.nranks,
        "profile": profile,
        "fingerprint": node.fingerprint,
        "job_shape": {"nnodes": plan.shape.nnodes, "loopback": plan.shape.loopback},
        "sizes": plan.sizes,
        "measure": {} if unmeasured else plan.variables,
        "pruned": pruned_list(plan),
        "pinned": {n: {"value": p.value, "source": p.source, "warning": p.warning} for n, p in plan.pinned.items()},
        "policy": plan.policy,
        "notes": plan.notes,
        "per_size": per_size_plan_doc(plan),
        "estimate": {"trials": trials, "seconds": round(seconds, 1)},
        **(workload_doc(workload) if workload is not None else {}),
    }


def shown(value: str) -> str:
    """A value from the environment or a config as one terminal-safe line: a newline or an escape
    sequence is printed escaped (\\n, \\x1b), never acted on by the terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in value)


def plan_text(plan: Plan, node: Node, trials: int, seconds: float, profile: str,
              workload: Workload | None = None) -> str:
    lines = []
    if node.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep plan for {node.topo.source}: {plan.nranks} ranks, backend {plan.backend}, "
                 f"profile {profile}")
    lines.append(f"Sizes: {', '.join(format_size(s) for s in plan.sizes)}")
    if plan.shape.crosses_nic:
        how = ("NIC loopback: P2P and SHM off, every rank its own NCCL node" if plan.shape.loopback
               else f"{plan.shape.nnodes} nodes")
        lines.append(f"Job shape: {how}; measured for this shape only, never published on this node "
                     "(a class profile decides for it)")
    if workload is not None:
        lines.extend(workload_lines(workload))
    lines.append("")
    lines.append("Measured (each against NCCL's defaults, which are measured first and repeated):")
    if not plan.variables:
        lines.append("  nothing: every candidate was pruned")
    for name, values in plan.variables.items():
        lines.append(f"  {name}: {', '.join(values)}")
    lines.append("  NCCL_TOPO_FILE: nccltune's topology file for this node")
    lines.extend(per_size_plan_text(plan))
    if plan.pinned:
        lines.append("")
        lines.append("Pinned (never swept, never removed; --unpin NAME to sweep one anyway):")
        for name, p in plan.pinned.items():
            warn = f"  WARNING: {shown(p.warning)}" if p.warning else ""
            lines.append(f"  {name}={shown(p.value)} (from the {p.source}){warn}")
    if plan.policy:
        lines.append("")
        lines.append("Published by policy, not swept:")
        for name, value in plan.policy.items():
            lines.append(f"  {name}={value}")
    if plan.pruned:
        lines.append("")
        lines.append("Pruned:")
        for pruned in plan.pruned:
            what = pruned.name if pruned.value == "*" else f"{pruned.name}={shown(pruned.value)}"
            lines.append(f"  {what}: {shown(pruned.reason)}")
    if plan.notes:
        lines.append("")
        lines.extend(f"Note: {n}" for n in plan.notes)
    lines.append("")
    per = f" of {len(workload.collectives)} collectives each" if workload and len(workload.collectives) > 1 else ""
    lines.append(f"Estimate: about {trials} trials{per}, {_fmt_s(seconds)}.")
    return "\n".join(lines)


def scopes_doc() -> dict[str, dict[str, Any]]:
    """Which jobs get which part of a published set, and the files that carry it."""
    return {label: {"applies_to": SCOPE_APPLIES_TO[label], "files": list(SCOPE_FILES[label])}
            for label in (EVERY_JOB, SINGLE_NODE)}


def scopes_text(every_job: Mapping[str, str], single_node: Mapping[str, str]) -> list[str]:
    """Both parts of a published set, each under the jobs that get it."""
    lines = []
    for label, part in ((EVERY_JOB, every_job), (SINGLE_NODE, single_node)):
        files = ", ".join(SCOPE_FILES[label])
        name = "Every-job part" if label == EVERY_JOB else "Single-node part"
        lines.append(f"  {name} ({files}), for {SCOPE_APPLIES_TO[label]}:")
        lines.extend(f"    {name}={value}" for name, value in sorted(part.items()))
        if not part:
            lines.append("    (nothing)")
    return lines


def single_node_comment(single_node: Mapping[str, str], nnodes: int | None) -> str:
    """The single-node part as comments, for `nccltune env` of a job that is not known to be
    single-node: shown, never applied."""
    why = "the job does not say how many nodes it spans" if nnodes is None else f"the job spans {nnodes} nodes"
    lines = [f"# Not applied ({why}): measured for {SCOPE_APPLIES_TO[SINGLE_NODE]};",
             "# `nccltune env --nnodes 1` prints them as assignments:"]
    lines.extend(f"#   {name}={value}" for name, value in sorted(single_node.items()))
    return "\n".join(lines) + "\n"


def failed_trials(trials: Sequence[TrialRecord]) -> list[dict[str, Any]]:
    """The trials that did not end ok: `code` is the trial's status (timeout, crashed, ...), stable
    for automation; `reason` is the prose."""
    return [{"seq": t.seq, "label": t.label, "code": t.status, "reason": t.reason or t.status}
            for t in trials if t.status != "ok"]


def sweep_doc(report: SweepReport, trials: Sequence[TrialRecord] = ()) -> dict[str, Any]:
    """`trials`: the run's stored trials, for the failed ones' codes."""
    pub = report.published
    return {
        "kind": "sweep",
        "demo": report.demo,
        "label": DEMO_LABEL if report.demo else None,
        "run_id": report.run_id,
        "backend": report.backend,
        "fingerprint": report.fingerprint,
        "nccl_version": report.nccl_version,
        "torch_version": report.torch_version,
        "method": report.method,
        "profile": report.profile,
        "trials": report.trials,
        "failed_trials": failed_trials(trials),
        "wall_s": report.wall_s,
        "chosen": report.chosen_label,
        # The every-job part (nccl.sh, nccl.env), as before; the single-node part beside it.
        "published_env": report.every_job_env,
        "single_node_env": report.single_node_env,
        "scopes": scopes_doc(),
        "summary": report.summary,
        "sizes": [report_row(r) for r in report.rows],
        "collectives": list(report.collectives),
        "not_measured": dict(report.not_measured),
        "published": {"sh": str(pub.sh_path), "env": str(pub.env_path), "json": str(pub.json_path),
                      "single_node_sh": str(pub.single_sh_path) if pub.single_sh_path else None,
                      "single_node_env": str(pub.single_env_path) if pub.single_env_path else None,
                      "generation": pub.generation, "topology_file": report.topology_file} if pub else None,
        "not_published": report.not_published,
        "pruned": pruned_list(report.plan),
        "tuner_table": _table_doc(report),
    }


def _table_doc(report: SweepReport) -> dict[str, Any] | None:
    if report.table is not None:
        return {**report.table.as_dict(), "text": report.table.table_text,
                "published": report.published_table or None}
    ps = report.plan.per_size
    return {"status": ps.inactive_text} if ps is not None else None


def fmt_bw(gbps: float) -> str:
    """GB/s with the digits that matter: 345.2, 12.34, 0.0123 (CPU demo sizes move little)."""
    if gbps >= 100:
        return f"{gbps:.1f}"
    if gbps >= 1:
        return f"{gbps:.2f}"
    return f"{gbps:.3g}"


# The worker (and all_reduce_perf as nccltune runs it) sums float32 elements.
ELEMENT_TYPE, ELEMENT_BYTES = "float", 4
TABLE_UNITS = "# size in bytes, count in elements, time in us, algbw and busbw in GB/s (1 GB/s = 1e9 B/s)"


@dataclass(frozen=True)
class SizeFacts:
    """What the trials of a run say at one size beyond the report row's medians: busbw over algbw
    (the collective's factor, 2(n-1)/n for an all-reduce) and how many results were wrong."""

    bus_factor: float | None
    wrong_defaults: int
    wrong_tuned: int


def size_facts(trials: Sequence[TrialRecord], chosen: str | None) -> dict[tuple[str, int], SizeFacts]:
    """(collective, size) -> SizeFacts from a run's trials. Wrong results count for the defaults in
    trials that ran NCCL's defaults, for the published setting in trials whose label names `chosen`."""
    factors: dict[tuple[str, int], float] = {}
    wrong: dict[tuple[str, int], list[int]] = {}
    for t in trials:
        is_default = not t.env
        is_tuned = is_default if chosen == "NCCL defaults" else chosen is not None and chosen in t.label
        for m in t.measurements:
            key = (m.collective, m.size_bytes)
            if m.algbw_gbps > 0 and m.busbw_gbps > 0:
                factors.setdefault(key, m.busbw_gbps / m.algbw_gbps)
            counts = wrong.setdefault(key, [0, 0])
            if not m.correct:
                counts[0] += is_default
                counts[1] += is_tuned
    return {k: SizeFacts(factors.get(k), *wrong.get(k, [0, 0])) for k in set(factors) | set(wrong)}


def _side(size_bytes: int, busbw_gbps: float, facts: SizeFacts | None) -> list[str]:
    """time (us), algbw, busbw of one side of a row, from its median busbw and the size's factor."""
    factor = facts.bus_factor if facts else None
    if not factor or busbw_gbps <= 0:
        return ["-", "-", fmt_bw(busbw_gbps)]
    algbw = busbw_gbps / factor
    return [f"{size_bytes / (algbw * 1e3):.2f}", fmt_bw(algbw), fmt_bw(busbw_gbps)]


def rows_text(rows: Sequence[ReportRow], trials: Sequence[TrialRecord] = (), chosen: str | None = None,
              not_measured: dict[str, str] | None = None) -> list[str]:
    """The report's table; with more than one collective (or another than all_reduce), one table
    per collective under its name, and the profile's collectives that have no numbers, with why."""
    collectives = list(dict.fromkeys(r.collective for r in rows))
    if collectives in ([], ["all_reduce"]) and not not_measured:
        return _rows_table(rows, trials, chosen)
    lines: list[str] = []
    for c in collectives:
        if lines:
            lines.append("")
        factor = COLLECTIVES[c].factor_kind if c in COLLECTIVES else "?"
        lines.append(f"{c} (busbw = algbw x {factor}):")
        lines.extend("  " + line for line in _rows_table([r for r in rows if r.collective == c], trials, chosen))
    for c, why in (not_measured or {}).items():
        lines.append(f"{c}: not measured on this backend ({why})")
    return lines


def _rows_table(rows: Sequence[ReportRow], trials: Sequence[TrialRecord], chosen: str | None) -> list[str]:
    """The report as all_reduce_perf lays a run out, per size: size, count, type, then time, algbw,
    busbw and #wrong for NCCL's defaults and for the published setting (medians of the repeats),
    then their ratio, the defaults' noise and the algorithm/protocol NCCL used on each side.
    Time and algbw follow from the median busbw by the factor the trials measured at that size."""
    facts = size_facts(trials, chosen)
    table = [["size", "count", "type", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong",
              "ratio", "noise", "NCCL default -> tuned"]]
    for r in rows:
        f = facts.get((r.collective, r.size_bytes))
        table.append([
            str(r.size_bytes), str(r.size_bytes // ELEMENT_BYTES), ELEMENT_TYPE,
            *_side(r.size_bytes, r.default_busbw_gbps, f), str(f.wrong_defaults if f else 0),
            *_side(r.size_bytes, r.tuned_busbw_gbps, f), str(f.wrong_tuned if f else 0),
            f"{r.ratio:.3f}", f"±{r.default_noise_pct:.1f}%",
            f"{r.default_algo_proto or '-'} -> {r.tuned_algo_proto or '-'}"
            + ("" if r.weight else f" ({format_size(r.size_bytes)} not in profile)"),
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    left = len(table[0]) - 1  # the last column is text
    lines = [TABLE_UNITS]
    defaults_w = sum(widths[3:7]) + 6
    tuned_w = sum(widths[7:11]) + 6
    pad = sum(widths[:3]) + 6
    lines.append("#" + " " * (pad - 1) + "NCCL defaults".center(defaults_w) + "  " + "published".center(tuned_w))
    for i, row in enumerate(table):
        cells = [c.rjust(w) if j < left else c for j, (c, w) in enumerate(zip(row, widths, strict=True))]
        line = "  ".join(cells).rstrip()
        lines.append(("#" + line[1:]) if i == 0 and line.startswith(" ") else line)
    return lines


def sweep_text(report: SweepReport, trials: Sequence[TrialRecord] = ()) -> str:
    lines = []
    if report.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep {report.run_id}: backend {report.backend}, fingerprint {report.fingerprint}, "
                 f"NCCL {report.nccl_version or 'n/a'}, torch {report.torch_version or '?'}")
    failed = f" ({len(report.failed_trials)} failed)" if report.failed_trials else ""
    what = ("all-reduce, float32 sum" if list(report.collectives) == ["all_reduce"]
            else f"{', '.join(report.collectives)}; float32, sum for the reductions")
    if report.trials or report.rows:
        lines.append(f"{report.trials} trials{failed} in {_fmt_s(report.wall_s)}; busbw medians "
                     f"({what}, {report.method or 'no trial measured'})")
        lines.append("")
        lines.extend(rows_text(report.rows, trials, report.chosen_label, report.not_measured))
    else:
        lines.append(f"No trial in {_fmt_s(report.wall_s)}.")
    lines.append("")
    for label, reason in report.failed_trials:
        lines.append(f"Failed: {label}: {reason}")
    lines.append(report.summary)
    if report.published:
        p = report.published
        lines.append(f"Published (generation {p.generation}): {p.sh_path}, {p.env_path}, {p.json_path}")
        lines.extend(scopes_text(report.every_job_env, report.single_node_env))
    elif report.not_published:
        lines.append(f"Not published: {report.not_published}")
    if report.table is not None:
        lines.extend(table_lines(report.table))
        if report.published_table:
            lines.append(f"  published with generation {report.published_table.get('generation')}: the plugin and "
                         "the table (files of the generation, for every job)")
    elif report.plan.per_size is not None and not report.plan.per_size.active:
        lines.append(report.plan.per_size.inactive_text)
    if report.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    return "\n".join(lines)


def _summary(run: RunRecord) -> dict[str, Any] | None:
    """The run's stored summary, its report rows (a sweep's) in the one row shape."""
    if run.summary is None or not run.rows:
        return run.summary
    return {**run.summary, "rows": [report_row(r) for r in run.rows]}


def _run_dict(run: RunRecord) -> dict[str, Any]:
    return {"id": run.id, "kind": run.kind, "status": run.status, "started_at": run.started_at,
            "finished_at": run.finished_at, "fingerprint": run.fingerprint, "backend": run.backend,
            "demo": run.demo, "profile": run.profile, "nccltune_version": run.nccltune_version,
            "summary": _summary(run), "chosen_env": run.chosen_env,
            "published_generation": run.published_generation}


def measurement_row(m: Measurement) -> dict[str, Any]:
    """One size of one trial, as history and the import show it."""
    return size_row(m.size_bytes, m.collective, time_us=m.time_us, algbw_gbps=m.algbw_gbps,
                    busbw_gbps=m.busbw_gbps, algo=m.algo, proto=m.proto, channels=m.channels, correct=m.correct)


def history_doc(runs: Sequence[RunRecord], trials: Sequence[TrialRecord] | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "history", "runs": [_run_dict(r) for r in runs]}
    if trials is not None:
        doc["trials"] = [{"seq": t.seq, "phase": t.phase, "label": t.label, "env": t.env, "status": t.status,
                          "reason": t.reason, "wall_s": t.wall_s,
                          "measurements": [measurement_row(m) for m in t.measurements]}
                         for t in trials]
    return doc


def history_text(runs: Sequence[RunRecord]) -> str:
    if not runs:
        return "No runs yet."
    lines = [f"{'id':>4}  {'kind':6}  {'status':11}  {'started':25}  {'backend':10}  chosen"]
    for r in runs:
        chosen = (r.summary or {}).get("chosen") or (r.summary or {}).get("error") or ""
        demo = " [CPU demo]" if r.demo else ""
        lines.append(f"{r.id:>4}  {r.kind:6}  {r.status:11}  {r.started_at[:25]:25}  {r.backend:10}  {chosen}{demo}")
    return "\n".join(lines)


def trials_text(run: RunRecord, trials: Sequence[TrialRecord]) -> str:
    lines = [f"Run {run.id} ({run.kind}, {run.status}{', CPU demo' if run.demo else ''}), "
             f"fingerprint {run.fingerprint}"]
    for t in trials:
        best = max((m.busbw_gbps for m in t.measurements), default=0.0)
        why = f" ({t.reason})" if t.reason else ""
        lines.append(f"{t.seq:>3} {t.phase:9} {t.status:12} peak {best:8.2f} GB/s  {t.label}{why}")
    return "\n".join(lines)


def report_doc(run: RunRecord, trials: Sequence[TrialRecord], plot: str | None,
               perf: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`perf`: an imported run's nccl-tests document (nccltests_json.run_document), shown under
    `imported` in the import's row shape (an import has no report rows of defaults and tuned)."""
    doc: dict[str, Any] = {"kind": "report", "run": _run_dict(run), "label": DEMO_LABEL if run.demo else None,
                           "sizes": [report_row(r) for r in run.rows], "plot": plot, "trials": len(trials)}
    if perf is not None:
        doc["imported"] = {"placement": (run.summary or {}).get("placement"), "sizes": perf_rows(perf)}
    return doc


# -- nccl-tests documents (report --format nccl-tests-json, import) ------------------------------------


def _perf_side(side: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if side is None:
        return None
    wrong = side.get("nwrong")
    return {"time_us": side.get("time", side.get("cpu_time")), "algbw_gbps": side.get("alg_bw"),
            "busbw_gbps": side.get("bus_bw"), "wrong": None if wrong is None else int(wrong)}


def perf_rows(perf: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An nccl-tests document's results as per-size rows: size, collective and count first, then
    each placement (time, algbw, busbw, wrong elements; null where not measured)."""
    collective = str((perf.get("nccltune") or {}).get("collective") or "all_reduce")
    return [size_row(int(r["size"]), collective, count=r.get("count"), out_of_place=_perf_side(r.get("out_of_place")),
                     in_place=_perf_side(r.get("in_place"))) for r in perf.get("results", [])]


def _perf_cells(side: Mapping[str, Any] | None) -> list[str]:
    if side is None:
        return ["-", "-", "-", "-"]
    wrong = side.get("nwrong")
    # Two decimals as nccl-tests prints them; three digits below 0.1 GB/s (CPU demo sizes).
    def bw(x: float) -> str:
        return f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"

    return [f"{side.get('time', side.get('cpu_time', 0.0)):.2f}", bw(float(side["alg_bw"])), bw(float(side["bus_bw"])),
            "N/A" if wrong is None else str(int(wrong))]


def perf_table(perf: Mapping[str, Any]) -> list[str]:
    """An nccl-tests document's results in all_reduce_perf's columns: size, count, type, redop,
    root, then time, algbw, busbw and #wrong out of place and in place ("-" where not measured)."""
    table = [["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
              "#wrong"]]
    for r in perf.get("results", []):
        table.append([str(r["size"]), "-" if r.get("count") is None else str(r["count"]), str(r["type"]),
                      str(r["redop"]), str(r["root"]).strip(), *_perf_cells(r.get("out_of_place")),
                      *_perf_cells(r.get("in_place"))])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    # Every line starts with two characters ("# " on the headers), then the cells two apart.
    lead = 2 + sum(widths[:5]) + 2 * 5
    out_w, in_w = sum(widths[5:9]) + 2 * 3, sum(widths[9:13]) + 2 * 3
    lines = [TABLE_UNITS, ("#" + " " * (lead - 1) + "out-of-place".center(out_w) + "  " + "in-place".center(in_w))
             .rstrip()]
    for i, row in enumerate(table):
        lines.append(("# " if i == 0 else "  ") + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    return lines


def import_doc(run: RunRecord, perf: Mapping[str, Any]) -> dict[str, Any]:
    """What `nccltune import --json` prints: the run it made and what it holds, size by size."""
    s = run.summary or {}
    return {"kind": "import", "run_id": run.id, "file": s.get("source_file"), "collective": s.get("collective"),
            "binary": s.get("binary"), "nranks": s.get("nranks"), "backend": run.backend, "demo": run.demo,
            "label": DEMO_LABEL if run.demo else None, "nccl_version": run.nccl_version,
            "hostname": run.hostname, "fingerprint": run.fingerprint, "cycles": s.get("cycles"),
            "placement": s.get("placement"), "summary": s.get("summary"), "notes": list(s.get("notes") or []),
            "sizes": perf_rows(perf)}


def import_text(run: RunRecord, perf: Mapping[str, Any]) -> str:
    """An imported run: where it came from, the nccl-tests table, and what to run next."""
    s = run.summary or {}
    lines = [f"*** {DEMO_LABEL} ***"] if run.demo else []
    lines.append(f"Import {run.id} of {run.started_at}: {s.get('binary')} ({run.backend}), {s.get('nranks')} ranks, "
                 f"NCCL {run.nccl_version or 'n/a'}, from {s.get('source_file')}")
    shows = str((perf.get("nccltune") or {}).get("shows") or "")
    lines.append(f"{s.get('datatype', 'float')}, {s.get('redop')}; {s.get('cycles')} cycle(s)"
                 + (f"; {shows}" if shows else ""))
    lines.extend(perf_table(perf))
    lines.extend(f"Note: {n}" for n in s.get("notes") or [])
    return "\n".join(lines)


def report_text(run: RunRecord, trials: Sequence[TrialRecord] = ()) -> str:
    s = run.summary or {}
    lines = []
    if run.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep {run.id} of {run.started_at} ({run.status}), fingerprint {run.fingerprint}")
    raw = s.get("not_measured")
    not_measured = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else None
    lines.extend(rows_text(run.rows, trials, str(s.get("chosen") or "") or None, not_measured))
    lines.append(str(s.get("summary", "")))
    return "\n".join(lines)


def topocheck_doc(check: TopoCheck) -> dict[str, Any]:
    doc = {k: v for k, v in vars(check).items() if k != "dump_diff"}
    doc["busbw_gbps"] = {str(k): v for k, v in check.busbw_gbps.items()}
    doc["dump_diff"] = check.dump_diff.as_dict() if check.dump_diff else None
    return {"kind": "topo-check", **doc}


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


def verify_doc(r: VerifyResult) -> dict[str, Any]:
    return {"kind": "verify", "passed": r.passed, "code": r.code, "reason": r.reason, "demo": r.demo,
            "label": DEMO_LABEL if r.demo else None, "run_id": r.run_id, "fingerprint": r.fingerprint,
            "expectation": r.expectation, "env_source": r.env_source, "env": r.env, "nccl_version": r.nccl_version,
            "sizes": [size_row(row.size_bytes, row.collective,
                               **{k: v for k, v in vars(row).items() if k not in ("size_bytes", "collective")})
                      for row in r.rows]}


def verify_text(r: VerifyResult) -> str:
    lines = []
    if r.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"{'PASS' if r.passed else 'FAIL'}: {r.reason}")
    lines.append(f"Environment: {r.env_source}; expected: {r.expectation}")
    for row in r.rows:
        meas = f"{row.measured_gbps:.2f}" if row.measured_gbps is not None else "-"
        exp = f"{row.expected_gbps:.2f}" if row.expected_gbps is not None else "-"
        drift = f"{row.drift_pct:+.1f}%" if row.drift_pct is not None else "-"
        where = key_label((row.collective, row.size_bytes))
        lines.append(f"  {where:>7}  measured {meas:>8} GB/s  expected {exp:>8}  drift {drift:>7}"
                     f"  (allowed -{row.allowed_pct:.1f}%){'' if row.ok else '  <-- below'}")
    return "\n".join(lines)


def compare_doc(c: RunComparison) -> dict[str, Any]:
    return {"kind": "compare", "a_run": c.a_run, "b_run": c.b_run, "side": c.side,
            "slower": len(c.slower),
            "sizes": [size_row(s.size_bytes, s.collective, a_busbw_gbps=s.a_busbw_gbps, b_busbw_gbps=s.b_busbw_gbps,
                               change_pct=s.change_pct, noise_pct=s.noise_pct, verdict=s.verdict)
                      for s in c.sizes]}


def compare_text(c: RunComparison) -> str:
    lines = [f"Run {c.b_run} against run {c.a_run} ({'NCCL defaults' if c.side == 'defaults' else 'published setting'},"
             " median busbw; 1 GB/s = 1e9 B/s)"]
    table = [["collective", "size", f"run {c.a_run}", f"run {c.b_run}", "change", "noise", "verdict"]]
    for s in c.sizes:
        table.append([s.collective, str(s.size_bytes),
                      fmt_bw(s.a_busbw_gbps) if s.a_busbw_gbps is not None else "-",
                      fmt_bw(s.b_busbw_gbps) if s.b_busbw_gbps is not None else "-",
                      f"{s.change_pct:+.1f}%" if s.change_pct is not None else "-", f"±{s.noise_pct:.1f}%", s.verdict])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        cells = [cell.rjust(w) if 0 < i < 6 else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    slower = c.slower
    lines.append(f"{len(slower)} size(s) slower beyond the noise" if slower else "No size slower beyond the noise.")
    return "\n".join(lines)
