"""The node_exporter textfile: parsed the way Prometheus parses it, written atomically, built from the
stored history (so a restart or a one-shot command writes the same series)."""

from __future__ import annotations

import logging
import math
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from publishing import publish_set

from nccltune import __version__
from nccltune.errors import InputError
from nccltune.metrics import (
    DAEMON_FILENAME,
    DAEMON_STATES,
    FILENAME,
    PROFILE_STATES,
    LiveState,
    PublishedInfo,
    Snapshot,
    env_digest,
    render,
    write_metrics_from_store,
    write_snapshot,
)
from nccltune.publish import Provenance
from nccltune.records import Measurement, ReportRow
from nccltune.store import Store


def parse(text: str) -> dict[str, Any]:
    """Families by name; the parser raises on anything Prometheus would refuse."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def exposition(snap: Snapshot) -> str:
    """Both files of a snapshot, the history's and the daemon's, as one text."""
    return render(snap) + render(snap, daemon=True)


def full_state() -> Snapshot:
    c = "all_reduce"
    return Snapshot(
        fingerprint="f655b0b8afa0e83c", gpus=2, driver_version="580.159.04", nccl_version="2.21.5",
        degraded=False, last_sweep_ts=1_790_000_000.5, last_sweep_duration_s=812.25, last_sweep_success=True,
        last_successful_sweep_ts=1_790_000_000.5, sweeps_total=3,
        published=PublishedInfo(generation=4, demo=False, state="tuned", decision="node", env_digest="0123456789abcdef",
                                profile_generation=""),
        busbw_gbps={(c, 4096, "default"): 0.5, (c, 4096, "published"): 0.75,
                    (c, 1 << 30, "default"): 340.0, (c, 1 << 30, "published"): 351.5},
        tuned_ratio={(c, 4096): 1.5, (c, 1 << 30): 351.5 / 340.0},
        last_verify_ts=1_790_000_900.0, last_verify_success=False, verify_drift_ratio={(c, 1 << 30): -0.125},
        doctor={"error": 1, "warning": 2}, topology_changes_total=1,
        live=LiveState(state="idle", busy_processes=0, heartbeat_ts=1_790_000_950.0))


def test_an_empty_state_renders_what_is_always_known() -> None:
    # A daemon that has not swept yet.
    empty = Snapshot(doctor={}, topology_changes_total=0, live=LiveState(state="idle", busy_processes=0,
                                                                         heartbeat_ts=1.0))
    assert set(parse(render(empty))) == {"nccltune_build_info", "nccltune_topology_info", "nccltune_sweeps"}
    assert set(parse(render(empty, daemon=True))) == {
        "nccltune_degraded", "nccltune_doctor_findings", "nccltune_topology_changes", "nccltune_daemon_state",
        "nccltune_busy_compute_processes", "nccltune_heartbeat_timestamp_seconds"}
    s = samples(exposition(empty))
    assert [(x.labels, x.value) for x in s["nccltune_build_info"]] == [({"version": __version__}, 1.0)]
    assert [x.value for x in s["nccltune_degraded"]] == [0.0]
    assert [x.value for x in s["nccltune_sweeps_total"]] == [0.0]


def test_the_two_files_share_no_series_name() -> None:
    """node_exporter's textfile collector refuses a series that two files of its directory carry."""
    history, daemon = parse(render(full_state())), parse(render(full_state(), daemon=True))
    assert history and daemon and set(history).isdisjoint(daemon)
    # Without a daemon's live state there is no daemon file to write.
    assert render(Snapshot(doctor={}, topology_changes_total=0), daemon=True) == ""


