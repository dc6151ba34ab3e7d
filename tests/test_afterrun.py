"""What follows a sweep or a verify (afterrun.py), the one code `nccltune sweep`, `nccltune verify`
and the daemon run: on the shared demo state, and on a history that cannot be read."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest

from nccltune.afterrun import upgrade_check, write_metrics
from nccltune.config import Config, load_config, with_overrides
from nccltune.metrics import LiveState
from nccltune.node import load_node


def _cfg(state: Path, *, metrics: bool = True) -> Config:
    return with_overrides(load_config(None), state_dir=str(state),
                          **{"publish.metrics_dir": "metrics" if metrics else None})


def test_the_textfile_of_a_run_and_of_the_daemon(seeded: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(seeded, state, symlinks=True)
    cfg = _cfg(state)
    node = load_node(cfg, True)
    prom = state / "metrics" / "nccltune.prom"
    prom.unlink(missing_ok=True)

    write_metrics(cfg, node, nccl_version=None)
    after_run = prom.read_text()
    assert "nccltune_last_sweep_success" in after_run  # from the history: the demo sweep
    assert 'class="' in after_run
    assert "nccltune_doctor_findings" not in after_run  # a command's run knows no doctor counts

    live = LiveState(state="idle", busy_processes=0, heartbeat_ts=time.time())
    write_metrics(cfg, node, nccl_version=None, live=live)
    daemon_file = state / "metrics" / "nccltune-daemon.prom"
    daemon = daemon_file.read_text()
    assert 'nccltune_doctor_findings{' in daemon and 'severity="error"' in daemon
    assert prom.read_text() == after_run  # the history's file is the same whoever writes it
    # A command's run after the daemon's write leaves the daemon's file as it was.
    write_metrics(cfg, node, nccl_version=None)
    assert daemon_file.read_text() == daemon


def test_a_history_that_cannot_be_read_is_a_warning_not_a_failed_run(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"
    (state / "history.db").mkdir(parents=True)  # a directory where the history should be
    cfg = _cfg(state)
    node = load_node(cfg, True)
    with caplog.at_level(logging.WARNING, logger="nccltune.afterrun"):
        upgrade_check(cfg, 1)
        write_metrics(cfg, node, nccl_version="2.21.5")
    said = [r.getMessage() for r in caplog.records if r.name == "nccltune.afterrun"]
    assert len(said) == 2
    assert said[0].startswith("cannot run the upgrade check: ")
    assert said[1].startswith(f"cannot write metrics to {state / 'metrics'}: ")
    assert not (state / "metrics" / "nccltune.prom").exists()


def test_no_metrics_directory_writes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    cfg = _cfg(state, metrics=False)
    write_metrics(cfg, load_node(cfg, True), nccl_version=None)
    assert sorted(p.name for p in state.iterdir()) == []


def test_the_node_feature_file_says_class_state_and_verdict(seeded: Path, tmp_path: Path) -> None:
    """From the same snapshot as the metrics: the class id the textfile carries, the published
    state of the demo sweep, no verdict without a class profile; an hour until it expires."""
    import datetime as dt

    state = tmp_path / "state"
    shutil.copytree(seeded, state, symlinks=True)
    features = tmp_path / "features.d" / "nccltune"
    cfg = with_overrides(_cfg(state), **{"publish.node_features_file": str(features)})
    node = load_node(cfg, True)
    now = dt.datetime(2026, 12, 7, 6, 0, 0, tzinfo=dt.timezone.utc)
    write_metrics(cfg, node, nccl_version=None, now=now)
    lines = features.read_text().splitlines()
    assert "# +expiry-time=2026-12-07T07:00:00Z" in lines
    labels = dict(line.split("=", 1) for line in lines if not line.startswith("#"))
    prom = (state / "metrics" / "nccltune.prom").read_text()
    assert f'class="{labels["nccltune-class"]}"' in prom
    assert labels["nccltune-state"] in {"tuned", "defaults", "safe"}
    assert labels["nccltune-decision"] == "node"
    assert labels["nccltune-outlier"] == "unknown"
    assert (features.stat().st_mode & 0o777) == 0o644


def test_node_features_without_metrics(seeded: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(seeded, state, symlinks=True)
    shutil.rmtree(state / "metrics", ignore_errors=True)
    features = tmp_path / "features.d" / "nccltune"
    cfg = with_overrides(_cfg(state, metrics=False), **{"publish.node_features_file": str(features)})
    write_metrics(cfg, load_node(cfg, True), nccl_version=None)
    assert "nccltune-class=" in features.read_text()
    assert not (state / "metrics").exists()
