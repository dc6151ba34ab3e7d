"""`nccltune report --plot`: series per setting and a PNG that says when it is a CPU demo."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from nccltune.plot import series_by_label
from nccltune.records import Measurement


def _trial(phase: str, label: str, values: dict[int, float], status: str = "ok") -> SimpleNamespace:
    return SimpleNamespace(phase=phase, label=label, status=status,
                           measurements=[Measurement(s, 1.0, v, v) for s, v in values.items()])


TRIALS = [
    _trial("baseline", "defaults #1", {4096: 1.0, 65536: 10.0}),
    _trial("baseline", "defaults #2", {4096: 3.0, 65536: 12.0}),
    _trial("baseline", "defaults #3", {4096: 2.0, 65536: 11.0}),
    _trial("screen", "NCCL_ALGO=Tree", {4096: 50.0, 65536: 50.0}),
    _trial("final", "NCCL_MIN_NCHANNELS=32 #1", {4096: 4.0, 65536: 20.0}),
    _trial("final", "NCCL_MIN_NCHANNELS=32 #2", {4096: 6.0, 65536: 22.0}),
    _trial("final", "NCCL_MIN_NCHANNELS=32 #3", {4096: 99.0, 65536: 99.0}, status="timeout"),
]


def test_series_are_medians_of_good_baseline_and_final_runs() -> None:
    series = series_by_label(TRIALS)
    assert series == {"NCCL defaults": {4096: 2.0, 65536: 11.0},
                      "NCCL_MIN_NCHANNELS=32": {4096: 5.0, 65536: 21.0}}


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from nccltune.plot import plot_run

    run = SimpleNamespace(id=7, demo=True, summary={"chosen": "NCCL_MIN_NCHANNELS=32"})
    out = tmp_path / "busbw.png"
    plot_run(run, TRIALS, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000
