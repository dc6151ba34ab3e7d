"""The daemon's service loop, in this process: a Daemon over the demo snapshot with its clocks,
node loader and NCCL probe injected, stepped through start, poll, act and reload."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from daemon_harness import PUBLISHED, RETUNE, FakeClock, Harness, config_text, published_bytes
from demo_state import SHORT_CONFIG, copy_state, seeded_state

from nccltune.config import Config, with_overrides
from nccltune.daemon import DEMO_BUSY_FILE, Daemon, actions, scheduler
from nccltune.daemon.actions import Node
from nccltune.daemon.scheduler import Action
from nccltune.errors import BusyError


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return seeded_state(tmp_path_factory)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.close()


def may_sweep_now(d: Daemon) -> str | None:
    """None if a sweep may start now, else why not: the scheduler asked with the daemon's state and clocks."""
    blocked = scheduler.blocked(d.state, d.policy, d.now())
    return None if blocked is None else blocked[0]


def test_the_maintenance_window_is_read_from_the_injected_wall_clock(harness: Harness) -> None:
    noon, night = dt.datetime(2026, 3, 1, 12, 0), dt.datetime(2026, 3, 1, 23, 30)
    d = harness.daemon(wall=noon, **{"daemon.maintenance_window": "22:00-04:00"})
    assert may_sweep_now(d) == "outside the maintenance window 22:00-04:00"
    assert d.decide().sweep_pending == "nothing is published yet"
    d.wall_clock = lambda: night
    assert may_sweep_now(d) is None
    assert d.decide() == scheduler.Decision(Action.SWEEP, "nothing is published yet")
    d.wall_clock = lambda: dt.datetime(2026, 3, 2, 3, 59)
    assert may_sweep_now(d) is None
    d.wall_clock = lambda: dt.datetime(2026, 3, 2, 4, 0)
    assert may_sweep_now(d) is not None


def test_a_window_that_excludes_the_real_time(harness: Harness) -> None:
    d = harness.daemon()
    now = dt.datetime.now()
    start, end = now + dt.timedelta(hours=2), now + dt.timedelta(hours=3)
    d.cfg = with_overrides(d.cfg, **{"daemon.maintenance_window": f"{start:%H:%M}-{end:%H:%M}"})
    assert may_sweep_now(d) == f"outside the maintenance window {start:%H:%M}-{end:%H:%M}"
    d.cfg = with_overrides(d.cfg, **{"daemon.maintenance_window": None})
    assert may_sweep_now(d) is None


def test_polls_wait_for_the_quiet_period_after_the_gpus_were_busy(harness: Harness, tmp_path: Path) -> None:
    clock = FakeClock()
    d = harness.daemon(clock=clock, **{"daemon.quiet_period_s": 300})
    assert may_sweep_now(d) is None
    (tmp_path / "state" / DEMO_BUSY_FILE).touch()
    d.poll()
    assert may_sweep_now(d) == "GPUs in use"
    (tmp_path / "state" / DEMO_BUSY_FILE).unlink()
    clock.now += 10
    d.poll()
    assert may_sweep_now(d) == "GPUs busy within the last 300 s"
    assert d.decide().wait_s == 60.0
    clock.now += 289
    assert may_sweep_now(d) == "GPUs busy within the last 300 s"
    assert d.decide().wait_s == pytest.approx(1.0)  # the next poll comes when the quiet period ends
    clock.now += 1
    assert may_sweep_now(d) is None


def test_busy_gpus_refuse_a_sweep_without_a_quiet_period(harness: Harness, tmp_path: Path) -> None:
    d = harness.daemon()  # quiet_period_s: 0
    (tmp_path / "state" / DEMO_BUSY_FILE).touch()
    d.poll()
    assert may_sweep_now(d) == "GPUs in use"
    (tmp_path / "state" / DEMO_BUSY_FILE).unlink()
    d.poll()
    assert may_sweep_now(d) is None


