"""Every collective through the real gloo pipeline: one demo sweep whose profile measures all
seven (trials, choice, store, the reports, the plot, verify), and a wrong result per collective."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from demo_state import EVERY_COLLECTIVE, DemoSweep, clean_env, copy_state

from nccltune.checks.verify import DEMO_VERIFY_SIZES
from nccltune.cli import main
from nccltune.node import DEMO_SIZES
from nccltune.report.plot import series_by_collective
from nccltune.store import Store
from nccltune.trials.runner import Runner
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

MiB = 1 << 20


def test_the_sweep_reports_a_row_per_collective_and_size(every_collective_sweep: DemoSweep) -> None:
    doc = every_collective_sweep.doc
    assert doc["collectives"] == list(EVERY_COLLECTIVE)
    assert doc["not_measured"] == {}  # two gloo ranks have every one
    assert doc["failed_trials"] == []
    got = {(r["collective"], r["size_bytes"]) for r in doc["sizes"]}
    # Sizes as nccl-tests prints them: the split collectives round blocks, the same ladder here.
    assert got == {(c, s) for c in EVERY_COLLECTIVE for s in DEMO_SIZES}
    weights = {(r["collective"], r["size_bytes"]): r["weight"] for r in doc["sizes"]}
    assert weights[("all_to_all", MiB)] == 1.0 and weights[("sendrecv", 4096)] == 0.5
    assert weights[("broadcast", 65536)] == 0.0
    # Report rows keep 3 decimals (gloo moves 4 KiB at well under 1 MB/s); 1 MiB moves enough to show.
    assert all(r["default_busbw_gbps"] > 0 for r in doc["sizes"] if r["size_bytes"] == MiB)
    assert [r["collective"] for r in doc["sizes"]][:len(DEMO_SIZES)] == ["all_reduce"] * len(DEMO_SIZES)


def test_the_store_keeps_every_collectives_measurements(every_collective_sweep: DemoSweep) -> None:
    with Store(every_collective_sweep.state / "history.db") as store:
        run = store.run(every_collective_sweep.doc["run_id"])
        assert run is not None
        trials = store.trials(run.id)
        assert {r.collective for r in run.rows} == set(EVERY_COLLECTIVE)
        for t in trials:
            assert t.status == "ok", t.reason
            assert {m.collective for m in t.measurements} == set(EVERY_COLLECTIVE)
            assert all(m.correct and m.busbw_gbps > 0 for m in t.measurements)
        series = series_by_collective(trials)
    assert list(series) == list(EVERY_COLLECTIVE)
    assert all("NCCL defaults" in by_label for by_label in series.values())


def test_report_history_and_plot_name_the_collective(every_collective_sweep: DemoSweep, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(a) for a in every_collective_sweep.args()]
    assert main(["report", *args]) == 0
    text = capsys.readouterr().out
    for c in EVERY_COLLECTIVE:
        assert f"\n{c} (busbw = algbw x " in text
    assert "all_gather (busbw = algbw x (n-1)/n):" in text and "broadcast (busbw = algbw x 1):" in text
    assert main(["report", *args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sizes"]
    assert {r["collective"] for r in rows} == set(EVERY_COLLECTIVE)
    run_id = every_collective_sweep.doc["run_id"]
    assert main(["history", *args, "--run", str(run_id), "--json"]) == 0
    trials = json.loads(capsys.readouterr().out)["trials"]
    assert {m["collective"] for m in trials[0]["measurements"]} == set(EVERY_COLLECTIVE)
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    assert main(["report", *args, "--plot", str(png)]) == 0
    capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One row per collective, stacked: seven rows of 4.5 in (a busbw and a time panel, 13 in) at 120 dpi.
    width, height = struct.unpack(">II", png.read_bytes()[16:24])
    assert (width, height) == (1560, 7 * 540)


def test_verify_checks_every_collective_of_the_profile(every_collective_sweep: DemoSweep, tmp_path: Path) -> None:
    state = tmp_path / "state"
    copy_state(every_collective_sweep.state, state)
    got = subprocess.run(
        [sys.executable, "-m", "nccltune", "verify", "--demo", "--json", "--threshold", "90",
         "--config", str(every_collective_sweep.config), "--state-dir", str(state)],
        capture_output=True, text=True, env=clean_env(), timeout=300)
    assert got.returncode in (0, 1), got.stderr
    doc = json.loads(got.stdout)
    rows = {(r["collective"], r["size_bytes"]): r for r in doc["sizes"]}
    assert set(rows) == {(c, s) for c in EVERY_COLLECTIVE for s in DEMO_VERIFY_SIZES}
    for key, row in rows.items():
        assert row["measured_gbps"] is not None and row["measured_gbps"] > 0, key
        assert row["expected_gbps"] is not None, key  # from the sweep's row of the same collective and size


def test_a_wrong_result_is_caught_for_every_collective(tmp_path: Path) -> None:
    runner = Runner(python=sys.executable, backend="gloo", nranks=2, base_env=clean_env(**{FAULT_VAR: "wrong_sum"}),
                    work_dir=tmp_path, timeout_s=120)
    result = runner.run({}, [4096], warmup=0, iters=1, collectives=list(EVERY_COLLECTIVE))
    assert result.status == "wrong_result"
    assert {m.collective for m in result.sizes if not m.correct} == set(EVERY_COLLECTIVE)
    assert result.reason is not None
    for c in EVERY_COLLECTIVE:
        assert c.replace("_", "-") in result.reason
