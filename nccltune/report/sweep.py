"""A sweep's views: its plan (`sweep --plan`), its result (`sweep`) and the per-size table they share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..collectives import COLLECTIVES
from ..names import DEFAULTS_LABEL, DEMO_LABEL, format_size
from ..publish import EVERY_JOB, SCOPE_APPLIES_TO, SCOPE_FILES, SINGLE_NODE
from ..records import ReportRow
from ..store import TrialRecord
from ..sweep.pertable import nccl_name
from ..sweep.plan import candidate_code
from .jsondoc import fmt_bw, report_row, shown

if TYPE_CHECKING:  # the views only; rendering runs no sweep, verify or check
    from ..node import Node
    from ..pipeline import SweepReport
    from ..pipeline.planning import Workload
    from ..pipeline.tablestage import TableOutcome
    from ..sweep.decision import Verdict
    from ..sweep.plan import Plan



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
            # The table's collectives as its file spells them (plan.schema.json).
            "collectives": [nccl_name(t) for t in ps.collectives],
            "candidates": [{"label": c.label, "env": c.env(),
                            "collectives": [nccl_name(t) for t in ps.collectives if c.applies_to(t)]}
                           for c in ps.candidates],
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
             f"{', '.join(map(nccl_name, ps.collectives))}):"]
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
        # Each entry's collective as the table file spells it.
        width = max(len(nccl_name(sp.collective)) for sp in table.spans)
        for sp in table.spans:
            ch = f", {sp.cell.channels} channels" if sp.cell.channels else ""
            # Ranges end below the next one's start; a collective's last ends at its largest measured size.
            end = f"{format_size(sp.max_bytes)}]" if sp.last else f"{format_size(sp.max_bytes + 1)})"
            lines.append(f"  {nccl_name(sp.collective):<{width}}  [{format_size(sp.min_bytes)}, {end} (measured "
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
             workload: Workload | None = None, *, unmeasured: str | None = None,
             most: tuple[int, float] | None = None) -> dict[str, Any]:
    """The plan as one document. `unmeasured`: why nothing is measured on this node (one GPU):
    the same document then measures nothing, estimates no trial and says why under `reason`.
    `trials`, `seconds`: when the final check decides at its first look; `most`: the trials and
    seconds when it adds every round it may (the same as those without)."""
    most_trials, most_seconds = most or (trials, seconds)
    return {
        "kind": "plan",
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
        "from_published": ({"generation": plan.published_generation, "env": dict(plan.from_published)}
                           if plan.from_published else None),
        "policy": plan.policy,
        "notes": plan.notes,
        "per_size": per_size_plan_doc(plan),
        "estimate": {"trials": trials, "seconds": round(seconds, 1),
                     "most_trials": most_trials, "most_seconds": round(most_seconds, 1)},
        **(workload_doc(workload) if workload is not None else {}),
    }


def plan_text(plan: Plan, node: Node, trials: int, seconds: float, profile: str,
              workload: Workload | None = None, *, most: tuple[int, float] | None = None) -> str:
    """The plan for a reader; `trials`, `seconds` and `most` as plan_doc's."""
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
    if "NCCL_TOPO_FILE" not in plan.pinned:
        lines.append("  NCCL_TOPO_FILE: nccltune's topology file for this node")
    lines.extend(per_size_plan_text(plan))
    if plan.pinned:
        lines.append("")
        lines.append("Pinned (never swept, never removed; --unpin NAME to sweep one anyway):")
        for name, p in plan.pinned.items():
            warn = f"  WARNING: {shown(p.warning)}" if p.warning else ""
            lines.append(f"  {name}={shown(p.value)} (from the {p.source}){warn}")
    if plan.from_published:
        lines.append("")
        lines.append(f"Not pinned: set in the environment from nccltune's published set (generation "
                     f"{plan.published_generation}) by the launch that started this sweep, so swept as if unset:")
        lines.extend(f"  {name}={shown(value)}" for name, value in plan.from_published.items())
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
    if most is not None and most[0] > trials:
        lines.append(f"  At most {most[0]} trials, {_fmt_s(most[1])}, where the final check adds its rounds "
                     "(finalists that its first look leaves undecided).")
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
        "decision": decision_doc(report),
        "image": dict(report.image) if report.image else None,
    }


def decision_doc(report: SweepReport) -> dict[str, Any] | None:
    """How sure the sweep is of what it chose (sweep/decision.py): the chosen candidate's verdict, or
    where the defaults stay, the best finalist's; the final check's rounds and trials."""
    table = report.table
    finalists = [f for f in ([table.whole, table.env_only] if table and table.final.looks else
                             (report.result.finalists if report.result else [])) if f is not None]
    final = table.final if table and table.final.looks else report.result.final if report.result else None
    judged = [f for f in finalists if f.verdict is not None]
    if not judged or final is None:
        return None
    chosen = next((f for f in judged if f.label == report.chosen_label and f.verdict and f.verdict.eligible), None)
    shown = chosen or max(judged, key=lambda f: f.verdict.lower_pct if f.verdict and f.verdict.lower_pct is not None
                          else float("-inf"))
    v = shown.verdict
    assert v is not None
    return {"candidate": shown.label, "published": chosen is not None, "status": v.status,
            "gain_pct": round(v.gain_pct, 3),
            "lower_gain_pct": None if v.lower_pct is None else round(v.lower_pct, 3),
            "confidence_pct": round(v.confidence_pct, 3), "pairs": v.pairs, "reason": v.reason,
            "final_rounds": final.rounds, "final_trials": final.trials, "looks": list(final.looks),
            # Every finalist's own verdict, in the order they were ranked for the final check.
            "finalists": [_verdict_doc(f.label, f.verdict, len(f.runs)) for f in judged if f.verdict]}


