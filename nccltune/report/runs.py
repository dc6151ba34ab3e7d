"""The history's views: runs and trials (`history`), a run's report, an import, a verification and a
comparison of two runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..names import DEMO_LABEL, format_size
from ..store import RunRecord, TrialRecord, VerifySummary
from ..sweep.select import key_label
from .jsondoc import fmt_bw, report_row, size_row
from .sweep import TABLE_UNITS, rows_text

if TYPE_CHECKING:  # the views only; rendering runs no sweep, verify or check
    from ..checks.verify import VerifyResult
    from ..compare import RunComparison



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


def history_doc(runs: Sequence[RunRecord], trials: Sequence[TrialRecord] | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "history", "runs": [_run_dict(r) for r in runs]}
    if trials is not None:
        doc["trials"] = [{"seq": t.seq, "phase": t.phase, "label": t.label, "env": t.env, "status": t.status,
                          "reason": t.reason, "wall_s": t.wall_s,
                          "measurements": [m.to_doc() for m in t.measurements]}
                         for t in trials]
    return doc


def history_text(runs: Sequence[RunRecord]) -> str:
    if not runs:
        return "No runs yet."
    lines = [f"{'id':>4}  {'kind':6}  {'status':11}  {'started':25}  {'backend':10}  chosen"]
    for r in runs:
        recorded = r.outcome
        chosen = (None if isinstance(recorded, VerifySummary) else recorded.chosen) or recorded.error or ""
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
        doc["imported"] = {"placement": run.import_summary.placement, "sizes": perf_rows(perf)}
    return doc


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
    s = run.import_summary
    return {"kind": "import", "run_id": run.id, "file": s.source_file, "collective": s.collective,
            "binary": s.binary, "nranks": s.nranks, "backend": run.backend, "demo": run.demo,
            "label": DEMO_LABEL if run.demo else None, "nccl_version": run.nccl_version,
            "hostname": run.hostname, "fingerprint": run.fingerprint, "cycles": s.cycles,
            "placement": s.placement, "summary": s.line, "notes": list(s.notes or []),
            "sizes": perf_rows(perf)}


def import_text(run: RunRecord, perf: Mapping[str, Any]) -> str:
    """An imported run: where it came from, the nccl-tests table, and what to run next."""
    s = run.import_summary
    lines = [f"*** {DEMO_LABEL} ***"] if run.demo else []
    lines.append(f"Import {run.id} of {run.started_at}: {s.binary} ({run.backend}), {s.nranks} ranks, "
                 f"NCCL {run.nccl_version or 'n/a'}, from {s.source_file}")
    shows = str((perf.get("nccltune") or {}).get("shows") or "")
    lines.append(f"{s.datatype or 'float'}, {s.redop}; {s.cycles} cycle(s)"
                 + (f"; {shows}" if shows else ""))
    lines.extend(perf_table(perf))
    lines.extend(f"Note: {n}" for n in s.notes or ())
    return "\n".join(lines)


def report_text(run: RunRecord, trials: Sequence[TrialRecord] = ()) -> str:
    s = run.sweep_summary
    lines = []
    if run.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep {run.id} of {run.started_at} ({run.status}), fingerprint {run.fingerprint}")
    lines.extend(rows_text(run.rows, trials, s.chosen or None, s.not_measured))
    lines.append(s.line or "")
    return "\n".join(lines)


def verify_doc(r: VerifyResult) -> dict[str, Any]:
    return {"kind": "verify", "passed": r.passed, "code": r.code, "reason": r.reason, "demo": r.demo,
            "label": DEMO_LABEL if r.demo else None, "run_id": r.run_id, "fingerprint": r.fingerprint,
            "nccl_ran": r.nccl_ran,
            "expectation": r.expectation, "env_source": r.env_source, "env": r.env, "nccl_version": r.nccl_version,
            "checked": r.checked, "one_gpu": r.one_gpu,
            "sizes": [size_row(row.size_bytes, row.collective,
                               **{k: v for k, v in row.to_doc().items() if k not in ("size_bytes", "collective")})
                      for row in r.rows]}


def verify_text(r: VerifyResult) -> str:
    lines = []
    if r.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"{'PASS' if r.passed else 'FAIL'}: {r.reason}")
    lines.append(f"Environment: {r.env_source}; expected: {r.expectation}")
    lines += nccl_ran_lines(r.nccl_ran)
    if r.checked:
        lines.append(f"Checked: {r.checked}")
    lines += one_gpu_lines(r.one_gpu)
    for row in r.rows:
        meas = f"{row.measured_gbps:.2f}" if row.measured_gbps is not None else "-"
        exp = f"{row.expected_gbps:.2f}" if row.expected_gbps is not None else "-"
        drift = f"{row.drift_pct:+.1f}%" if row.drift_pct is not None else "-"
        where = key_label((row.collective, row.size_bytes))
        lines.append(f"  {where:>7}  measured {meas:>8} GB/s  expected {exp:>8}  drift {drift:>7}"
                     f"  (allowed -{row.allowed_pct:.1f}%)"
                     + ("  not verifiable: left out" if not getattr(row, "verifiable", True) else "")
                     + ("" if row.ok else "  <-- below"))
    return "\n".join(lines)


def nccl_ran_lines(ran: Mapping[str, Any] | None) -> list[str]:
    """What NCCL's own log of the check showed (nccl.ran.WhatRan.doc), each finding with its code."""
    if ran is None:
        return []
    shape = ran.get("shape")
    table = ran.get("table")
    lines = [f"NCCL ran: {'as published' if ran.get('passed') else 'NOT as published'}; tuner "
             f"{ran.get('tuner') or 'none'}; table {table or 'none'}"
             + (f" for {shape[0]} node(s) x {shape[2]} rank(s)" if shape else "")
             + f"; {ran.get('cells_checked', 0)} choice(s) compared with the table"]
    if ran.get("unconfirmed"):
        lines.append(f"  NCCL never logged reading: {', '.join(ran['unconfirmed'])}")
    lines += [f"  [{f['code']}] {f['message']}" for f in ran.get("findings", [])]
    return lines


