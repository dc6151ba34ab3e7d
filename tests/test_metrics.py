"""The node_exporter textfile: parsed the way Prometheus parses it, written atomically."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nccltune import __version__
from nccltune.metrics import FILENAME, MetricsState, render, write_metrics


def parse(text: str) -> dict[str, Any]:
    """Families by name; the parser raises on anything Prometheus would refuse."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def full_state() -> MetricsState:
    return MetricsState(
        fingerprint="f655b0b8afa0e83c", gpus=2, driver_version="580.159.04", nccl_version="2.21.5", demo=False,
        degraded=False, last_sweep_ts=1_790_000_000.5, last_sweep_duration_s=812.25, last_sweep_success=True,
        published_generation=4, busbw={(4096, "default"): 0.5, (4096, "published"): 0.75,
                                       (1 << 30, "default"): 340.0, (1 << 30, "published"): 351.5},
        last_verify_ts=1_790_000_900.0, last_verify_success=False, verify_drift={1 << 30: -0.125},
        doctor={"error": 1, "warning": 2}, sweeps_total=3, topology_changes_total=1)


def test_an_empty_state_renders_what_is_always_known() -> None:
    fams = parse(render(MetricsState()))
    assert set(fams) == {"nccltune_build_info", "nccltune_topology_info", "nccltune_degraded",
                         "nccltune_doctor_findings", "nccltune_sweeps", "nccltune_topology_changes"}
    s = samples(render(MetricsState()))
    assert [(x.labels, x.value) for x in s["nccltune_build_info"]] == [({"version": __version__}, 1.0)]
    assert [x.value for x in s["nccltune_degraded"]] == [0.0]
    assert [x.value for x in s["nccltune_sweeps_total"]] == [0.0]


def test_every_name_has_the_prefix_help_and_type() -> None:
    text = render(full_state())
    fams = parse(text)
    for name, fam in fams.items():
        assert name.startswith("nccltune_"), name
        assert fam.documentation, name
        assert fam.type in ("gauge", "counter"), (name, fam.type)
    # One HELP and one TYPE line per family, each before its samples.
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert helps == types and len(set(helps)) == len(helps)
    assert fams["nccltune_sweeps"].type == "counter" and fams["nccltune_topology_changes"].type == "counter"
    assert text.endswith("\n")


def test_values_are_in_base_units() -> None:
    s = samples(render(full_state()))
    busbw = {(x.labels["size_bytes"], x.labels["setting"]): x.value for x in s["nccltune_busbw_bytes_per_second"]}
    # GB/s from the sweep become bytes per second; sizes are labelled in bytes.
    assert busbw == {("4096", "default"): 0.5e9, ("4096", "published"): 0.75e9,
                     (str(1 << 30), "default"): 340e9, (str(1 << 30), "published"): 351.5e9}
    ratios = {x.labels["size_bytes"]: x.value for x in s["nccltune_tuned_ratio"]}
    assert ratios == {"4096": 1.5, str(1 << 30): pytest.approx(351.5 / 340.0)}
    assert [x.value for x in s["nccltune_last_sweep_duration_seconds"]] == [812.25]
    assert [x.value for x in s["nccltune_last_sweep_timestamp_seconds"]] == [1_790_000_000.5]
    assert [x.value for x in s["nccltune_last_sweep_success"]] == [1.0]
    assert [x.value for x in s["nccltune_last_verify_success"]] == [0.0]
    assert [(x.labels, x.value) for x in s["nccltune_verify_drift_ratio"]] == [({"size_bytes": str(1 << 30)}, -0.125)]
    assert [x.value for x in s["nccltune_published_generation"]] == [4.0]
    doctor = {x.labels["severity"]: x.value for x in s["nccltune_doctor_findings"]}
    assert doctor == {"error": 1.0, "warning": 2.0, "info": 0.0}
    info = s["nccltune_topology_info"][0]
    assert info.labels == {"fingerprint": "f655b0b8afa0e83c", "gpus": "2", "driver_version": "580.159.04",
                           "nccl_version": "2.21.5", "demo": "0"}


@pytest.mark.parametrize("value", ['quote " inside', "new\nline", "back\\slash", 'all: \\"\n\\n', "ünïcode"])
def test_label_values_are_escaped(value: str) -> None:
    text = render(MetricsState(fingerprint=value, driver_version=value))
    # Every sample stays on one line.
    assert len([line for line in text.splitlines() if line.startswith("nccltune_topology_info")]) == 1
    info = samples(text)["nccltune_topology_info"][0]
    assert info.labels["fingerprint"] == value
    assert info.labels["driver_version"] == value


def test_a_missing_sweep_or_verify_leaves_their_gauges_out() -> None:
    state = full_state()
    state.last_sweep_success = None
    state.last_verify_ts = None
    state.busbw = {}
    s = samples(render(state))
    assert "nccltune_last_sweep_success" not in s
    assert "nccltune_last_verify_timestamp_seconds" not in s
    assert "nccltune_busbw_bytes_per_second" not in s and "nccltune_tuned_ratio" not in s


def test_non_finite_values_are_written_as_the_text_format_spells_them() -> None:
    state = MetricsState(last_sweep_duration_s=math.inf, verify_drift={4096: -math.inf, 8192: math.nan})
    text = render(state)
    assert "nccltune_last_sweep_duration_seconds +Inf" in text
    assert 'nccltune_verify_drift_ratio{size_bytes="4096"} -Inf' in text
    assert 'nccltune_verify_drift_ratio{size_bytes="8192"} NaN' in text
    s = samples(text)
    assert s["nccltune_last_sweep_duration_seconds"][0].value == math.inf
    assert math.isnan(s["nccltune_verify_drift_ratio"][1].value)


def test_write_metrics_replaces_the_file_atomically(tmp_path: Path) -> None:
    directory = tmp_path / "textfile"
    path = write_metrics(directory, MetricsState(sweeps_total=1))
    assert path == directory / FILENAME
    assert path.read_text() == render(MetricsState(sweeps_total=1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    inode = path.stat().st_ino
    reader = open(path, "rb")  # noqa: SIM115 - held open across the rewrite on purpose
    try:
        write_metrics(directory, MetricsState(sweeps_total=2))
        # A reader that had the old file open still reads a complete old file: the new one was
        # renamed over it, not written into it.
        assert reader.read().decode() == render(MetricsState(sweeps_total=1))
    finally:
        reader.close()
    assert path.stat().st_ino != inode
    assert path.read_text() == render(MetricsState(sweeps_total=2))
    # Nothing else is left where node_exporter globs *.prom, and no temp file at all.
    assert sorted(os.listdir(directory)) == [FILENAME]
