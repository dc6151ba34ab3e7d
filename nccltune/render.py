"""Rendering helpers for the command line: tables and JSON documents. No I/O besides strings."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .names import DEMO_LABEL, format_size
from .publish import EVERY_JOB, SCOPE_APPLIES_TO, SCOPE_FILES, SINGLE_NODE
from .records import ReportRow
from .store import RunRecord, TrialRecord
from .topology.fingerprint import topology_fingerprint
from .topology.model import Topology
from .topology.nicpaths import NicPaths, compute_nic_paths
from .topology.paths import PathMatrix

if TYPE_CHECKING:  # the views only; rendering runs no sweep, verify or check
    from .doctor import Finding
    from .node import Node
    from .pipeline import SweepReport
    from .sweep.plan import Plan
    from .topocheck import TopoCheck
    from .verify import VerifyResult

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
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())
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
    if topo.nics:
        lines.append("")
        lines += _final_nic_lines(topo, compute_nic_paths(topo, paths))
    lines.append("")
    lines.append("Legend (NCCL path types): X self; NV# NVLink (direct or through NVSwitch), # links;")
    lines.append("  NVB NVLink through another GPU; PIX one PCIe switch; PXB several switches;")
    lines.append("  PHB through a CPU host bridge; SYS across CPU sockets; P2C GPU over C2C to its CPU,")
    lines.append("  NIC on that CPU; PXN to the NIC through GPU # over NVLink (PXN@#).")
    return "\n".join(lines)


def _final_nic_lines(topo: Topology, nic_paths: NicPaths) -> list[str]:
    """The GPU-NIC matrix after NCCL's re-routing, and the NIC NCCL gives each GPU."""
    version = ".".join(map(str, nic_paths.options.nccl_version))
    header = ["", *[f"NIC{i}" for i in range(len(topo.nics))]]
    rows = [header]
    for g in topo.gpus:
        row = [f"GPU{g.index}"]
        for n in topo.nics:
            p = nic_paths.paths.get((g.index, n.name))
            row.append("?" if p is None else p.final_type + (f"@{p.via_gpu}" if p.via_gpu is not None else ""))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"GPU-NIC paths as NCCL {version} uses them (P2C, PXN, GDR re-routing):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
    index = {n.name: i for i, n in enumerate(topo.nics)}
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
    return [{"name": p.name, "value": p.value, "reason": p.reason} for p in plan.pruned]


def plan_doc(plan: Plan, node: Node, trials: int, seconds: float, profile: str) -> dict[str, Any]:
    return {
        "kind": "sweep-plan",
        "demo": node.demo,
        "label": DEMO_LABEL if node.demo else None,
        "backend": plan.backend,
        "nranks": plan.nranks,
        "profile": profile,
        "fingerprint": node.fingerprint,
        "sizes": plan.sizes,
        "measure": plan.variables,
        "pruned": pruned_list(plan),
        "pinned": {n: {"value": p.value, "source": p.source, "warning": p.warning} for n, p in plan.pinned.items()},
        "policy": plan.policy,
        "notes": plan.notes,
        "estimate": {"trials": trials, "seconds": round(seconds, 1)},
    }


