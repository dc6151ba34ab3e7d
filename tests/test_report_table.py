"""The sweep and report table in all_reduce_perf's layout: size, count, type, then time, algbw,
busbw and #wrong for NCCL's defaults and the published setting, ratio and noise; GB/s defined once."""

from __future__ import annotations

from nccltune.records import Measurement, ReportRow, TrialStatus
from nccltune.report.sweep import TABLE_UNITS, rows_text, size_facts
from nccltune.store import Phase, TrialRecord

MiB = 1 << 20


def _trial(seq: int, label: str, env: dict[str, str], busbw: float, *, correct: bool = True,
           phase: Phase = "baseline", status: TrialStatus = "ok") -> TrialRecord:
    # 4 ranks: busbw = algbw x 2(n-1)/n = algbw x 1.5
    m = Measurement(size_bytes=MiB, time_us=MiB / (busbw / 1.5 * 1e3), algbw_gbps=busbw / 1.5, busbw_gbps=busbw,
                    correct=correct)
    return TrialRecord(id=seq, run_id=1, seq=seq, phase=phase, label=label, env=env, status=status, reason=None,
                       wall_s=1.0, nccl=None, started_at="2026-01-01T00:00:00+00:00", measurements=(m,))


TRIALS = [_trial(1, "defaults #1", {}, 15.0), _trial(2, "defaults #2", {}, 15.0, correct=False),
          _trial(3, "NCCL_ALGO=Ring #1", {"NCCL_ALGO": "Ring"}, 30.0, phase="final"),
          _trial(4, "NCCL_PROTO=LL", {"NCCL_PROTO": "LL"}, 3.0, correct=False, phase="screen")]
ROW = ReportRow(size_bytes=MiB, weight=1.0, default_busbw_gbps=15.0, default_noise_pct=2.5, tuned_busbw_gbps=30.0,
                ratio=2.0, default_algo_proto="Tree/LL128", tuned_algo_proto="Ring/Simple")


def test_table_has_the_nccl_tests_columns_for_both_sides() -> None:
    lines = rows_text([ROW], TRIALS, "NCCL_ALGO=Ring")
    assert lines[0] == TABLE_UNITS and "1 GB/s = 1e9 B/s" in lines[0]
    assert sum("GB/s" in line for line in lines) == 1  # defined once, in the header line
    assert "NCCL defaults" in lines[1] and "published" in lines[1]
    assert lines[2].split() == ["#", "size", "count", "type", "time", "algbw", "busbw", "#wrong", "time", "algbw",
                                "busbw", "#wrong", "ratio", "noise", "NCCL", "default", "->", "tuned"]
    cells = lines[3].split()
    # algbw = busbw / 1.5 (the factor the trials measured); time: the median the side's trials measured.
    assert cells[:3] == ["1048576", "262144", "float"]
    assert cells[3:7] == [f"{MiB / 10e3:.2f}", "10.00", "15.00", "1"]  # one wrong result among the defaults
    assert cells[7:11] == [f"{MiB / 20e3:.2f}", "20.00", "30.00", "0"]  # the LL trial is not the published one
    assert cells[11:13] == ["2.000", "±2.5%"]
    assert " ".join(cells[13:]) == "Tree/LL128 -> Ring/Simple"


def test_without_trials_time_and_algbw_are_not_invented() -> None:
    cells = rows_text([ROW])[3].split()
    assert cells[3:7] == ["-", "-", "15.00", "0"]


def test_facts_count_wrong_results_for_the_defaults_when_they_are_published() -> None:
    facts = size_facts(TRIALS, "NCCL defaults")[("all_reduce", MiB)]
    assert (facts.wrong_defaults, facts.wrong_tuned) == (1, 1)
    assert facts.bus_factor is not None and abs(facts.bus_factor - 1.5) < 1e-9


def test_wrong_results_count_for_the_published_setting_in_its_own_trials_alone() -> None:
    ring, ring_ll = {"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}
    trials = [*TRIALS[:3],
              # A finalist whose label holds the published one's, and the published one's screening run.
              _trial(5, "NCCL_ALGO=Ring NCCL_PROTO=LL #1", ring_ll, 3.0, correct=False, phase="final",
                     status="wrong_result"),
              _trial(6, "NCCL_ALGO=Ring", ring, 3.0, correct=False, phase="screen", status="wrong_result"),
              # The published setting's own final run that was wrong.
              _trial(7, "NCCL_ALGO=Ring #2", ring, 3.0, correct=False, phase="final", status="wrong_result")]
    facts = size_facts(trials, "NCCL_ALGO=Ring")[("all_reduce", MiB)]
    assert (facts.wrong_defaults, facts.wrong_tuned) == (1, 1)
    cells = rows_text([ROW], trials, "NCCL_ALGO=Ring")[3].split()
    assert cells[7:11] == [f"{MiB / 20e3:.2f}", "20.00", "30.00", "1"]  # the time: the good final run's


def test_a_verification_from_the_history_shows_measured_against_expected_per_size() -> None:
    from nccltune.report.runs import verify_run_text
    from nccltune.store import RunRecord

    run = RunRecord(id=7, kind="verify", status="failed", started_at="2026-01-02T03:04:05+00:00", finished_at=None,
                    fingerprint="0123456789abcdef", backend="nccl", demo=False, profile="balanced",
                    nccl_version="2.21.5", driver_version=None, torch_version=None, nccltune_version="0",
                    hostname="node1", topology={}, config={}, chosen_env=None, published_generation=None,
                    summary={"reason": "bus bandwidth drifted", "rows": [
                        {"size_bytes": MiB, "measured_gbps": 12.5, "expected_gbps": 25.0, "drift_pct": -50.0},
                        {"size_bytes": 2 * MiB, "measured_gbps": 30.0, "expected_gbps": None}]})
    lines = verify_run_text(run).splitlines()
    assert lines[0] == "Verification 7 of 2026-01-02T03:04:05+00:00 (failed): bus bandwidth drifted"
    assert lines[1].startswith(f"  {MiB} B: measured 12.5") and lines[1].endswith(", drift -50.0%")
    assert lines[2] == f"  {2 * MiB} B: measured 30.00, expected -"  # no expectation at this size: no traceback
