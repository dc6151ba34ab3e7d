"""`nccltune report --plot`: one row of panels per collective measured, bus bandwidth against
message size beside the time per call (matplotlib extra, drawn headless with Agg).

Each setting the sweep measured as a whole (the trials behind its number, compare.setting_of: NCCL's
defaults in their baseline runs, the finalists, the published one among them, in their final runs)
is a line through the median of its runs' correct results per size, inside a band from its lowest
to its highest run: a gap between two lines means something only where their bands part. Sizes
are a log2 axis labelled as the config spells them (64KiB, 16MiB); the time panel is a log axis
too, so that the small sizes, flat near zero on a bandwidth scale, can be read. The title names
what the numbers were measured on (host, GPUs, NCCL, date), from the run's stored facts; a CPU
demo says so across every panel and in the PNG's own text chunks, so that a copy of the picture
shown without its command still says it holds no NCCL numbers.
"""

from __future__ import annotations

import io
import logging
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from .. import __version__
from ..collectives import COLLECTIVES
from ..compare import setting_of
from ..errors import UnavailableError
from ..files.atomicfile import atomic_write
from ..names import DEFAULTS_LABEL, DEMO_LABEL, format_size
from ..records import ALL_REDUCE
from ..store import RunRecord, TrialRecord, VerifySummary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

PUBLISHED_SUFFIX = " (published)"
BAND_NOTE = "Lines: median of a setting's runs per size; bands: its lowest to highest run. GB/s = 10^9 bytes/s."
ROW_HEIGHT_IN = 4.5  # per collective
FIGURE_WIDTH_IN = 13.0  # two panels side by side
DPI = 120
MAX_SIZE_TICKS = 9  # more labels than this overlap at the panel's width


@dataclass(frozen=True)
class Spread:
    """One size's samples of one setting: the median the line goes through and the lowest and
    highest sample, the band around it."""

    median: float
    low: float
    high: float
    samples: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of at least one sample."""
        return cls(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True)
class Line:
    """One setting's measurements of one collective, size by size, over its good trials."""

    label: str
    busbw_gbps: dict[int, Spread]
    time_us: dict[int, Spread]

    @property
    def sizes(self) -> list[int]:
        return sorted(self.busbw_gbps)


def lines_by_collective(trials: Iterable[TrialRecord]) -> dict[str, dict[str, Line]]:
    """collective -> setting -> its line: the trials behind each setting's number
    (compare.setting_of: the defaults' runs and each finalist's final runs, the ok ones), their
    correct samples per size, as busbw and as time; a wrong result is in no line, as it is in no
    median. Collectives in the order the trials measured them."""
    busbw: dict[str, dict[str, dict[int, list[float]]]] = {}
    time_us: dict[str, dict[str, dict[int, list[float]]]] = {}
    for t in trials:
        label = setting_of(t)
        if label is None:
            continue
        for m in [m for m in t.measurements if m.correct]:
            busbw.setdefault(m.collective, {}).setdefault(label, {}).setdefault(m.size_bytes, []).append(m.busbw_gbps)
            time_us.setdefault(m.collective, {}).setdefault(label, {}).setdefault(m.size_bytes, []).append(m.time_us)
    return {
        c: {label: Line(label, {s: Spread.of(v) for s, v in sizes.items()},
                        {s: Spread.of(v) for s, v in time_us[c][label].items()})
            for label, sizes in by_label.items()}
        for c, by_label in busbw.items()
    }


def series_by_collective(trials: Sequence[TrialRecord]) -> dict[str, dict[str, dict[int, float]]]:
    """collective -> setting -> size -> median busbw, for the defaults and every setting
    re-measured as a finalist, over their good trials."""
    return {c: {label: {s: sp.median for s, sp in line.busbw_gbps.items()} for label, line in by_label.items()}
            for c, by_label in lines_by_collective(trials).items()}


def series_by_label(trials: Sequence[TrialRecord], collective: str = ALL_REDUCE) -> dict[str, dict[int, float]]:
    """Median busbw per size of one collective for the defaults and every finalist setting."""
    return series_by_collective(trials).get(collective, {})


