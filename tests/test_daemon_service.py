"""The daemon's service loop, in this process: a Daemon over the demo snapshot with its clocks,
node loader and NCCL probe injected, stepped through start, poll, act and reload."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from demo_state import BASE_CONFIG, SNAPSHOT, seeded_state

from nccltune.config import Config, with_overrides
from nccltune.daemon import DEMO_BUSY_FILE, Daemon, DaemonOptions, actions, scheduler
from nccltune.daemon.actions import NcclInfo, Node
from nccltune.daemon.scheduler import Action
from nccltune.errors import BusyError
from nccltune.sdnotify import Notifier

PUBLISHED = ("nccl.sh", "nccl.env", "nccl.json", "ncclTopology.xml")
# The published tuning depends on this setting (see test_daemon.py).
RETUNE = {"sweep": {"min_gain_pct": 2.5}}


def config_text(**changes: dict[str, Any]) -> str:
    doc = json.loads(json.dumps(BASE_CONFIG))
    for section, values in changes.items():
        doc.setdefault(section, {}).update(values)
    return yaml.safe_dump(doc, sort_keys=False)


def published_bytes(state: Path) -> dict[str, bytes]:
    return {name: (state / name).read_bytes() for name in PUBLISHED if (state / name).exists()}


def seeded_nccl_version(state: Path) -> str | None:
    version = json.loads((state / "nccl.json").read_text())["provenance"].get("nccl_version")
    assert version is None or isinstance(version, str)
    return version


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return seeded_state(tmp_path_factory)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """Builds started daemons and releases their locks at the end of the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.daemons: list[Daemon] = []

    def daemon(self, *, clock: Callable[[], float] | None = None, wall: dt.datetime | None = None,
               seeded: Path | None = None, node_loader: Callable[[Config, str | bool | None], Node] = actions.read_node,
               **overrides: object) -> Daemon:
        state = self.tmp_path / "state"
        nccl_version = None
        if seeded is not None:
            shutil.copytree(seeded, state, symlinks=True)
            nccl_version = seeded_nccl_version(state)
        cfg = self.tmp_path / "config.yaml"
        if not cfg.exists():
            cfg.write_text(config_text())
        opts = DaemonOptions(config_path=cfg, overrides={"state_dir": str(state), **overrides}, demo=str(SNAPSHOT))
        d = Daemon(opts, notifier=Notifier(env={}), clock=clock or FakeClock(),
                   wall_clock=(lambda: wall) if wall is not None else dt.datetime.now,
                   node_loader=node_loader, nccl_probe=lambda cfg, python: NcclInfo(version=nccl_version))
        self.daemons.append(d)
        d.start()
        return d


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    for d in h.daemons:
        d.close()


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
    assert "nccltune_degraded 1.0" in (state / "metrics" / "nccltune.prom").read_text()
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