def one_gpu_lines(report: Mapping[str, Any] | None) -> list[str]:
    """A node with one GPU (checks.onegpu.OneGpuReport.doc): each shape N x 1 formed with N NCCL
    hosts on the one GPU and what NCCL's log of it showed, the shapes not formed, the wall time."""
    if report is None:
        return []
    lines = [f"One GPU: {report.get('note')}; published: {report.get('holds')}"]
    if report.get("table_problem"):
        lines.append(f"  the table cannot be read by nccltune: {report['table_problem']}")
    for shape in report.get("shapes", []):
        ran = shape.get("nccl_ran")
        what = (f"{ran.get('cells_checked', 0)} choice(s) compared, "
                + ("as published" if ran.get("passed") else ", ".join(f["code"] for f in ran.get("findings", [])))
                if ran else "no NCCL log read")
        sizes = ", ".join(format_size(int(s)) for s in shape.get("sizes", []))
        lines.append(f"  {shape.get('label')}: {shape.get('nnodes')} NCCL hosts on the one GPU, "
                     f"{', '.join(shape.get('collectives', []))} at {sizes}: {shape.get('status')}"
                     + (f" ({shape['reason']})" if shape.get("reason") else "") + f"; {what}")
    lines += [f"  not formed: {why}" for why in report.get("not_formed", [])]
    lines.append(f"Wall time: {float(report.get('wall_s') or 0):.1f} s ({'quick' if report.get('quick') else 'full'} "
                 "check)")
    return lines


def verify_run_text(run: RunRecord) -> str:
    """A verification from the history (`nccltune report --run ID`): measured against expected bus
    bandwidth per size, from the rows its summary keeps ("-" where a size has no number)."""
    verified = run.verify_summary
    lines = [f"Verification {run.id} of {run.started_at} ({run.status}): {verified.reason or ''}"]
    for row in verified.rows or ():
        measured, expected, drift = row.measured_gbps, row.expected_gbps, row.drift_pct
        lines.append(f"  {row.size_bytes} B: measured {'-' if measured is None else fmt_bw(measured)}, "
                     f"expected {'-' if expected is None else fmt_bw(expected)}"
                     + (f", drift {drift:+.1f}%" if drift is not None else ""))
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
    if all(s.verdict == "missing" for s in c.sizes):
        lines.append("Nothing compared: no size has a bus bandwidth in both runs.")
    else:
        lines.append(f"{len(slower)} size(s) slower beyond the noise" if slower else "No size slower beyond the noise.")
    return "\n".join(lines)