def _text(value: object) -> str | None:
    """A stored fact as text, or None where it is missing (None, empty, not a string)."""
    return (value.strip() or None) if isinstance(value, str) else None


def _gpus(topology: Mapping[str, object]) -> str | None:
    """"2x NVIDIA H200" from the run's topology record: the model where it was recorded, the count."""
    model = _text(topology.get("gpu_model"))
    count = topology.get("gpus")
    count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None
    if model and count:
        return f"{count}x {model}"
    if model:
        return model
    return f"{count} GPU{'s' if count != 1 else ''}" if count else None


def _date(run: RunRecord) -> str | None:
    """When the run finished (or started, if it did not), to the minute, in UTC."""
    raw = _text(run.finished_at) or _text(run.started_at)
    if raw is None:
        return None
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        return raw  # not what the store writes; shown as it is rather than dropped
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def title_facts(run: RunRecord) -> list[str]:
    """What the numbers were measured on, as the title lists it: host, GPUs, NCCL version (or the
    backend, where it was not NCCL) and date. A fact the run did not record is left out."""
    recorded = run.outcome
    facts: list[str | None] = [f"host {run.hostname}" if _text(run.hostname) else None,
                               _gpus(run.topology if isinstance(run.topology, Mapping) else {})]
    nccl = _text(run.nccl_version) or _text(None if isinstance(recorded, VerifySummary) else recorded.nccl_version)
    if nccl:
        facts.append(f"NCCL {nccl}")
    elif run.backend != "nccl":
        facts.append(f"{run.backend} backend")
    facts.append(_date(run))
    return [f for f in facts if f]


def title(run: RunRecord) -> str:
    """The figure's title (and the PNG's Title): the run and what it was measured on."""
    return " | ".join([f"nccltune sweep {run.id}", *title_facts(run)])


def ordered_labels(labels: Iterable[str], chosen: str | None) -> list[str]:
    """The defaults first, then the published setting, then the other finalists by name: the
    legend's order, and the order colours are given in."""
    return sorted(set(labels), key=lambda label: (0 if label == DEFAULTS_LABEL else 1 if label == chosen else 2, label))


def legend_name(label: str, chosen: str | None) -> str:
    """A line's name in the legend: the published setting says so."""
    return f"{label}{PUBLISHED_SUFFIX}" if label == chosen else label


def _size_ticks(sizes: Sequence[int]) -> list[int]:
    """Powers of two across the measured range (every one, or every k-th where they would
    crowd), or the sizes themselves where they are fewer."""
    if not sizes:
        return []
    lo, hi = math.floor(math.log2(min(sizes))), math.ceil(math.log2(max(sizes)))
    step = max(1, math.ceil((hi - lo + 1) / MAX_SIZE_TICKS))
    return [1 << e for e in range(lo, hi + 1, step)]


def _size_axis(ax: Axes, sizes: Sequence[int]) -> None:
    """Log2 x axis whose labels are sizes as the config writes them (4KiB, 1MiB)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(_size_ticks(sizes)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_size(round(x))))
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def _time_axis(ax: Axes) -> None:
    """Log y axis of microseconds, labelled as plain numbers (50, 200, 1000): at 1, 2 and 5 of
    each decade where the range spans few decades (a small range would show no label at all),
    at the powers of ten alone where more would crowd."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    low, high = ax.get_ylim()
    decades = math.log10(high / low) if low > 0 and high > low else 0.0
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
    ax.set_ylabel("time per call (us, log scale)")
    ax.grid(True, which="major", axis="y", alpha=0.3)


def _draw_line(ax: Axes, points: Mapping[int, Spread], *, name: str, color: str, main: bool) -> None:
    sizes = sorted(points)
    ax.fill_between(sizes, [points[s].low for s in sizes], [points[s].high for s in sizes],
                    color=color, alpha=0.2 if main else 0.1, linewidth=0)
    ax.plot(sizes, [points[s].median for s in sizes], marker="o", markersize=4 if main else 3, color=color,
            label=name, linewidth=2.5 if main else 1.0, alpha=1.0 if main else 0.7)