def _verdict_doc(label: str, v: Verdict[Any], runs: int) -> dict[str, Any]:
    return {"candidate": label, "status": v.status, "eligible": v.eligible, "runs": runs,
            "gain_pct": round(v.gain_pct, 3),
            "lower_gain_pct": None if v.lower_pct is None else round(v.lower_pct, 3), "reason": v.reason}


def _table_doc(report: SweepReport) -> dict[str, Any] | None:
    if report.table is not None:
        return {**report.table.as_dict(), "text": report.table.table_text,
                "published": report.published_table or None}
    ps = report.plan.per_size
    return {"status": ps.inactive_text} if ps is not None else None


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
    """(collective, size) -> SizeFacts from a run's trials. Wrong results count for each side in
    the trials of its setting (compare.trial_setting: those behind its number, and the ones of them
    that ended with a wrong result): NCCL's defaults, and the setting `chosen` names."""
    from ..compare import setting_name, trial_setting

    published = setting_name(chosen)
    factors: dict[tuple[str, int], float] = {}
    wrong: dict[tuple[str, int], list[int]] = {}
    for t in trials:
        setting = trial_setting(t.phase, t.label)
        is_default, is_tuned = setting == DEFAULTS_LABEL, setting == published
        for m in t.measurements:
            key = (m.collective, m.size_bytes)
            if m.algbw_gbps > 0 and m.busbw_gbps > 0:
                factors.setdefault(key, m.busbw_gbps / m.algbw_gbps)
            counts = wrong.setdefault(key, [0, 0])
            if not m.correct:
                counts[0] += is_default
                counts[1] += is_tuned
    return {k: SizeFacts(factors.get(k), *wrong.get(k, [0, 0])) for k in set(factors) | set(wrong)}


def _side(busbw_gbps: float, facts: SizeFacts | None, time_us: float | None) -> list[str]:
    """time (us), algbw, busbw of one side of a row: the median time the trials measured, and
    algbw from the median busbw by the size's factor (never a time from a rounded bandwidth)."""
    factor = facts.bus_factor if facts else None
    time = f"{time_us:.2f}" if time_us else "-"
    if not factor or busbw_gbps <= 0:
        return [time, "-", fmt_bw(busbw_gbps)]
    return [time, fmt_bw(busbw_gbps / factor), fmt_bw(busbw_gbps)]


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
    Time is the median the trials of that side measured (compare.setting_trials: the same trials
    as the busbw); algbw follows from the median busbw by the factor measured at that size."""
    from ..compare import setting_trials, side_times

    facts = size_facts(trials, chosen)
    default_times = side_times(setting_trials(trials, "defaults"))
    tuned_times = side_times(setting_trials(trials, chosen))
    table = [["size", "count", "type", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong",
              "ratio", "noise", "NCCL default -> tuned"]]
    for r in rows:
        f = facts.get((r.collective, r.size_bytes))
        table.append([
            str(r.size_bytes), str(r.size_bytes // ELEMENT_BYTES), ELEMENT_TYPE,
            *_side(r.default_busbw_gbps, f, default_times.get((r.collective, r.size_bytes))),
            str(f.wrong_defaults if f else 0),
            *_side(r.tuned_busbw_gbps, f, tuned_times.get((r.collective, r.size_bytes))),
            str(f.wrong_tuned if f else 0),
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
    lines.append("#" + " " * (pad - 1) + DEFAULTS_LABEL.center(defaults_w) + "  " + "published".center(tuned_w))
    for i, row in enumerate(table):
        cells = [c.rjust(w) if j < left else c for j, (c, w) in enumerate(zip(row, widths, strict=True))]
        line = "  ".join(cells).rstrip()
        lines.append(("#" + line[1:]) if i == 0 and line.startswith(" ") else line)
    return lines


def image_line(image: Mapping[str, str]) -> str:
    """The job's image the ranks ran in (bench.image), as its probe found it."""
    return (f"Measured in image {image['image']} ({image['runtime']}): NCCL {image.get('image_nccl_version', 'n/a')}, "
            f"torch {image.get('image_torch_version', '?')}")


def sweep_text(report: SweepReport, trials: Sequence[TrialRecord] = ()) -> str:
    lines = []
    if report.demo:
        lines.append(f"*** {DEMO_LABEL} ***")
    lines.append(f"Sweep {report.run_id}: backend {report.backend}, fingerprint {report.fingerprint}, "
                 f"NCCL {report.nccl_version or 'n/a'}, torch {report.torch_version or '?'}")
    if report.image:
        lines.append(image_line(report.image))
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