def test_every_name_has_the_prefix_help_and_type() -> None:
    text = exposition(full_state())
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
    s = samples(exposition(full_state()))
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
    assert [(x.labels, x.value) for x in s["nccltune_verify_drift_ratio"]] == [
        ({"collective": "all_reduce", "size_bytes": str(1 << 30)}, -0.125)]
    assert [x.value for x in s["nccltune_published_generation"]] == [4.0]
    doctor = {x.labels["severity"]: x.value for x in s["nccltune_doctor_findings"]}
    assert doctor == {"error": 1.0, "warning": 2.0, "info": 0.0}
    info = s["nccltune_topology_info"][0]
    assert info.labels == {"fingerprint": "f655b0b8afa0e83c", "gpus": "2", "driver_version": "580.159.04",
                           "nccl_version": "2.21.5", "demo": "0"}


@pytest.mark.parametrize("value", ['quote " inside', "new\nline", "back\\slash", 'all: \\"\n\\n', "ünïcode"])
def test_label_values_are_escaped(value: str) -> None:
    text = render(Snapshot(fingerprint=value, driver_version=value))
    # Every sample stays on one line.
    assert len([line for line in text.splitlines() if line.startswith("nccltune_topology_info")]) == 1
    info = samples(text)["nccltune_topology_info"][0]
    assert info.labels["fingerprint"] == value
    assert info.labels["driver_version"] == value


def test_a_missing_sweep_or_verify_leaves_their_gauges_out() -> None:
    state = full_state()
    state.last_sweep_success = None
    state.last_verify_ts = None
    state.busbw_gbps = {}
    state.tuned_ratio = {}
    s = samples(render(state))
    assert "nccltune_last_sweep_success" not in s
    assert "nccltune_last_verify_timestamp_seconds" not in s
    assert "nccltune_busbw_bytes_per_second" not in s and "nccltune_tuned_ratio" not in s


def test_non_finite_values_are_written_as_the_text_format_spells_them() -> None:
    state = Snapshot(last_sweep_duration_s=math.inf,
                     verify_drift_ratio={("all_reduce", 4096): -math.inf, ("all_reduce", 8192): math.nan})
    text = render(state)
    assert 'nccltune_last_sweep_duration_seconds +Inf' in text
    assert 'nccltune_verify_drift_ratio{collective="all_reduce",size_bytes="4096"} -Inf' in text
    assert 'nccltune_verify_drift_ratio{collective="all_reduce",size_bytes="8192"} NaN' in text
    s = samples(text)
    assert s["nccltune_last_sweep_duration_seconds"][0].value == math.inf
    assert math.isnan(s["nccltune_verify_drift_ratio"][1].value)


