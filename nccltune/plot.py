"""`nccltune report --plot`: bus bandwidth against message size, log scale, one panel per
collective (matplotlib extra)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .errors import UnavailableError
from .names import DEMO_LABEL
from .records import ALL_REDUCE
from .store import RunRecord, TrialRecord


def series_by_collective(trials: Sequence[TrialRecord]) -> dict[str, dict[str, dict[int, float]]]:
    """collective -> setting -> size -> median busbw, for the defaults and every setting
    re-measured as a finalist, over their good trials."""
    runs: dict[str, dict[str, dict[int, list[float]]]] = {}
    for t in trials:
        if t.status != "ok" or t.phase not in ("baseline", "final"):
            continue
        label = "NCCL defaults" if t.phase == "baseline" else t.label.rsplit(" #", 1)[0]
        for m in t.measurements:
            runs.setdefault(m.collective, {}).setdefault(label, {}).setdefault(m.size_bytes, []).append(m.busbw_gbps)
    return {c: {label: {s: statistics.median(v) for s, v in sizes.items()} for label, sizes in by_label.items()}
            for c, by_label in runs.items()}


def series_by_label(trials: Sequence[TrialRecord], collective: str = ALL_REDUCE) -> dict[str, dict[int, float]]:
    """Median busbw per size of one collective for the defaults and every finalist setting."""
    return series_by_collective(trials).get(collective, {})


def plot_run(run: RunRecord, trials: Sequence[TrialRecord], out: Path) -> None:
    """One panel per collective measured. Raises UnavailableError (exit 69) when matplotlib is
    not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UnavailableError("matplotlib is not installed", hint="pip install 'nccltune[plot]'") from exc
    chosen = (run.summary or {}).get("chosen")
    series = series_by_collective(trials) or {ALL_REDUCE: {}}
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 4.5 * len(series)), squeeze=False)
    for ax, (collective, by_label) in zip(axes[:, 0], series.items(), strict=True):
        for label, points in sorted(by_label.items()):
            sizes = sorted(points)
            main_line = label in ("NCCL defaults", chosen)
            name = f"{label} (published)" if label == chosen else label
            ax.plot(sizes, [points[s] for s in sizes], marker="o", label=name,
                    linewidth=2.5 if main_line else 1.0, alpha=1.0 if main_line else 0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{collective.replace('_', '-')} busbw, run {run.id}")
        ax.grid(True, which="both", alpha=0.3)
        if by_label:
            ax.legend(fontsize=8)
    if run.demo:
        fig.suptitle(DEMO_LABEL)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