def test_the_busy_check_during_trials_asks_only_for_the_gpus_users(harness: Harness, tmp_path: Path) -> None:
    clock = FakeClock()
    loads: list[int] = []

    def counting_loader(cfg: Config, demo: str | bool | None) -> Node:
        loads.append(1)
        return actions.read_node(cfg, demo)

    d = harness.daemon(clock=clock, node_loader=counting_loader)
    assert len(loads) == 1  # start-up
    clock.now += 5
    assert d.abort_check() is None
    (tmp_path / "state" / DEMO_BUSY_FILE).touch()
    clock.now += 1  # within ABORT_CHECK_EVERY_S of the last check: not asked again yet
    assert d.abort_check() is None
    clock.now += 1
    assert d.abort_check() == "a job started on the GPUs (pid 0)"
    assert d.state.busy and d.state.last_busy_s == clock.now
    assert len(loads) == 1  # the node was not read again
    d.stop_requested = True
    assert d.abort_check() == "the service is stopping"


def test_an_nvml_error_during_a_poll_degrades_and_keeps_the_published_files(harness: Harness, seeded: Path,
                                                                            tmp_path: Path) -> None:
    class NVMLError_GpuIsLost(Exception):  # as pynvml names it: not an NccltuneError
        pass

    lost = False

    def loader(cfg: Config, demo: str | bool | None) -> Node:
        if lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        return actions.read_node(cfg, demo)

    d = harness.daemon(seeded=seeded, node_loader=loader)
    state = tmp_path / "state"
    before = published_bytes(state)
    assert set(before) == set(PUBLISHED)
    d.state = scheduler.sweep_needed(d.state, "topology changed")
    lost = True
    d.poll()
    assert d.metrics.degraded
    assert d.status_text == "degraded: NVML error: GPU is lost"
    assert may_sweep_now(d) == "degraded"
    assert d.act().reason == "degraded"  # refused: nothing runs, nothing is published
    d.write_metrics()
    # The daemon's series carry the node's class.
    assert re.search(r'^nccltune_degraded\{class="[0-9a-f]{16}"\} 1\.0$',
                     (state / "metrics" / "nccltune-daemon.prom").read_text(), re.M)
    assert published_bytes(state) == before
    lost = False
    d.poll()
    assert not d.metrics.degraded
    assert d.status_text == "idle, sweep pending (topology changed)"


def test_a_reload_with_new_sweep_settings_schedules_a_sweep(harness: Harness, seeded: Path, tmp_path: Path) -> None:
    d = harness.daemon(seeded=seeded)
    assert d.state.sweep_pending is None
    assert d.status_text == "idle"
    (tmp_path / "config.yaml").write_text(config_text(daemon={"quiet_period_s": 0, "poll_interval_s": 30}))
    d.reload()
    assert d.cfg.daemon.poll_interval_s == 30 and d.state.sweep_pending is None
    assert d.policy.poll_interval_s == 30
    (tmp_path / "config.yaml").write_text(config_text(**RETUNE))
    d.reload()
    assert d.state.sweep_pending == "NCCL, nccltune or the sweep settings changed since the published tuning"
    assert d.status_text.startswith("idle, sweep pending")


def test_an_invalid_reload_keeps_the_old_config(harness: Harness, tmp_path: Path) -> None:
    d = harness.daemon()
    old = d.cfg
    (tmp_path / "config.yaml").write_text("daemon:\n  quiet_period_s: -1\n")
    d.reload()
    assert d.cfg is old


def test_a_corrupt_nccl_json_schedules_a_sweep_instead_of_stopping(harness: Harness, seeded: Path,
                                                                   tmp_path: Path) -> None:
    d = harness.daemon(seeded=seeded)
    assert d.state.sweep_pending is None
    (tmp_path / "state" / "nccl.json").write_text("{not json")
    actions.refresh_topology_file(d.cfg, d.watcher.node)
    d.check_published()
    assert d.state.sweep_pending == "the published files cannot be read"