def test_the_file_is_replaced_atomically(tmp_path: Path) -> None:
    directory = tmp_path / "textfile"
    path = write_snapshot(directory, Snapshot(sweeps_total=1))
    assert path == directory / FILENAME
    assert path.read_text() == render(Snapshot(sweeps_total=1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    inode = path.stat().st_ino
    reader = open(path, "rb")  # noqa: SIM115 - held open across the rewrite on purpose
    try:
        write_snapshot(directory, Snapshot(sweeps_total=2))
        # A reader that had the old file open still reads a complete old file: the new one was
        # renamed over it, not written into it.
        assert reader.read().decode() == render(Snapshot(sweeps_total=1))
    finally:
        reader.close()
    assert path.stat().st_ino != inode
    assert path.read_text() == render(Snapshot(sweeps_total=2))
    # Nothing else is left where node_exporter globs *.prom, and no temp file at all.
    assert sorted(os.listdir(directory)) == [FILENAME]


# -- from the stored history ------------------------------------------------------------------------

FP = "f655b0b8afa0e83c"
T0 = datetime(2026, 11, 30, 8, 0, tzinfo=timezone.utc)


class Clock:
    """The store's clock, moved by hand: run times (and so the series) are known to the second."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


RUN_META: dict[str, Any] = dict(backend="nccl", demo=False, profile="training", nccl_version=None,
                                driver_version="580.159.04", torch_version=None, nccltune_version=__version__,
                                hostname="node1", config={})
ROWS = [
    # 0.535 GB/s is the value whose product with 1e9 is 535000000.00000006 in binary floating point.
    {"size_bytes": 4096, "default_busbw_gbps": 0.535, "default_noise_pct": 2.35, "tuned_busbw_gbps": 0.75,
     "ratio": 1.4019},
    {"size_bytes": 1 << 30, "default_busbw_gbps": 340.0, "default_noise_pct": 0.5, "tuned_busbw_gbps": 351.5,
     "ratio": 1.0338},
]


def add_sweep(store: Store, clock: Clock, *, status: str = "ok", wall_s: float = 812.0, fingerprint: str = FP,
              demo: bool = False, generation: int | None = 4) -> int:
    run_id = store.start_run(kind="sweep", fingerprint=fingerprint, topology={"source": "nvml", "gpus": 2},
                             **{**RUN_META, "demo": demo})
    store.add_trial(run_id, seq=1, phase="baseline", label="defaults", env={}, status="ok",
                    measurements=[Measurement(r["size_bytes"], 10.0, r["default_busbw_gbps"],
                                              r["default_busbw_gbps"]) for r in ROWS])
    clock.advance(wall_s)
    if status == "ok":
        store.finish_run(run_id, status="ok", chosen_env={"NCCL_ALGO": "Ring"}, published_generation=generation,
                         summary={"chosen": "NCCL_ALGO=Ring", "nccl_version": "2.21.5"},
                         rows=[ReportRow.from_dict(r) for r in ROWS])
    else:
        store.finish_run(run_id, status="failed", summary={"error": "a trial crashed", "trials": 1})
    return run_id


def add_verify(store: Store, clock: Clock, *, passed: bool) -> int:
    run_id = store.start_run(kind="verify", fingerprint=FP, topology={"source": "nvml"}, **RUN_META)
    clock.advance(40)
    drift = -1.5 if passed else -30.0
    store.finish_run(run_id, status="ok" if passed else "failed", summary={
        "passed": passed, "rows": [{"size_bytes": 1 << 30, "measured_gbps": 340.0 * (1 + drift / 100),
                                    "expected_gbps": 340.0, "allowed_pct": 10.0, "drift_pct": drift, "ok": passed}]})
    return run_id


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[Store]:
    with Store(tmp_path / "history.db", clock=clock) as s:
        yield s


def write(tmp_path: Path, store: Store, **kwargs: Any) -> str:
    kwargs.setdefault("fingerprint", FP)
    path = write_metrics_from_store(tmp_path / "textfile", store, **kwargs)
    assert path == tmp_path / "textfile" / FILENAME
    if kwargs.get("live") is None:
        return path.read_text()
    return path.read_text() + (tmp_path / "textfile" / DAEMON_FILENAME).read_text()


def values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(x.labels.items())): x.value for x in samples(text).get(name, [])}


def test_the_failures_in_a_row_are_this_nodes_finished_verifies_since_its_last_pass(
        tmp_path: Path, store: Store, clock: Clock) -> None:
    add_sweep(store, clock)
    for passed in (False, True, False, False):
        add_verify(store, clock, passed=passed)
    other = store.start_run(kind="verify", fingerprint="another-node", topology={}, **RUN_META)
    store.finish_run(other, status="ok", summary={"passed": True})
    store.start_run(kind="verify", fingerprint=FP, topology={}, **RUN_META)  # still running
    assert list(values(write(tmp_path, store), "nccltune_verify_consecutive_failures").values()) == [2.0]
    add_verify(store, clock, passed=True)
    assert list(values(write(tmp_path, store), "nccltune_verify_consecutive_failures").values()) == [0.0]


def test_every_series_comes_from_the_history(tmp_path: Path, store: Store, clock: Clock) -> None:
    add_sweep(store, clock, wall_s=812.0)
    sweep_end = clock.now.timestamp()
    add_verify(store, clock, passed=False)
    text = write(tmp_path, store, node_class="c0ffee")
    parse(text)  # Prometheus' parser accepts it
    one = (("class", "c0ffee"),)
    assert values(text, "nccltune_last_sweep_timestamp_seconds") == {one: sweep_end}
    assert values(text, "nccltune_last_successful_sweep_timestamp_seconds") == {one: sweep_end}
    assert values(text, "nccltune_last_sweep_duration_seconds") == {one: 812.0}
    assert values(text, "nccltune_last_sweep_success") == {one: 1.0}
    assert values(text, "nccltune_sweeps_total") == {one: 1.0}
    # Without a publish directory the generation and the demo flag are the latest ok sweep's.
    assert values(text, "nccltune_published_generation") == {one: 4.0}
    assert values(text, "nccltune_published_demo") == {one: 0.0}
    busbw = {(dict(k)["size_bytes"], dict(k)["setting"], dict(k)["collective"], dict(k)["class"]): v
             for k, v in values(text, "nccltune_busbw_bytes_per_second").items()}
    assert busbw == {("4096", "default", "all_reduce", "c0ffee"): 535e6,
                     ("4096", "published", "all_reduce", "c0ffee"): 750e6,
                     (str(1 << 30), "default", "all_reduce", "c0ffee"): 340e9,
                     (str(1 << 30), "published", "all_reduce", "c0ffee"): 351.5e9}
    assert "535000000.0000" not in text and "00000006" not in text
    noise = {dict(k)["size_bytes"]: v for k, v in values(text, "nccltune_busbw_noise_ratio").items()}
    assert noise == {"4096": 0.0235, str(1 << 30): 0.005}
    assert {dict(k)["size_bytes"]: v for k, v in values(text, "nccltune_tuned_ratio").items()} == {
        "4096": 1.4019, str(1 << 30): 1.0338}
    assert values(text, "nccltune_last_verify_success") == {one: 0.0}
    assert values(text, "nccltune_last_verify_timestamp_seconds") == {one: clock.now.timestamp()}
    drift = {dict(k)["size_bytes"]: v for k, v in values(text, "nccltune_verify_drift_ratio").items()}
    allowed = {dict(k)["size_bytes"]: v for k, v in values(text, "nccltune_verify_allowed_drift_ratio").items()}
    assert drift == {str(1 << 30): -0.3} and allowed == {str(1 << 30): 0.1}
    info = samples(text)["nccltune_topology_info"][0].labels
    assert info == {"class": "c0ffee", "fingerprint": FP, "gpus": "2", "driver_version": "580.159.04",
                    "nccl_version": "2.21.5", "demo": "0"}
    published = samples(text)["nccltune_published_info"][0].labels
    assert published == {"class": "c0ffee", "state": "tuned", "decision": "node",
                         "env_digest": env_digest({"NCCL_ALGO": "Ring"}), "profile_generation": ""}
    # Only a running daemon knows these.
    for name in ("nccltune_daemon_state", "nccltune_heartbeat_timestamp_seconds", "nccltune_busy_compute_processes"):
        assert name not in samples(text)
    # Every series carries the class, for the fleet rules.
    assert all(x.labels.get("class") == "c0ffee" for xs in samples(text).values() for x in xs)


def test_a_restart_writes_the_same_series_as_before_it(tmp_path: Path, store: Store, clock: Clock) -> None:
    add_sweep(store, clock)
    add_verify(store, clock, passed=True)
    live = LiveState(state="idle", busy_processes=0, heartbeat_ts=1_790_000_000.0, doctor={"warning": 1},
                     topology_changes_total=2)
    before = samples(write(tmp_path, store, live=live))
    # A new process: a new Store object over the same file, nothing remembered.
    with Store(store.path) as again:
        after = samples(write(tmp_path, again))
    live_only = {"nccltune_daemon_state", "nccltune_busy_compute_processes", "nccltune_heartbeat_timestamp_seconds",
                 "nccltune_doctor_findings", "nccltune_topology_changes_total", "nccltune_degraded"}
    assert live_only <= set(before)
    assert set(after) == set(before) - live_only
    for name in after:
        assert [(x.labels, x.value) for x in after[name]] == [(x.labels, x.value) for x in before[name]], name


def test_a_failed_sweep_keeps_the_last_published_numbers(tmp_path: Path, store: Store, clock: Clock) -> None:
    add_sweep(store, clock)
    ok_end = clock.now.timestamp()
    clock.advance(3600)
    add_sweep(store, clock, status="failed", wall_s=30.0)
    text = write(tmp_path, store)
    assert values(text, "nccltune_last_sweep_success") == {(): 0.0}
    assert values(text, "nccltune_last_sweep_timestamp_seconds") == {(): clock.now.timestamp()}
    assert values(text, "nccltune_last_sweep_duration_seconds") == {(): 30.0}
    assert values(text, "nccltune_last_successful_sweep_timestamp_seconds") == {(): ok_end}
    assert values(text, "nccltune_sweeps_total") == {(): 2.0}
    assert len(samples(text)["nccltune_busbw_bytes_per_second"]) == 4


def test_runs_of_another_topology_are_not_this_nodes_last_sweep(tmp_path: Path, store: Store, clock: Clock) -> None:
    add_sweep(store, clock, fingerprint="0000000000000000")
    text = write(tmp_path, store)
    for name in ("nccltune_last_sweep_timestamp_seconds", "nccltune_last_sweep_success",
                 "nccltune_busbw_bytes_per_second", "nccltune_published_generation"):
        assert name not in samples(text), name
    assert values(text, "nccltune_sweeps_total") == {(): 1.0}  # the history's count


def test_an_empty_history_writes_what_is_always_known(tmp_path: Path, store: Store) -> None:
    text = write(tmp_path, store)
    assert set(parse(text)) == {"nccltune_build_info", "nccltune_topology_info", "nccltune_sweeps"}
    # No class known: no class label (Prometheus would drop an empty one anyway).
    assert not any("class" in x.labels for xs in samples(text).values() for x in xs)


def test_the_published_files_win_over_the_history(tmp_path: Path, store: Store, clock: Clock) -> None:
    add_sweep(store, clock, generation=4)
    prov = Provenance(nccltune_version=__version__, created_at="2026-11-30T09:00:00+00:00", topology_fingerprint=FP,
                      nccl_version="2.21.5", backend="gloo", demo=True, profile=None, state="safe")
    publish_dir = tmp_path / "published"
    for _ in range(2):
        publish_set(publish_dir, {"NCCL_TOPO_FILE": "/var/lib/nccltune/ncclTopology.xml"}, prov)
    text = write(tmp_path, store, publish_dir=publish_dir)
    assert values(text, "nccltune_published_generation") == {(): 2.0}
    assert values(text, "nccltune_published_demo") == {(): 1.0}
    info = samples(text)["nccltune_published_info"][0].labels
    assert info["state"] == "safe" and info["decision"] == "node"
    assert info["env_digest"] == env_digest({"NCCL_TOPO_FILE": "/var/lib/nccltune/ncclTopology.xml"})


def test_a_corrupt_published_file_falls_back_to_the_history(tmp_path: Path, store: Store, clock: Clock,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    add_sweep(store, clock, generation=7)
    publish_dir = tmp_path / "published"
    publish_dir.mkdir()
    (publish_dir / "nccl.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="nccltune.metrics"):
        text = write(tmp_path, store, publish_dir=publish_dir)
    assert values(text, "nccltune_published_generation") == {(): 7.0}
    assert "cannot be read" in caplog.text and "nccl.json" in caplog.text


def test_live_values_of_a_daemon(tmp_path: Path, store: Store) -> None:
    live = LiveState(state="sweeping", busy_processes=3, heartbeat_ts=1_790_000_123.5, degraded=True,
                     doctor={"error": 2}, gpus=8, driver_version="580.1", nccl_version="2.23.4",
                     topology_changes_total=1)
    text = write(tmp_path, store, live=live)
    states = {dict(k)["state"]: v for k, v in values(text, "nccltune_daemon_state").items()}
    assert states == {s: (1.0 if s == "sweeping" else 0.0) for s in DAEMON_STATES}
    assert values(text, "nccltune_busy_compute_processes") == {(): 3.0}
    assert values(text, "nccltune_heartbeat_timestamp_seconds") == {(): 1_790_000_123.5}
    assert values(text, "nccltune_degraded") == {(): 1.0}
    assert values(text, "nccltune_topology_changes_total") == {(): 1.0}
    doctor = {dict(k)["severity"]: v for k, v in values(text, "nccltune_doctor_findings").items()}
    assert doctor == {"error": 2.0, "warning": 0.0, "info": 0.0}
    info = samples(text)["nccltune_topology_info"][0].labels
    assert (info["gpus"], info["driver_version"], info["nccl_version"]) == ("8", "580.1", "2.23.4")


def test_what_a_daemon_once_kept_in_memory_comes_from_the_history(tmp_path: Path, store: Store,
                                                                   clock: Clock) -> None:
    """The series the daemon used to fill from its own memory (bus bandwidth, ratios, generation,
    demo flag, verify drift, sweep count) are the history's; doctor's counts come live."""
    add_sweep(store, clock, demo=True, generation=4)
    sweep_end = clock.now.timestamp()
    add_verify(store, clock, passed=False)
    live = LiveState(state="idle", busy_processes=0, heartbeat_ts=1_790_000_000.0, doctor={"error": 1})
    s = samples(write(tmp_path, store, live=live))
    assert {(x.labels["size_bytes"], x.labels["setting"]): x.value for x in s["nccltune_busbw_bytes_per_second"]} == {
        ("4096", "default"): 535e6, ("4096", "published"): 750e6,
        (str(1 << 30), "default"): 340e9, (str(1 << 30), "published"): 351.5e9}
    assert {x.labels["size_bytes"]: x.value for x in s["nccltune_tuned_ratio"]} == {"4096": 1.4019,
                                                                                  str(1 << 30): 1.0338}
    assert [x.value for x in s["nccltune_published_generation"]] == [4.0]
    assert [x.value for x in s["nccltune_published_demo"]] == [1.0]
    assert [x.value for x in s["nccltune_last_successful_sweep_timestamp_seconds"]] == [sweep_end]
    assert [x.value for x in s["nccltune_verify_drift_ratio"]] == [-0.3]
    assert [x.value for x in s["nccltune_sweeps_total"]] == [1.0]
    assert {x.labels["severity"]: x.value for x in s["nccltune_doctor_findings"]} == {
        "error": 1.0, "warning": 0.0, "info": 0.0}


def add_class_verify(store: Store, clock: Clock, *, below: bool) -> int:
    """A verify that compared the node with its class (a class profile in force)."""
    run_id = store.start_run(kind="verify", fingerprint=FP, topology={"source": "nvml"}, **RUN_META)
    clock.advance(40)
    measured = 300.0 if below else 338.0
    store.finish_run(run_id, status="failed" if below else "ok", summary={
        "passed": not below, "code": "below_class" if below else "passed", "reference": "class",
        "class_profile": {"file": "c0ffee.json", "sha256": "ab" * 32, "class_id": "c0ffee", "nodes": 3},
        "rows": [{"size_bytes": 1 << 30, "collective": "all_reduce", "measured_gbps": measured,
                  "expected_gbps": 340.0, "allowed_pct": 5.0, "drift_pct": 100.0 * (measured / 340.0 - 1),
                  "ok": not below}]})
    return run_id


def test_a_verify_against_the_class_writes_the_ratio_and_the_outlier_flag(tmp_path: Path, store: Store,
                                                                           clock: Clock) -> None:
    add_sweep(store, clock)
    add_verify(store, clock, passed=True)
    assert "nccltune_class_outlier" not in samples(write(tmp_path, store))  # a node-local verify: no class
    add_class_verify(store, clock, below=True)
    text = write(tmp_path, store, node_class="c0ffee")
    one = (("class", "c0ffee"),)
    assert values(text, "nccltune_class_outlier") == {one: 1.0}
    ratio = values(text, "nccltune_class_ratio")
    assert ratio == {(("class", "c0ffee"), ("collective", "all_reduce"), ("size_bytes", str(1 << 30))):
                     round(300.0 / 340.0, 6)}
    add_class_verify(store, clock, below=False)
    assert values(write(tmp_path, store), "nccltune_class_outlier") == {(): 0.0}


def test_a_class_profile_in_force_is_the_published_decision(tmp_path: Path, store: Store, clock: Clock) -> None:
    add_sweep(store, clock)
    prov = Provenance(nccltune_version=__version__, created_at="2026-11-30T09:00:00+00:00", topology_fingerprint=FP,
                      nccl_version="2.21.5", backend="nccl", demo=False, profile="balanced",
                      class_profile={"file": "c0ffee.json", "sha256": "0123456789abcdef" * 4, "class_id": "c0ffee",
                                     "nodes": 3})
    publish_set(tmp_path / "published", {"NCCL_ALGO": "Ring"}, prov)
    info = samples(write(tmp_path, store, publish_dir=tmp_path / "published"))["nccltune_published_info"][0].labels
    assert info["decision"] == "class" and info["profile_generation"] == "0123456789abcdef"


def test_the_class_profile_a_daemon_watches(tmp_path: Path, store: Store) -> None:
    refused = LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0, profile_state="refused",
                        profile_refused="stale")
    text = write(tmp_path, store, live=refused)
    states = {dict(k)["state"]: v for k, v in values(text, "nccltune_profile_state").items()}
    assert states == {s: (1.0 if s == "refused" else 0.0) for s in PROFILE_STATES}
    assert values(text, "nccltune_profile_refused_info") == {(("reason", "stale"),): 1.0}
    applied = LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0, profile_state="in_force")
    text = write(tmp_path, store, live=applied)
    assert values(text, "nccltune_profile_state")[(("state", "in_force"),)] == 1.0
    assert "nccltune_profile_refused_info" not in samples(text)
    # Without profile.path the daemon says nothing of profiles.
    text = write(tmp_path, store, live=LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0))
    assert "nccltune_profile_state" not in samples(text)
    with pytest.raises(ValueError, match="in_force"):
        LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0, profile_state="applied")


def test_a_one_shot_command_never_hides_the_daemons_series(tmp_path: Path, store: Store, clock: Clock) -> None:
    """The daemon writes both files; a `nccltune verify` after it (a Slurm prolog) rewrites the
    history's file only: the daemon's refused profile, heartbeat and doctor counts stay as they were."""
    live = LiveState(state="idle", busy_processes=0, heartbeat_ts=1_790_000_000.0, doctor={"error": 1},
                     degraded=True, profile_state="refused", profile_refused="other_class")
    write(tmp_path, store, live=live)
    daemon_file = tmp_path / "textfile" / DAEMON_FILENAME
    before = daemon_file.read_text()
    assert stat.S_IMODE(daemon_file.stat().st_mode) == 0o644
    add_verify(store, clock, passed=True)
    text = write(tmp_path, store)  # the one-shot command: no live state
    assert values(text, "nccltune_last_verify_success") == {(): 1.0}
    assert daemon_file.read_text() == before
    kept = samples(before)
    assert [x.labels["reason"] for x in kept["nccltune_profile_refused_info"]] == ["other_class"]
    assert [x.value for x in kept["nccltune_degraded"]] == [1.0]
    assert sorted(os.listdir(tmp_path / "textfile")) == [DAEMON_FILENAME, FILENAME]


def test_an_unknown_daemon_state_is_refused() -> None:
    with pytest.raises(ValueError, match="idle"):
        LiveState(state="napping", busy_processes=0, heartbeat_ts=0.0)


def test_the_file_is_readable_by_node_exporter_whatever_the_umask(tmp_path: Path, store: Store) -> None:
    old = os.umask(0o077)
    try:
        write(tmp_path, store)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "textfile" / FILENAME).stat().st_mode) == 0o644
    assert sorted(os.listdir(tmp_path / "textfile")) == [FILENAME]


def test_a_directory_another_user_can_write_is_refused(tmp_path: Path, store: Store) -> None:
    directory = tmp_path / "textfile"
    directory.mkdir()
    directory.chmod(0o1777)  # like /tmp: anyone could plant nccltune.prom.<pid>.<thread> as a link
    with pytest.raises(InputError, match=r"refusing the metrics directory: it is world-writable \(mode 1777") as caught:
        write_metrics_from_store(directory, store, fingerprint=FP)
    assert str(directory) in str(caught.value)
    assert os.listdir(directory) == []


# -- one-shot commands write it too ------------------------------------------------------------------


def test_one_shot_sweep_and_verify_write_the_textfile(tmp_path_factory: pytest.TempPathFactory,
                                                      tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from demo_state import BASE_CONFIG, SNAPSHOT, clean_env, copy_state, seeded_state

    state = tmp_path / "state"
    copy_state(seeded_state(tmp_path_factory), state)
    # The seeded state comes from `nccltune sweep` with publish.metrics_dir set.
    after_sweep = (state / "metrics" / FILENAME).read_text()
    s = samples(after_sweep)
    assert [x.value for x in s["nccltune_last_sweep_success"]] == [1.0]
    assert [x.value for x in s["nccltune_published_demo"]] == [1.0]
    assert s["nccltune_busbw_bytes_per_second"] and s["nccltune_published_generation"]
    assert "nccltune_last_verify_success" not in s
    # Every series carries the node's class as `nccltune topo` shows it (a CPU demo: no NCCL version).
    from nccltune.topology.model import from_snapshot
    from nccltune.topology.nodeclass import node_class
    from nccltune.topology.snapshot import load_snapshot

    cls = node_class(from_snapshot(load_snapshot(SNAPSHOT))).id
    assert {x.labels.get("class") for xs in s.values() for x in xs} == {cls}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(BASE_CONFIG, sort_keys=False))
    got = subprocess.run([sys.executable, "-m", "nccltune", "verify", "--demo", str(SNAPSHOT), "--config", str(config),
                          "--state-dir", str(state), "--floor", "0.000001"],
                         capture_output=True, text=True, env=clean_env(), timeout=180)
    assert got.returncode == 0, got.stderr
    after_verify = samples((state / "metrics" / FILENAME).read_text())
    assert [x.value for x in after_verify["nccltune_last_verify_success"]] == [1.0]
    assert {x.labels.get("class") for xs in after_verify.values() for x in xs} == {cls}
    # The sweep's series are still there: the file is rebuilt from the history, not from the verify alone.
    for name in ("nccltune_last_sweep_success", "nccltune_busbw_bytes_per_second", "nccltune_published_generation"):
        assert [(x.labels, x.value) for x in after_verify[name]] == [(x.labels, x.value) for x in s[name]], name


def test_the_safe_part_after_an_upgrade_and_the_canarys_verdict(tmp_path: Path, store: Store) -> None:
    canary = LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0, profile_state="safe_part",
                       upgrade_role="canary", upgrade_outcome="keep")
    text = write(tmp_path, store, live=canary)
    assert values(text, "nccltune_profile_state")[(("state", "safe_part"),)] == 1.0
    assert values(text, "nccltune_upgrade_safe_part_info") == {(("role", "canary"),): 1.0}
    assert values(text, "nccltune_upgrade_canary_outcome") == {(("outcome", "keep"),): 1.0,
                                                               (("outcome", "safe"),): 0.0}
    member = LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0, profile_state="safe_part",
                       upgrade_role="member")
    text = write(tmp_path, store, live=member)
    assert values(text, "nccltune_upgrade_safe_part_info") == {(("role", "member"),): 1.0}
    assert "nccltune_upgrade_canary_outcome" not in samples(text)
    with pytest.raises(ValueError, match="upgrade_role"):
        LiveState(state="idle", busy_processes=0, heartbeat_ts=1.0, upgrade_role="leader")