def shown(value: str) -> str:
    """A value from the environment or a config as one terminal-safe line: a newline or an escape
    sequence is printed escaped (\\n, \\x1b), never acted on by the terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in value)


def plan_text(plan: Plan, node: Node, trials: int, seconds: float, profile: str) -> str:
    lines = []
    if node.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep plan for {node.topo.source}: {plan.nranks} ranks, backend {plan.backend}, "
                 f"profile {profile}")
    lines.append(f"Sizes: {', '.join(format_size(s) for s in plan.sizes)}")
    lines.append("")
    lines.append("Measured (each against NCCL's defaults, which are measured first and repeated):")
    if not plan.variables:
        lines.append("  nothing: every candidate was pruned")
    for name, values in plan.variables.items():
        lines.append(f"  {name}: {', '.join(values)}")
    lines.append("  NCCL_TOPO_FILE: nccltune's topology file for this node")
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
    lines.append(f"Estimate: about {trials} trials, {_fmt_s(seconds)}.")
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


def sweep_doc(report: SweepReport) -> dict[str, Any]:
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
        "failed_trials": [{"label": lbl, "reason": r} for lbl, r in report.failed_trials],
        "wall_s": report.wall_s,
        "chosen": report.chosen_label,
        # The every-job part (nccl.sh, nccl.env), as before; the single-node part beside it.
        "published_env": report.every_job_env,
        "single_node_env": report.single_node_env,
        "scopes": scopes_doc(),
        "summary": report.summary,
        "sizes": [r.as_dict() for r in report.rows],
        "published": {"sh": str(pub.sh_path), "env": str(pub.env_path), "json": str(pub.json_path),
                      "single_node_sh": str(pub.single_sh_path) if pub.single_sh_path else None,
                      "single_node_env": str(pub.single_env_path) if pub.single_env_path else None,
                      "generation": pub.generation, "topology_file": report.topology_file} if pub else None,
        "pruned": pruned_list(report.plan),
    }


def fmt_bw(gbps: float) -> str:
    """GB/s with the digits that matter: 345.2, 12.34, 0.0123 (CPU demo sizes move little)."""
    if gbps >= 100:
        return f"{gbps:.1f}"
    if gbps >= 1:
        return f"{gbps:.2f}"
    return f"{gbps:.3g}"


def rows_text(rows: Sequence[ReportRow]) -> list[str]:
    table = [["size", "default GB/s", "noise", "tuned GB/s", "ratio", "NCCL default -> tuned"]]
    for r in rows:
        table.append([
            format_size(r.size_bytes) + ("" if r.weight else " (not in profile)"),
            fmt_bw(r.default_busbw_gbps), f"±{r.default_noise_pct:.1f}%",
            fmt_bw(r.tuned_busbw_gbps), f"{r.ratio:.3f}",
            f"{r.default_algo_proto or '-'} -> {r.tuned_algo_proto or '-'}",
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    numeric = (1, 2, 3, 4)
    lines = []
    for row in table:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def sweep_text(report: SweepReport) -> str:
    lines = []
    if report.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep {report.run_id}: backend {report.backend}, fingerprint {report.fingerprint}, "
                 f"NCCL {report.nccl_version or 'n/a'}, torch {report.torch_version or '?'}")
    failed = f" ({len(report.failed_trials)} failed)" if report.failed_trials else ""
    if report.trials or report.rows:
        lines.append(f"{report.trials} trials{failed} in {_fmt_s(report.wall_s)}; busbw medians "
                     f"(all-reduce, float32 sum, {report.method or 'no trial measured'})")
        lines.append("")
        lines.extend(rows_text(report.rows))
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
    if report.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    return "\n".join(lines)


def _run_dict(run: RunRecord) -> dict[str, Any]:
    return {"id": run.id, "kind": run.kind, "status": run.status, "started_at": run.started_at,
            "finished_at": run.finished_at, "fingerprint": run.fingerprint, "backend": run.backend,
            "demo": run.demo, "profile": run.profile, "nccltune_version": run.nccltune_version,
            "summary": run.summary, "chosen_env": run.chosen_env,
            "published_generation": run.published_generation}


def history_doc(runs: Sequence[RunRecord], trials: Sequence[TrialRecord] | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "history", "runs": [_run_dict(r) for r in runs]}
    if trials is not None:
        doc["trials"] = [{"seq": t.seq, "phase": t.phase, "label": t.label, "env": t.env, "status": t.status,
                          "reason": t.reason, "wall_s": t.wall_s,
                          "measurements": [{"size_bytes": m.size_bytes, "busbw_gbps": m.busbw_gbps,
                                            "time_us": m.time_us, "algo": m.algo, "proto": m.proto,
                                            "correct": m.correct} for m in t.measurements]}
                         for t in trials]
    return doc


def history_text(runs: Sequence[RunRecord]) -> str:
    if not runs:
        return "No runs yet."
    lines = [f"{'id':>4}  {'kind':6}  {'status':11}  {'started':25}  {'backend':7}  chosen"]
    for r in runs:
        chosen = (r.summary or {}).get("chosen") or (r.summary or {}).get("error") or ""
        demo = " [CPU demo]" if r.demo else ""
        lines.append(f"{r.id:>4}  {r.kind:6}  {r.status:11}  {r.started_at[:25]:25}  {r.backend:7}  {chosen}{demo}")
    return "\n".join(lines)


def trials_text(run: RunRecord, trials: Sequence[TrialRecord]) -> str:
    lines = [f"Run {run.id} ({run.kind}, {run.status}{', CPU demo' if run.demo else ''}), "
             f"fingerprint {run.fingerprint}"]
    for t in trials:
        best = max((m.busbw_gbps for m in t.measurements), default=0.0)
        why = f" ({t.reason})" if t.reason else ""
        lines.append(f"{t.seq:>3} {t.phase:9} {t.status:12} peak {best:8.2f} GB/s  {t.label}{why}")
    return "\n".join(lines)


def report_doc(run: RunRecord, trials: Sequence[TrialRecord], plot: str | None) -> dict[str, Any]:
    return {"kind": "report", "run": _run_dict(run), "label": DEMO_LABEL if run.demo else None,
            "sizes": [r.as_dict() for r in run.rows], "plot": plot, "trials": len(trials)}


def report_text(run: RunRecord) -> str:
    s = run.summary or {}
    lines = []
    if run.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep {run.id} of {run.started_at} ({run.status}), fingerprint {run.fingerprint}")
    lines.extend(rows_text(run.rows))
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
    return {"kind": "verify", "passed": r.passed, "reason": r.reason, "demo": r.demo,
            "label": DEMO_LABEL if r.demo else None, "run_id": r.run_id, "fingerprint": r.fingerprint,
            "expectation": r.expectation, "env_source": r.env_source, "env": r.env, "nccl_version": r.nccl_version,
            "sizes": [vars(row) for row in r.rows]}


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
        lines.append(f"  {format_size(row.size_bytes):>7}  measured {meas:>8} GB/s  expected {exp:>8}  drift {drift:>7}"
                     f"  (allowed -{row.allowed_pct:.1f}%){'' if row.ok else '  <-- below'}")
    return "\n".join(lines)