def test_a_second_daemon_object_on_the_same_state_is_refused(harness: Harness) -> None:
    harness.daemon()
    with pytest.raises(BusyError, match="another daemon is running"):
        harness.daemon()


def test_the_daemons_start_removes_what_killed_writers_left(harness: Harness, seeded: Path, tmp_path: Path) -> None:
    """Temp files of writers killed mid-write (in the state directory, a run's, the generations,
    the metrics) are gone once the daemon has started; another program's file in the shared
    metrics directory stays, as does a temp of a writer that still runs."""
    import os

    from conftest import killed_writer

    state = tmp_path / "seeded"
    copy_state(seeded, state)
    left = killed_writer(state / "class-profile.json", state / "runs" / "00001" / "tuner-table.txt",
                         state / "generations" / "last", state / "metrics" / "nccltune-daemon.prom",
                         state / "metrics" / "node.prom")
    running = state / f".daemon.heartbeat.tmp-{os.getppid()}-cafebabe"
    running.write_text("{")
    harness.daemon(seeded=state)
    copy = tmp_path / "state"
    kept = [p.name for p in left if (copy / p.relative_to(state)).exists()]
    assert len(kept) == 1 and kept[0].startswith(".node.prom.tmp-")  # another program's file's
    assert (copy / running.name).exists()


def test_the_daemons_sweep_runs_the_upgrade_gate(harness: Harness, seeded: Path, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A sweep of the daemon's on a topology measured before under another torch: where the new
    sweep is slower beyond noise, the journal says so (compare.upgrade_gate, as after `nccltune sweep`)."""
    import logging
    import sqlite3

    state = tmp_path / "state"
    # Other sweep settings than the seeded tuning's, so it is stale and the daemon sweeps: the
    # shortest sweep, which measures NCCL's defaults as any sweep does.
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(SHORT_CONFIG, sort_keys=False))
    d = harness.daemon(seeded=seeded)
    # The seeded sweep becomes one of another torch, ten times as fast as anything gloo does here.
    with sqlite3.connect(state / "history.db") as db:
        db.execute("UPDATE runs SET torch_version = '1.0.0' WHERE kind = 'sweep'")
        db.execute("UPDATE measurements SET busbw_gbps = busbw_gbps * 10")
    db.close()
    assert d.state.sweep_pending is not None
    with caplog.at_level(logging.WARNING, logger="nccltune.compare"):
        d.sweep("test")
    gate = [r for r in caplog.records if r.name == "nccltune.compare" and "after the upgrade" in r.getMessage()]
    assert gate and all("slower than run 1" in r.getMessage() and "torch 1.0.0" in r.getMessage() for r in gate)
    d.write_metrics()
    assert "nccltune_upgrade_regression{" in (state / "metrics" / "nccltune.prom").read_text()


def test_memory_is_handed_back_after_work_and_only_then(harness: Harness, seeded: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from nccltune.daemon import service

    d = harness.daemon(seeded=seeded)
    released: list[int] = []
    monkeypatch.setattr(service, "release_memory", lambda: released.append(1))
    plans = iter([scheduler.Decision(Action.VERIFY, "due"), scheduler.Decision(Action.WAIT, "idle", wait_s=60.0)])
    monkeypatch.setattr(d, "decide", lambda: next(plans))
    monkeypatch.setattr(d, "verify", lambda: None)
    assert d.act().action is Action.WAIT and released == [1]
    monkeypatch.setattr(d, "decide", lambda: scheduler.Decision(Action.WAIT, "idle", wait_s=60.0))
    assert d.act().action is Action.WAIT and released == [1]  # a poll that did nothing leaves the heap alone


def test_release_memory_frees_what_only_a_collection_frees() -> None:
    import gc
    import weakref

    from nccltune.daemon.service import release_memory

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: reference counting alone never frees it
    gone = weakref.ref(a)
    del a, b
    gc.disable()
    try:
        release_memory()  # then glibc's malloc_trim on Linux; it must never raise
    finally:
        gc.enable()
    assert gone() is None
