"""`nccltune report --plot`: bus bandwidth against message size, log scale (matplotlib extra)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .errors import UnavailableError
from .names import DEMO_LABEL
from .store import RunRecord, TrialRecord


def series_by_label(trials: Sequence[TrialRecord]) -> dict[str, dict[int, float]]:
    """Median busbw per size for every measured setting with more than one good run (and defaults)."""
    runs: dict[str, dict[int, list[float]]] = {}
    counts: dict[str, int] = {}
    for t in trials:
        if t.status != "ok":
            continue
        label = "NCCL defaults" if t.phase == "baseline" else t.label.rsplit(" #", 1)[0]
        if t.phase not in ("baseline", "final"):
            continue
        counts[label] = counts.get(label, 0) + 1
        for m in t.measurements:
            runs.setdefault(label, {}).setdefault(m.size_bytes, []).append(m.busbw_gbps)
    return {label: {s: statistics.median(v) for s, v in sizes.items()} for label, sizes in runs.items()}


def plot_run(run: RunRecord, trials: Sequence[TrialRecord], out: Path) -> None:
    """Raises UnavailableError (exit 69) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UnavailableError("matplotlib is not installed", hint="pip install 'nccltune[plot]'") from exc
    chosen = (run.summary or {}).get("chosen")
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in sorted(series_by_label(trials).items()):
        sizes = sorted(points)
        main_line = label in ("NCCL defaults", chosen)
        name = f"{label} (published)" if label == chosen else label
        ax.plot(sizes, [points[s] for s in sizes], marker="o", label=name,
                linewidth=2.5 if main_line else 1.0, alpha=1.0 if main_line else 0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    title = f"all-reduce busbw, run {run.id}"
    if run.demo:
        title += f"\n{DEMO_LABEL}"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