def _demo_mark(ax: Axes) -> None:
    """The demo label across the plot area, faint enough to read the lines through it; on two
    lines (after its colon), as one would not fit a panel in letters large enough to notice."""
    ax.text(0.5, 0.5, DEMO_LABEL.replace(": ", ":\n", 1), transform=ax.transAxes, ha="center", va="center",
            rotation=15, fontsize=17, fontweight="bold", color="tab:red", alpha=0.3, zorder=0.5, clip_on=True,
            linespacing=1.4)


def _collective_title(collective: str) -> str:
    factor = COLLECTIVES[collective].factor_kind if collective in COLLECTIVES else None
    return f"{collective} (busbw = algbw x {factor})" if factor else collective


def build_figure(run: RunRecord, trials: Sequence[TrialRecord]) -> Figure:
    """The figure `plot_run` writes: per collective, a busbw panel (GB/s, linear) and a time
    panel (us, log), each line with its band. Raises UnavailableError (exit 69) when matplotlib is
    not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UnavailableError("matplotlib is not installed", hint="pip install 'nccltune[plot]'") from exc
    chosen = _text(run.sweep_summary.chosen)
    lines = lines_by_collective(trials) or {ALL_REDUCE: {}}
    rows = len(lines)
    # A Figure of its own (not pyplot's): nothing global to close, and Agg whatever the caller set.
    # Constrained layout keeps room for the title's lines and the note, however many rows.
    fig = Figure(figsize=(FIGURE_WIDTH_IN, ROW_HEIGHT_IN * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False)
    # One colour per setting in every panel, the defaults' and the published setting's first.
    colours = {label: f"C{i % 10}" for i, label in
               enumerate(ordered_labels((label for by_label in lines.values() for label in by_label), chosen))}
    for (bw_ax, time_ax), (collective, by_label) in zip(axes, lines.items(), strict=True):
        sizes = sorted({s for ln in by_label.values() for s in ln.sizes})
        for label in ordered_labels(by_label, chosen):
            ln, main, name = by_label[label], label in (DEFAULTS_LABEL, chosen), legend_name(label, chosen)
            _draw_line(bw_ax, ln.busbw_gbps, name=name, color=colours[label], main=main)
            _draw_line(time_ax, ln.time_us, name=name, color=colours[label], main=main)
        for ax in (bw_ax, time_ax):
            _size_axis(ax, sizes)
            if run.demo:
                _demo_mark(ax)
        bw_ax.set_ylabel("bus bandwidth (GB/s, 10^9 B/s)")
        bw_ax.set_ylim(bottom=0)
        bw_ax.set_title(f"{_collective_title(collective)}: bus bandwidth")
        _time_axis(time_ax)
        time_ax.set_title(f"{collective}: time")
        if by_label:
            bw_ax.legend(fontsize=8, loc="upper left")
        else:
            bw_ax.text(0.5, 0.5, "no good trial to draw", transform=bw_ax.transAxes, ha="center", va="center")
    heading = title(run) + (f"\n{DEMO_LABEL}" if run.demo else "")
    fig.suptitle(heading, fontsize=12, color="tab:red" if run.demo else "black")
    fig.supxlabel(BAND_NOTE, fontsize=8, x=0.01, ha="left")
    return fig


def png_metadata(run: RunRecord) -> dict[str, str]:
    """The PNG's text chunks: the title, and for a CPU demo its label, where image viewers and
    `identify -verbose` show them."""
    meta = {"Title": title(run), "Software": f"nccltune {__version__}",
            "Description": "Bus bandwidth and time per message size, per collective, of " + title(run)}
    if run.demo:
        meta["Description"] += f". {DEMO_LABEL}"
        meta["Comment"] = DEMO_LABEL
    return meta


def plot_run(run: RunRecord, trials: Sequence[TrialRecord], out: Path) -> None:
    """Write the run's plot as a PNG to `out`.

    Raises:
        UnavailableError: matplotlib is not installed (exit 69).
        FileError: `out` cannot be written (exit 1), naming the path and the OS error.
    """
    fig = build_figure(run, trials)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI, metadata=png_metadata(run))
    # Whole or not at all: a reader (a dashboard, a browser) never sees half a PNG.
    atomic_write(out, png.getvalue())
    log.info("plot of run %d written to %s", run.id, out)
