"""What surrounds the GPU-only paths, checked without a GPU: the verdict of `topo check` from
NCCL's log, the busy-GPU refusal of a real (non-demo) sweep, and the daemon's view of busy GPUs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import NCCL_LOGS

from nccltune.checks.topocheck import verdict_of
from nccltune.cli import main
from nccltune.errors import EXIT_BUSY
from nccltune.hw.types import GpuProcess
from nccltune.nccl.debuglog import parse_nccl_log
from nccltune.records import Measurement, TrialResult
from nccltune.topology.snapshot import load_snapshot, snapshot_to_json
from nccltune.topology.source import bundled_topologies_dir

LOGS = NCCL_LOGS


def _trial(status: str = "ok", correct: bool = True, reason: str | None = None) -> TrialResult:
    return TrialResult(status=status, reason=reason, wall_s=1.0,
                       sizes=[Measurement(1 << 20, 10.0, 100.0, 100.0, correct=correct)])


def _log(name: str):  # type: ignore[no-untyped-def]
    return parse_nccl_log((LOGS / name).read_text())


def test_loaded_file_with_a_correct_result_passes_and_keeps_its_hints() -> None:
    log = _log("topo-loaded-hints.txt")
    passed, verdict = verdict_of(log, _trial())
    assert passed and "loaded the file" in verdict
    assert log.topo_hints  # reported beside the verdict, not a failure


def test_a_file_nccl_could_not_open_is_ignored() -> None:
    passed, verdict = verdict_of(_log("topo-open-failed.txt"), _trial())
    assert not passed and verdict.startswith("NCCL ignored the file")


def test_a_parse_error_is_a_rejection_even_when_the_job_crashed() -> None:
    passed, verdict = verdict_of(_log("topo-xml-declaration.txt"), _trial("crashed", reason="rank 0 exited"))
    assert not passed and verdict.startswith("NCCL rejected the file")
    assert "XML" in verdict


def test_no_loading_line_means_not_loaded() -> None:
    passed, verdict = verdict_of(_log("h200x2-init-rank0.txt"), _trial())
    assert not passed and "did not say it loaded" in verdict


def test_loaded_but_wrong_or_failed() -> None:
    log = _log("topo-loaded-hints.txt")
    assert verdict_of(log, _trial(correct=False)) == (
        False, "NCCL loaded the file but the all-reduce result was wrong")
    passed, verdict = verdict_of(log, _trial("timeout", reason="no result within 180 s"))
    assert not passed and "all-reduce failed: no result within 180 s" in verdict


def _busy_snapshot(tmp_path: Path) -> Path:
    snap = load_snapshot(bundled_topologies_dir() / "h200x2-nvswitch-vm.json")
    g0 = dataclasses.replace(snap.nvml.gpus[0], processes=(GpuProcess(pid=31337, used_memory_bytes=1 << 30),))
    busy = dataclasses.replace(snap, nvml=dataclasses.replace(snap.nvml, gpus=(g0, *snap.nvml.gpus[1:])))
    path = tmp_path / "busy.json"
    path.write_text(snapshot_to_json(busy))
    return path


def test_a_gpu_sweep_refuses_busy_gpus_with_75_and_writes_nothing(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # topology.snapshot stands in for NVML: the same non-demo (NCCL) path, stopped before any trial.
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"topology": {"snapshot": str(_busy_snapshot(tmp_path))}}))
    rc = main(["sweep", "--config", str(cfg), "--state-dir", str(tmp_path / "state")])
    assert rc == EXIT_BUSY
    err = capsys.readouterr().err
    assert "GPU0: pid 31337" in err and "--force" in err
    assert not (tmp_path / "state").exists()


def test_the_daemon_counts_other_processes_not_its_own_ranks(tmp_path: Path) -> None:
    from nccltune.daemon import Daemon, DaemonOptions
    from nccltune.node import load_node

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"topology": {"snapshot": str(_busy_snapshot(tmp_path))}}))
    daemon = Daemon(DaemonOptions(config_path=cfg, overrides={"state_dir": str(tmp_path / "s")}))
    node = load_node(daemon.cfg, None)
    assert daemon.gpus_busy(node) == [31337]
