"""`nccltune report --plot`: series per setting with their noise, a busbw and a time panel per
collective, a title of what was measured, and a PNG that says when it is a CPU demo."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from demo_state import DemoSweep

from nccltune.cli import main
from nccltune.names import DEMO_LABEL
from nccltune.records import Measurement
from nccltune.report.plot import Spread, lines_by_collective, series_by_label, title_facts
from nccltune.store import RunRecord, Store, TrialRecord

KiB = 1 << 10
MiB = 1 << 20


def _trial(phase: str, label: str, values: dict[int, float], status: str = "ok",
           collective: str = "all_reduce") -> TrialRecord:
    # time from busbw as a one-rank all_reduce would have it: bytes / (GB/s * 1e3) us
    return TrialRecord(id=0, run_id=7, seq=0, phase=phase, label=label, env={}, status=status,  # type: ignore[arg-type]
                       reason=None, wall_s=1.0, nccl=None, started_at="2025-03-04T10:00:00.000000+00:00",
                       measurements=tuple(Measurement(s, s / (v * 1e3), v, v, collective=collective)
                                          for s, v in values.items()))


TRIALS = [
    _trial("baseline", "defaults #1", {4096: 1.0, 65536: 10.0}),
    _trial("baseline", "defaults #2", {4096: 3.0, 65536: 12.0}),
    _trial("baseline", "defaults #3", {4096: 2.0, 65536: 11.0}),
    _trial("screen", "NCCL_ALGO=Tree", {4096: 50.0, 65536: 50.0}),
    _trial("final", "NCCL_MIN_NCHANNELS=32 #1", {4096: 4.0, 65536: 20.0}),
    _trial("final", "NCCL_MIN_NCHANNELS=32 #2", {4096: 6.0, 65536: 22.0}),
    _trial("final", "NCCL_MIN_NCHANNELS=32 #3", {4096: 99.0, 65536: 99.0}, status="timeout"),
]
# Two collectives, three settings (the defaults, the published one, another finalist), sizes from 4 KiB to 4 MiB.
LADDER = {4 * KiB: 1.0, 64 * KiB: 5.0, 1 * MiB: 20.0, 4 * MiB: 40.0}
WIDE_TRIALS = [
    _trial(phase, label, {s: v * f for s, v in LADDER.items()}, collective=c)
    for c in ("all_reduce", "all_gather")
    for phase, label, f in (("baseline", "defaults #1", 1.0), ("baseline", "defaults #2", 1.1),
                            ("final", "NCCL_ALGO=Ring #1", 1.3), ("final", "NCCL_ALGO=Ring #2", 1.2),
                            ("final", "NCCL_MIN_NCHANNELS=32 #1", 0.9))
]


def _run(**changes: Any) -> RunRecord:
    run = RunRecord(
        id=7, kind="sweep", status="ok", started_at="2025-03-04T10:00:00.000000+00:00",
        finished_at="2025-03-04T10:20:30.000000+00:00", fingerprint="f" * 16, backend="nccl", demo=False,
        profile=None, nccl_version="2.21.5", driver_version="550.54.15", torch_version="2.5.1",
        nccltune_version="0", hostname="gpu-node-3", topology={"source": "nvml", "gpus": 2, "gpu_model": "NVIDIA H200"},
        config={}, summary={"chosen": "NCCL_ALGO=Ring"}, chosen_env=None, published_generation=None)
    return dataclasses.replace(run, **changes)


DEMO_RUN = _run(demo=True, backend="gloo", nccl_version=None,
                summary={"chosen": "NCCL_ALGO=Ring", "nccl_version": "2.21.5"})


def _texts(ax: Any) -> list[str]:
    """What the axes shows as its own text (not its title or labels), whitespace folded."""
    return [" ".join(t.get_text().split()) for t in ax.texts]


def test_series_are_medians_of_good_baseline_and_final_runs() -> None:
    series = series_by_label(TRIALS)
    assert series == {"NCCL defaults": {4096: 2.0, 65536: 11.0},
                      "NCCL_MIN_NCHANNELS=32": {4096: 5.0, 65536: 21.0}}


def test_lines_carry_the_spread_of_their_samples_as_busbw_and_time() -> None:
    lines = lines_by_collective(TRIALS)["all_reduce"]
    assert set(lines) == {"NCCL defaults", "NCCL_MIN_NCHANNELS=32"}  # neither the screen nor the timeout
    assert lines["NCCL defaults"].busbw_gbps[4096] == Spread(2.0, 1.0, 3.0, 3)
    assert lines["NCCL_MIN_NCHANNELS=32"].busbw_gbps[65536] == Spread(21.0, 20.0, 22.0, 2)
    # time per call falls as busbw rises: the slowest sample is the high end of the time band
    t = lines["NCCL defaults"].time_us[4096]
    assert (t.low, t.median, t.high) == pytest.approx((4096 / 3e3, 4096 / 2e3, 4096 / 1e3))


def test_a_wrong_result_is_in_no_line_as_in_no_median() -> None:
    from nccltune.compare import setting_trials, side_stats

    # The second run of the defaults was wrong at 4 KiB (a worker's element check failed there).
    wrong = dataclasses.replace(TRIALS[1], measurements=tuple(
        dataclasses.replace(m, correct=m.size_bytes != 4096) for m in TRIALS[1].measurements))
    trials = [TRIALS[0], wrong, *TRIALS[2:]]
    line = lines_by_collective(trials)["all_reduce"]["NCCL defaults"]
    assert line.busbw_gbps[4096] == Spread(1.5, 1.0, 2.0, 2)  # 3.0 left out
    assert line.busbw_gbps[65536] == Spread(11.0, 10.0, 12.0, 3)
    assert line.time_us[4096].samples == 2
    # The same samples as compare's median of that setting.
    stats = side_stats(setting_trials(trials, "defaults"))
    assert {size: st.median for (_c, size), st in stats.items()} == {
        size: sp.median for size, sp in line.busbw_gbps.items()}


def test_title_lists_what_was_measured_and_leaves_out_what_was_not() -> None:
    assert title_facts(_run()) == ["host gpu-node-3", "2x NVIDIA H200", "NCCL 2.21.5", "2025-03-04 10:20 UTC"]
    # The version the trials reported, in the summary, where the run's column is empty.
    assert "NCCL 2.21.5" in title_facts(_run(nccl_version=None, summary={"nccl_version": "2.21.5"}))
    bare = title_facts(_run(nccl_version=None, topology={}, summary=None, finished_at=None))
    assert bare == ["host gpu-node-3", "2025-03-04 10:00 UTC"]
    assert title_facts(_run(topology={"gpus": 1}, nccl_version=None, backend="gloo"))[1:3] == ["1 GPU", "gloo backend"]
    assert not any("None" in f for f in bare)


def test_demo_figure_marks_every_panel_and_names_the_node() -> None:
    pytest.importorskip("matplotlib")
    from nccltune.report.plot import build_figure

    fig = build_figure(DEMO_RUN, WIDE_TRIALS)
    fig.canvas.draw()  # tick labels are formatted at draw time
    axes = fig.axes
    assert len(axes) == 4  # two collectives, a busbw and a time panel each
    for ax in axes:
        assert DEMO_LABEL in _texts(ax), ax.get_title()
    heading = fig.get_suptitle()
    for fact in ("gpu-node-3", "2x NVIDIA H200", "NCCL 2.21.5", "2025-03-04", DEMO_LABEL):
        assert fact in heading
    bw, time = axes[0], axes[1]
    assert bw.get_title().startswith("all_reduce") and axes[2].get_title().startswith("all_gather")
    assert "GB/s" in bw.get_ylabel() and "10^9" in bw.get_ylabel()
    assert time.get_yscale() == "log" and "us" in time.get_ylabel()
    assert all(t.get_text().replace(".", "").isdigit() for t in time.get_yticklabels())  # 20, 50, 100: no 10^x
    assert bw.get_xscale() == "log"
    ticks = [t.get_text() for t in bw.get_xticklabels()]
    assert ticks == ["4KiB", "8KiB", "16KiB", "32KiB", "64KiB", "128KiB", "256KiB", "512KiB", "1MiB", "2MiB",
                     "4MiB"][::2]
    legend = [t.get_text() for t in bw.get_legend().get_texts()]
    assert legend == ["NCCL defaults", "NCCL_ALGO=Ring (published)", "NCCL_MIN_NCHANNELS=32"]
    for ax in axes:
        # A noise band per line, in both panels of every collective.
        assert len(ax.lines) == 3 and len(ax.collections) == 3, ax.get_title()
    band = bw.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == pytest.approx(1.0) and band.max() == pytest.approx(44.0)  # defaults: 4 KiB low, 4 MiB high


def test_the_defaults_kept_are_the_published_line() -> None:
    pytest.importorskip("matplotlib")
    from nccltune.report.plot import build_figure

    fig = build_figure(_run(summary={"chosen": "NCCL defaults"}), TRIALS)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "NCCL defaults (published)", "NCCL_MIN_NCHANNELS=32"]


def test_demo_png_says_so_in_its_metadata(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    from nccltune.report.plot import plot_run

    out = tmp_path / "busbw.png"
    plot_run(DEMO_RUN, TRIALS, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000
    with Image.open(out) as png:
        meta = dict(png.text)  # type: ignore[attr-defined]
        assert png.size == (1560, 540)  # one collective: one row of two panels, 13 x 4.5 in at 120 dpi
    assert meta["Comment"] == DEMO_LABEL
    assert DEMO_LABEL in meta["Description"] and "gpu-node-3" in meta["Title"]


def test_a_run_on_gpus_has_no_demo_label(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    from nccltune.report.plot import build_figure, plot_run

    fig = build_figure(_run(), WIDE_TRIALS)
    every_text = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]  # type: ignore[attr-defined]
    assert every_text and not any("DEMO" in t for t in every_text)
    out = tmp_path / "busbw.png"
    plot_run(_run(), WIDE_TRIALS, out)
    with Image.open(out) as png:
        meta = dict(png.text)  # type: ignore[attr-defined]
    assert "Comment" not in meta and not any("DEMO" in v for v in meta.values())
    assert meta["Title"] == "nccltune sweep 7 | host gpu-node-3 | 2x NVIDIA H200 | NCCL 2.21.5 | 2025-03-04 10:20 UTC"


def test_an_unwritable_plot_path_is_named(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from nccltune.files.atomicfile import FileError
    from nccltune.report.plot import plot_run

    out = tmp_path / "no-such-dir" / "busbw.png"
    with pytest.raises(FileError, match="no-such-dir"):
        plot_run(_run(), TRIALS, out)
    assert not out.parent.exists()


def test_report_plot_of_the_demo_sweep_end_to_end(demo_sweep: DemoSweep, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    png = tmp_path / "busbw.png"
    assert main(["report", *map(str, demo_sweep.args()), "--plot", str(png)]) == 0
    assert f"Plot written to {png}" in capsys.readouterr().out
    with Store(demo_sweep.state / "history.db") as store:
        run = store.run(demo_sweep.doc["run_id"])
    assert run is not None and run.demo
    with Image.open(png) as image:
        meta = dict(image.text)  # type: ignore[attr-defined]
        assert image.size == (1560, 540)  # the demo sweep measures all_reduce alone
    assert meta["Comment"] == DEMO_LABEL
    assert meta["Title"].startswith(f"nccltune sweep {run.id} | host {run.hostname} | ")
    assert "None" not in meta["Title"] and "gloo backend" in meta["Title"]
    # An unwritable path is a clear error (exit 1) that names it, and no traceback.
    bad = tmp_path / "missing" / "busbw.png"
    assert main(["report", *map(str, demo_sweep.args()), "--plot", str(bad)]) == 1
    assert str(bad.parent) in capsys.readouterr().err
