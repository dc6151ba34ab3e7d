"""Two runs side by side (`nccltune compare`) and the upgrade gate: a change counts only beyond the
noise of both runs, per collective and size, on hand-made histories."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from nccltune.cli import main
from nccltune.compare import (
    baseline_slower,
    compare_runs,
    compare_stats,
    setting_of,
    setting_trials,
    trial_setting,
    upgrade_check,
)
from nccltune.fleet.jsonschema import validate
from nccltune.names import DEFAULTS_LABEL
from nccltune.records import Measurement
from nccltune.store import Phase, Store, TrialRecord
from nccltune.sweep.select import SizeStats

MiB = 1 << 20
KEY = ("all_reduce", MiB)


def _stats(*values: float) -> SizeStats:
    vals = sorted(values)
    return SizeStats(MiB, vals[len(vals) // 2], vals[0], vals[-1], len(vals))


@pytest.mark.parametrize(("b", "verdict"), [((8.0, 8.1, 7.9), "slower"), ((10.05, 10.1, 10.0), "same"),
                                             ((12.0, 12.1, 11.9), "faster")])
def test_a_change_counts_only_beyond_both_runs_noise(b: tuple[float, ...], verdict: str) -> None:
    got = compare_stats({KEY: _stats(10.0, 10.1, 9.9)}, {KEY: _stats(*b)})
    assert [(s.size_bytes, s.verdict) for s in got] == [(MiB, verdict)]
    assert got[0].noise_pct == pytest.approx(1.0 + 100.0 * (max(b) - min(b)) / 2 / sorted(b)[1])


def test_a_noisy_size_is_the_same_although_its_medians_differ() -> None:
    got = compare_stats({KEY: _stats(10.0, 14.0, 6.0)}, {KEY: _stats(8.0, 8.1, 7.9)})
    assert got[0].verdict == "same" and got[0].change_pct == pytest.approx(-20.0)


def test_a_size_one_run_lacks_is_missing() -> None:
    got = compare_stats({KEY: _stats(10.0, 10.0)}, {})
    assert got[0].verdict == "missing" and got[0].b_busbw_gbps is None


def _sweep(store: Store, nccl: str, defaults: list[float], tuned: list[float]) -> int:
    run = store.start_run(kind="sweep", fingerprint="0123456789abcdef", backend="nccl", demo=False, profile="balanced",
                          nccl_version=nccl, driver_version="570.1", torch_version="2.7.0", nccltune_version="0",
                          hostname="node1", topology={}, config={})
    seq = 0
    for label, env, values in (("defaults", {}, defaults), ("NCCL_ALGO=Ring", {"NCCL_ALGO": "Ring"}, tuned)):
        for i, busbw in enumerate(values):
            seq += 1
            m = Measurement(size_bytes=MiB, time_us=100.0, algbw_gbps=busbw, busbw_gbps=busbw)
            store.add_trial(run, seq=seq, phase="baseline" if not env else "final", label=f"{label} #{i + 1}",
                            env=env, status="ok", measurements=[m])
    store.finish_run(run, status="ok", summary={"chosen": "NCCL_ALGO=Ring", "nccl_version": nccl},
                     chosen_env={"NCCL_ALGO": "Ring"})
    return run


@pytest.fixture
def history(tmp_path: Path) -> tuple[Path, list[int]]:
    state = tmp_path / "state"
    state.mkdir()
    with Store(state / "history.db") as store:
        ids = [_sweep(store, "2.21.5", [100.0, 101.0, 99.0], [120.0, 121.0, 119.0]),
               _sweep(store, "2.26.2", [70.0, 70.5, 69.5], [119.5, 120.5, 120.0])]
    return state, ids


def test_each_side_of_a_sweep_is_its_own_trials(history: tuple[Path, list[int]]) -> None:
    state, (a, b) = history
    with Store(state / "history.db") as store:
        defaults = compare_runs(store, a, b, "defaults")
        published = compare_runs(store, a, b, "published")
    assert [s.verdict for s in defaults.sizes] == ["slower"] and defaults.sizes[0].a_busbw_gbps == 100.0
    assert [s.verdict for s in published.sizes] == ["same"] and published.sizes[0].a_busbw_gbps == 120.0


def _record(seq: int, phase: Phase, label: str, env: dict[str, str], status: str = "ok") -> TrialRecord:
    m = Measurement(size_bytes=MiB, time_us=100.0, algbw_gbps=10.0, busbw_gbps=10.0)
    return TrialRecord(id=seq, run_id=1, seq=seq, phase=phase, label=label, env=env, status=status,  # type: ignore[arg-type]
                       reason=None, wall_s=1.0, nccl=None, started_at="2026-01-01T00:00:00+00:00", measurements=(m,))


RING = {"NCCL_ALGO": "Ring"}
RING_LL = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}
RULE_TRIALS = [
    _record(1, "baseline", "defaults #1", {}), _record(2, "baseline", "defaults #2", {}, status="timeout"),
    _record(3, "screen", "NCCL_ALGO=Ring", RING), _record(4, "screen", "NCCL_ALGO=Ring NCCL_PROTO=LL", RING_LL),
    _record(5, "final", "NCCL_ALGO=Ring #1", RING), _record(6, "final", "NCCL_ALGO=Ring NCCL_PROTO=LL #1", RING_LL),
    _record(7, "baseline", "defaults (final check) #1", {}), _record(8, "final", "NCCL_ALGO=Ring #2", RING),
    _record(9, "final", "NCCL_ALGO=Ring #3", RING, status="wrong_result"),
]


def test_a_setting_is_its_baseline_or_final_runs_by_their_whole_label() -> None:
    assert [trial_setting(t.phase, t.label) for t in RULE_TRIALS] == [
        DEFAULTS_LABEL, DEFAULTS_LABEL, None, None, "NCCL_ALGO=Ring", "NCCL_ALGO=Ring NCCL_PROTO=LL",
        DEFAULTS_LABEL, "NCCL_ALGO=Ring", "NCCL_ALGO=Ring"]
    # Of those, the ok trials with measurements make the number: no timeout, no wrong result, no
    # screening run, and a label that holds another ("NCCL_ALGO=Ring" in "... NCCL_PROTO=LL") is not it.
    assert [setting_of(t) for t in RULE_TRIALS] == [
        DEFAULTS_LABEL, None, None, None, "NCCL_ALGO=Ring", "NCCL_ALGO=Ring NCCL_PROTO=LL", DEFAULTS_LABEL,
        "NCCL_ALGO=Ring", None]
    assert [t.seq for t in setting_trials(RULE_TRIALS, "NCCL_ALGO=Ring")] == [5, 8]
    for defaults in ("defaults", DEFAULTS_LABEL, "", None):
        assert [t.seq for t in setting_trials(RULE_TRIALS, defaults)] == [1, 7]


def test_upgrade_gate_flags_nccls_slower_defaults(history: tuple[Path, list[int]],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    state, (a, b) = history
    with Store(state / "history.db") as store, caplog.at_level(logging.WARNING, logger="nccltune.compare"):
        run = store.run(b)
        assert run is not None
        check = upgrade_check(store, run)
        first = store.run(a)
        assert first is not None and upgrade_check(store, first) is None  # nothing measured before it
    assert check is not None and check.previous_run_id == a
    assert check.before[0] == "2.21.5" and check.after[0] == "2.26.2"
    assert [(side, s.size_bytes) for side, s in check.regressions] == [("defaults", MiB)]
    assert "after the upgrade (NCCL 2.21.5" in caplog.text and "30.0% slower" in caplog.text


def test_same_versions_are_no_upgrade(tmp_path: Path) -> None:
    with Store(tmp_path / "history.db") as store:
        _sweep(store, "2.26.2", [100.0, 100.0], [100.0, 100.0])
        b = _sweep(store, "2.26.2", [50.0, 50.0], [50.0, 50.0])
        run = store.run(b)
        assert run is not None and upgrade_check(store, run) is None


def _cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def test_compare_command_exits_1_on_a_slower_run_and_its_json_has_a_schema(history: tuple[Path, list[int]]) -> None:
    state, (a, b) = history
    rc, out, _ = _cli("compare", a, b, "--side", "defaults", "--json", "--state-dir", state)
    doc: dict[str, Any] = json.loads(out)
    validate(doc, json.loads((REPO / "schemas" / "compare.schema.json").read_text()))
    assert rc == 1 and doc["slower"] == 1 and doc["sizes"][0]["verdict"] == "slower"
    assert doc["sizes"][0]["change_pct"] == -30.0
    rc, out, _ = _cli("compare", a, b, "--state-dir", state)
    assert rc == 0 and "No size slower beyond the noise." in out and "1 GB/s = 1e9 B/s" in out
    rc, _, err = _cli("compare", a, 99, "--state-dir", state)
    assert rc == 2 and "no run 99" in err


def test_upgrade_regression_is_a_doctor_finding_and_a_metric(history: tuple[Path, list[int]]) -> None:
    from nccltune.checks.doctor import upgrade_findings
    from nccltune.metrics import render, snapshot_from_store

    state, (a, b) = history
    with Store(state / "history.db") as store:
        findings = upgrade_findings(store, "0123456789abcdef")
        assert upgrade_findings(store, "fedcba9876543210") == []  # another topology: nothing measured before
        text = render(snapshot_from_store(store, fingerprint="0123456789abcdef"))
    assert [(f.severity, f.code) for f in findings] == [("warning", "upgrade-regression")]
    assert "NCCL 2.21.5 -> 2.26.2" in findings[0].message and f"compare {a} {b}" in findings[0].fix
    series = [ln for ln in text.splitlines() if ln.startswith("nccltune_upgrade_regression{")]
    labels = 'collective="all_reduce",setting="default",size_bytes="1048576"'
    assert series == [f"nccltune_upgrade_regression{{{labels}}} -0.3"]


def _one_rank_import(store: Store) -> int:
    """What `nccltune import` stores for an all_reduce_perf run of one rank: busbw 0 at every size."""
    run = store.start_run(kind="import", fingerprint="unknown", backend="nccl", demo=False, profile=None,
                          nccl_version="2.21.5", driver_version=None, torch_version=None, nccltune_version="0",
                          hostname="node1", topology={"source": "nccl-tests document x.json", "nranks": 1},
                          config={})
    for seq, size in enumerate((MiB, 4 * MiB), start=1):
        m = Measurement(size_bytes=size, time_us=50.0, algbw_gbps=size / 50e3, busbw_gbps=0.0)
        store.add_trial(run, seq=seq, phase="import", label=f"cycle 1 {size}", env={}, status="ok",
                        measurements=[m])
    store.finish_run(run, status="ok", summary={"nranks": 1})
    return run


def test_compare_with_nothing_comparable_says_why_and_exits_78(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with Store(state / "history.db") as store:
        a, b = _one_rank_import(store), _one_rank_import(store)
        assert baseline_slower(store, a, b, "published") is not None  # a gate that compared nothing fails
    rc, out, err = _cli("compare", a, b, "--state-dir", state)
    assert rc == 78, err
    assert "No size slower" not in out and "missing" in out
    assert f"run {a} ran at one rank: busbw is 0 by definition at one rank" in err
    assert err.count("nccltune: error:") == 1
    rc, out, _ = _cli("compare", a, b, "--json", "--state-dir", state)
    assert rc == 78 and json.loads(out)["slower"] == 0
