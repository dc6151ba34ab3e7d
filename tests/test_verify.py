"""`nccltune verify`: a short all-reduce with the published environment, judged against the sweep.

The end-to-end tests run the real worker (gloo) on a copy of one demo sweep's state. The tests
of how rows are judged use a scripted worker (given as the worker interpreter) that reports
chosen bandwidths, so that pass and fail do not depend on the noise of a shared CPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from nccltune import __version__
from nccltune.checks.verify import DEMO_VERIFY_SIZES, SampleCounts, allowed_drift_pct, run_verify
from nccltune.cli import main
from nccltune.config import Config, load_config, with_overrides
from nccltune.errors import CheckFailed
from nccltune.files.lock import SweepLock
from nccltune.records import Measurement, ReportRow
from nccltune.store import Store

pytest.importorskip("torch")

from demo_state import BASE_CONFIG, SNAPSHOT, clean_env, copy_state

# gloo on two shared cores differs by tens of percent from one run to the next; the real-worker
# tests check the plumbing with a wide threshold, the scripted ones check the judgement.
WIDE_THRESHOLD = "90"
MiB = 1 << 20


@pytest.fixture
def state(seeded: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "state"
    copy_state(seeded, copy)
    return copy


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(BASE_CONFIG, sort_keys=False))
    return path


def cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, clean_env(), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def verify_json(config: Path, state: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    rc, out, err = cli("verify", "--demo", SNAPSHOT, "--config", config, "--state-dir", state, "--json", *extra)
    doc = json.loads(out) if out.strip() else {}
    return rc, doc, err


def verify_runs(state: Path) -> list[Any]:
    with Store(state / "history.db") as store:
        return store.runs(limit=None, kind="verify")


# -- with the real worker --------------------------------------------------------------------------


def test_verify_after_a_sweep_passes_with_rows_and_is_recorded(config: Path, state: Path) -> None:
    rc, doc, err = verify_json(config, state, "--threshold", WIDE_THRESHOLD)
    assert doc["schema_version"] == 1 and doc["kind"] == "verify"
    rows = doc["sizes"]
    if doc["code"] == "not_verifiable":
        # gloo on a loaded machine: the sweep measured every size too noisily to verify it.
        assert rc == 1 and doc["passed"] is False and all(not r["verifiable"] for r in rows), doc
        assert all(r["allowed_pct"] >= 100 for r in rows) and doc["reason"].startswith("no size can be verified")
    else:
        assert rc == 0, (err, doc)
        assert doc["passed"] is True and doc["reason"].startswith("bus bandwidth as expected")
        assert all(r["ok"] for r in rows)
    assert doc["demo"] is True and "CPU DEMO" in doc["label"]
    assert doc["env_source"] == f"published in {state}"
    # Verify runs a job on this node: the every-job part and the single-node part.
    published = json.loads((state / "nccl.json").read_text())
    assert doc["env"] == {**published["env"], **published["single_node_env"]}
    assert [r["size_bytes"] for r in rows] == list(DEMO_VERIFY_SIZES)
    assert all(r["measured_gbps"] > 0 and r["expected_gbps"] > 0 for r in rows)
    assert all(r["allowed_pct"] >= float(WIDE_THRESHOLD) for r in rows)
    runs = verify_runs(state)
    status = "ok" if doc["passed"] else "failed"
    assert [(r.id, r.status, r.demo) for r in runs] == [(doc["run_id"], status, True)]
    assert runs[0].summary["passed"] is doc["passed"] and runs[0].summary["checked"] == doc["checked"]
    with Store(state / "history.db") as store:
        trials = store.trials(doc["run_id"])
    assert [(t.phase, t.status) for t in trials] == [("verify", "ok"), ("verify", "ok")]


def test_verify_below_a_floor_fails_with_exit_1(config: Path, state: Path) -> None:
    rc, doc, err = verify_json(config, state, "--floor", "1e9")
    assert rc == 1, err
    assert doc["passed"] is False
    assert "below" in doc["reason"] and "4MiB" in doc["reason"]
    assert doc["expectation"] == "floor 1e+09 GB/s at 4MiB"
    big = next(r for r in doc["sizes"] if r["size_bytes"] == max(DEMO_VERIFY_SIZES))
    assert big["ok"] is False and big["drift_pct"] < -99
    assert [r.status for r in verify_runs(state)] == ["failed"]


def test_verify_text_output_says_fail_and_why(config: Path, state: Path) -> None:
    rc, out, err = cli("verify", "--demo", SNAPSHOT, "--config", config, "--state-dir", state, "--floor", "1e9")
    assert rc == 1, err
    lines = out.splitlines()
    assert lines[0].startswith("*** CPU DEMO")
    assert lines[1].startswith("FAIL: 4MiB:") and "below the expected" in lines[1]
    assert any("<-- below" in line for line in lines)


# -- nothing to verify against ---------------------------------------------------------------------


def test_verify_with_nothing_published_exits_1_and_says_to_sweep(config: Path, tmp_path: Path) -> None:
    state = tmp_path / "empty"
    rc, doc, err = verify_json(config, state)
    assert rc == 1
    assert doc == {}
    assert "nothing is published" in err and "nccltune sweep" in err
    assert not state.exists()


def test_verify_without_a_sweep_in_history_exits_1_with_a_hint(config: Path, seeded: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    for name in ("nccl.sh", "nccl.env", "nccl.json", "nccl-single-node.sh", "nccl-single-node.env"):
        shutil.copy(seeded / name, state / name)
    rc, _doc, err = verify_json(config, state)
    assert rc == 1
    assert "no finished sweep for this topology" in err
    assert "hint: run `nccltune sweep`, or pass --floor GBPS" in err
    assert verify_runs(state) == []


def test_verify_while_a_sweep_holds_the_lock_exits_75(config: Path, state: Path) -> None:
    with SweepLock(state / "sweep.lock"):
        rc, _doc, err = verify_json(config, state)
    assert rc == 75
    assert f"pid {os.getpid()}" in err
    assert verify_runs(state) == []


# -- the judgement, with a scripted worker ---------------------------------------------------------

FAKE_WORKER = textwrap.dedent("""\
    #!{python}
    # Speaks the worker's JSON-lines protocol with bandwidths from $FAKE_BUSBW ({{size: GB/s}});
    # sizes it does not list are skipped, as the real worker skips what does not fit.
    import json, os, sys
    args = sys.argv[2:]
    sizes = [int(s) for s in args[args.index("--sizes") + 1].split(",")]
    table = json.loads(os.environ["FAKE_BUSBW"])
    if os.environ["RANK"] == "0":
        print(json.dumps({{"event": "start", "backend": "gloo", "world_size": 2, "pid": os.getpid()}}))
        for size in sizes:
            bw = table.get(str(size))
            if bw is None:
                print(json.dumps({{"event": "skip", "size_bytes": size, "reason": "scripted"}}))
                continue
            print(json.dumps({{"event": "size", "size_bytes": size, "time_us": 1.0, "algbw_gbps": bw,
                              "busbw_gbps": bw, "correct": True}}))
        print(json.dumps({{"event": "done"}}))
""")


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_WORKER.format(python=sys.executable))
    path.chmod(0o755)
    return path


def _cfg(config: Path, state: Path, python: Path | None = None) -> Config:
    """The test's config in `state`, its worker run by `python` (bench.python, as --python sets it)."""
    extra: dict[str, object] = {"bench.python": str(python)} if python else {}
    return with_overrides(load_config(config), state_dir=str(state), **extra)


def _record_sweep(state: Path, rows: list[dict[str, float]]) -> int:
    """A finished sweep of this topology with these rows: the newest, so verify's expectation."""
    with Store(state / "history.db") as store:
        fingerprint = store.runs(limit=1, kind="sweep")[0].fingerprint
        run_id = store.start_run(kind="sweep", fingerprint=fingerprint, backend="gloo", demo=True, profile=None,
                                 nccl_version=None, driver_version=None, torch_version=None,
                                 nccltune_version=__version__, hostname=socket.gethostname(), topology={},
                                 config={})
        store.finish_run(run_id, status="ok", summary={}, rows=[ReportRow.from_dict(r) for r in rows])
    return run_id


def _verify_with(table: dict[int, float], config: Path, state: Path, fake_python: Path, **kw: Any) -> Any:
    with mock.patch.dict(os.environ, clean_env(FAKE_BUSBW=json.dumps({str(k): v for k, v in table.items()})),
                         clear=True):
        return run_verify(_cfg(config, state, python=fake_python), demo=str(SNAPSHOT), **kw)


def test_a_drop_beyond_the_allowed_drift_fails_and_within_passes(config: Path, state: Path,
                                                                 fake_python: Path) -> None:
    # Expected GB/s and the run-to-run noise (%) the sweep measured; at 1 MiB twice the noise
    # (30%) is wider than the threshold (20%) and is what is allowed there.
    sweep = {262144: (1.0, 1.0), 1 << 20: (2.0, 15.0), 4 << 20: (4.0, 2.0)}
    run_id = _record_sweep(state, [{"size_bytes": s, "default_busbw_gbps": bw / 2, "tuned_busbw_gbps": bw,
                                    "default_noise_pct": noise} for s, (bw, noise) in sweep.items()])
    allowed = {262144: 20.0, 1 << 20: 30.0, 4 << 20: 20.0}
    within = {s: bw * (1 - 0.9 * allowed[s] / 100) for s, (bw, _noise) in sweep.items()}
    result = _verify_with(within, config, state, fake_python, threshold_pct=20.0)
    assert result.passed, result.reason
    assert result.expectation.startswith(f"sweep {run_id} of ")
    assert [(r.size_bytes, r.allowed_pct, r.ok) for r in result.rows] == [(s, allowed[s], True) for s in sweep]
    assert [r.drift_pct for r in result.rows] == [pytest.approx(-0.9 * allowed[s]) for s in sweep]

    beyond = {**within, 1 << 20: 2.0 * (1 - 0.31)}
    result = _verify_with(beyond, config, state, fake_python, threshold_pct=20.0)
    assert not result.passed
    assert result.reason == "1MiB: 1.38 GB/s is 31.0% below the expected 2.00"
    assert [r.ok for r in result.rows] == [True, False, True]
    # --current compares against what the defaults measured instead.
    result = _verify_with(beyond, config, state, fake_python, threshold_pct=20.0, use_current=True)
    assert result.passed, result.reason
    assert result.env == {} and result.env_source == "current environment"


def test_a_size_whose_noise_allows_any_drop_is_named_and_left_out(config: Path, state: Path,
                                                                    fake_python: Path) -> None:
    # At 1 MiB the sweep's noise was 60%: twice that is a drop of 120%, which no measurement shows.
    sweep = {262144: (1.0, 1.0), 1 << 20: (2.0, 60.0), 4 << 20: (4.0, 2.0)}
    _record_sweep(state, [{"size_bytes": s, "default_busbw_gbps": bw, "tuned_busbw_gbps": bw,
                           "default_noise_pct": noise} for s, (bw, noise) in sweep.items()])
    # Even at a tenth of its expectation 1 MiB is not judged; the other sizes are.
    result = _verify_with({262144: 1.0, 1 << 20: 0.2, 4 << 20: 4.0}, config, state, fake_python, threshold_pct=20.0)
    assert result.passed and result.code == "passed", result.reason
    assert [r.verifiable for r in result.rows] == [True, False, True]
    assert result.reason == ("bus bandwidth as expected at 2 size(s); not verifiable (the noise there allows a "
                             "drop no measurement can show): 1MiB (allowed -120%)")
    # A judged size still fails.
    result = _verify_with({262144: 0.5, 1 << 20: 2.0, 4 << 20: 4.0}, config, state, fake_python, threshold_pct=20.0)
    assert not result.passed and result.code == "below_expectation" and result.reason.startswith("256KiB")
    # With every size that noisy nothing is verified, and verify does not pass.
    _record_sweep(state, [{"size_bytes": s, "default_busbw_gbps": 1.0, "tuned_busbw_gbps": 1.0,
                           "default_noise_pct": 70.0} for s in sweep])
    result = _verify_with({s: 1.0 for s in sweep}, config, state, fake_python, threshold_pct=20.0)
    assert not result.passed and result.code == "not_verifiable"
    assert result.reason.startswith("no size can be verified; not verifiable") and "--floor" in result.reason
    assert all(not r.verifiable and r.ok for r in result.rows)


def test_quick_checks_one_collective_at_two_sizes_in_one_run_and_says_so(config: Path, state: Path,
                                                                          fake_python: Path) -> None:
    result = _verify_with({s: 1.0 for s in DEMO_VERIFY_SIZES}, config, state, fake_python, floor_gbps=0.5,
                          quick=True)
    assert result.passed, result.reason
    smallest, largest = DEMO_VERIFY_SIZES[0], DEMO_VERIFY_SIZES[-1]
    assert [(r.collective, r.size_bytes) for r in result.rows] == [("all_reduce", smallest), ("all_reduce", largest)]
    assert result.checked == "quick: all_reduce at 256KiB, 4MiB, 1 run(s)"
    with Store(state / "history.db") as store:
        run = store.run(result.run_id)
        assert run is not None and run.summary is not None and run.summary["checked"] == result.checked
        assert [t.label for t in store.trials(result.run_id)] == ["verify #1"]
    full = _verify_with({s: 1.0 for s in DEMO_VERIFY_SIZES}, config, state, fake_python, floor_gbps=0.5)
    assert full.checked == "all_reduce at 256KiB, 1MiB, 4MiB, 2 run(s)" and len(full.rows) == 3


def test_a_size_that_was_not_measured_fails_verify_without_a_crash(config: Path, state: Path,
                                                                   fake_python: Path) -> None:
    # The floor applies to the largest size; the worker skips exactly that one.
    table = {s: 1.0 for s in DEMO_VERIFY_SIZES[:-1]}
    result = _verify_with(table, config, state, fake_python, floor_gbps=0.5)
    assert not result.passed
    assert result.reason == "4MiB: not measured"
    assert [r.status for r in verify_runs(state)] == ["failed"]


def test_a_sweep_that_measured_none_of_the_verify_sizes_gives_no_expectation(config: Path, state: Path,
                                                                             fake_python: Path) -> None:
    cfg = _cfg(config, state, python=fake_python)
    _record_sweep(state, [{"size_bytes": 4096, "default_busbw_gbps": 1.0, "tuned_busbw_gbps": 1.0,
                           "default_noise_pct": 1.0}])
    with pytest.raises(CheckFailed, match=r"sweep \d+ measured none of the verify sizes"):
        run_verify(cfg, demo=str(SNAPSHOT))
    assert verify_runs(state) == []


def test_every_trial_failing_fails_verify(config: Path, state: Path, fake_python: Path) -> None:
    fake_python.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(5)\n")
    result = _verify_with({}, config, state, fake_python, threshold_pct=50.0)
    assert not result.passed
    assert result.reason.startswith("every verify trial failed: rank ")
    assert all(r.measured_gbps is None and not r.ok for r in result.rows)
    with Store(state / "history.db") as store:
        trials = store.trials(verify_runs(state)[0].id)
    assert [t.status for t in trials] == ["crashed", "crashed"]


# -- the allowed drift and the runs behind it ---------------------------------------------------------


def test_the_allowed_drift_grows_as_the_verify_sample_shrinks() -> None:
    # The smallest sweep the config allows (3 runs of the defaults, 1 of the finalist), 4% noise;
    # five, three, two runs and one run of verify at the same level.
    counts = SampleCounts(noise_runs=3, expected_runs=1)
    allowed = [allowed_drift_pct(1.0, 4.0, counts, [10.0] * m) for m in (5, 3, 2, 1)]
    assert allowed == sorted(allowed)
    assert allowed[1] < allowed[2] < allowed[3]
    assert allowed[3] > 4 * allowed[2]
    # The old rule (the threshold or twice the noise) stays the floor.
    assert allowed[0] == 8.0
    assert allowed_drift_pct(20.0, 4.0, counts, [10.0] * 5) == 20.0


def test_the_allowed_drift_grows_as_the_sweeps_sample_shrinks() -> None:
    # The same 4% noise measured over fewer runs of the sweep bounds less.
    few = allowed_drift_pct(1.0, 4.0, SampleCounts(3, 1), [10.0, 10.0])
    many = allowed_drift_pct(1.0, 4.0, SampleCounts(8, 5), [10.0, 10.0])
    assert few > many >= 8.0
    # Verify runs that disagree widely allow for it; nothing known about the spread leaves the threshold.
    assert allowed_drift_pct(1.0, 4.0, SampleCounts(3, 1), [10.0, 7.0]) > few
    assert allowed_drift_pct(5.0, 0.0, SampleCounts(0, 0), [10.0]) == 5.0
    assert allowed_drift_pct(5.0, 3.0, SampleCounts(6, 3), []) == 6.0


@pytest.mark.parametrize(("chosen", "use_current", "counts"), [
    ("NCCL_ALGO=Ring", False, SampleCounts(5, 4)), ("NCCL_ALGO=Ring", True, SampleCounts(5, 5)),
    ("NCCL defaults", False, SampleCounts(5, 5))])
def test_the_runs_behind_the_expectation_are_the_trials_behind_the_sweeps_numbers(
        tmp_path: Path, chosen: str, use_current: bool, counts: SampleCounts) -> None:
    from types import SimpleNamespace

    from nccltune.checks.verify import _expectations

    ring, ring_ll = {"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}
    with Store(tmp_path / "history.db") as store:
        # The config says 3 runs of the defaults and 3 of the finalist (6 and 3 behind the rows);
        # the sweep ran otherwise: a baseline failed, rounds were added while a finalist was undecided.
        run_id = store.start_run(kind="sweep", fingerprint="f" * 16, backend="gloo", demo=True, profile=None,
                                 nccl_version=None, driver_version=None, torch_version=None,
                                 nccltune_version=__version__, hostname=socket.gethostname(), topology={},
                                 config={"sweep": {"baseline_repeats": 3, "finalist_repeats": 3}})
        trials: list[tuple[str, str, dict[str, str], str]] = [
            ("baseline", "defaults #1", {}, "ok"), ("baseline", "defaults #2", {}, "crashed"),
            ("baseline", "defaults #3", {}, "ok"), ("screen", "NCCL_ALGO=Ring", ring, "ok"),
            ("screen", "NCCL_ALGO=Ring NCCL_PROTO=LL", ring_ll, "ok")]
        for r in range(4):
            trials += [("final", f"NCCL_ALGO=Ring #{r + 1}", ring, "ok"),
                       ("final", f"NCCL_ALGO=Ring NCCL_PROTO=LL #{r + 1}", ring_ll, "ok"),
                       ("baseline", f"defaults #{r + 4}", {}, "ok" if r < 3 else "timeout")]
        for seq, (phase, label, env, status) in enumerate(trials, start=1):
            store.add_trial(run_id, seq=seq, phase=phase, label=label, env=env, status=status,  # type: ignore[arg-type]
                            measurements=[Measurement(size_bytes=MiB, time_us=1.0, algbw_gbps=1.0, busbw_gbps=1.0)])
        store.finish_run(run_id, status="ok", summary={"chosen": chosen}, rows=[ReportRow.from_dict(
            {"size_bytes": MiB, "default_busbw_gbps": 1.0, "tuned_busbw_gbps": 1.0, "default_noise_pct": 1.0})])
        node = SimpleNamespace(fingerprint="f" * 16)
        _expected, _how, got = _expectations(store, node, None, use_current, [MiB], ("all_reduce",))  # type: ignore[arg-type]
    assert got == counts


def test_an_expectation_from_one_lucky_finalist_run_falls_back_to_the_defaults_level() -> None:
    # As on the CPU demo: the topology file alone measured once 10% above the defaults' median
    # (gloo ignores it); the defaults' 3 runs agreed within 0.8%. A verify 7% below that one
    # run but at the defaults' level is no drift.
    counts = SampleCounts(noise_runs=3, expected_runs=1)
    allowed = allowed_drift_pct(5.0, 0.78, counts, [1.91, 1.90], expected_gbps=2.059, defaults_gbps=1.875)
    assert allowed > 100 * (1 - 1.875 / 2.059) > 7.0
    # Well below the defaults' level still fails.
    assert allowed < 100 * (1 - 1.6 / 2.059)
    # With finalist repeats behind the expectation, its own numbers stand.
    assert allowed_drift_pct(5.0, 0.78, SampleCounts(6, 3), [1.91, 1.90], expected_gbps=2.059,
                             defaults_gbps=1.875) == 5.0


def _record_baseline(state: Path, busbw: float) -> int:
    """A finished sweep that kept NCCL's defaults, three repeats at each verify size (about 1% noise)."""
    with Store(state / "history.db") as store:
        fingerprint = store.runs(limit=1, kind="sweep")[0].fingerprint
        run_id = store.start_run(kind="sweep", fingerprint=fingerprint, backend="gloo", demo=True, profile=None,
                                 nccl_version="2.21.5", driver_version=None, torch_version=None,
                                 nccltune_version=__version__, hostname=socket.gethostname(), topology={},
                                 config={})
        for seq, factor in enumerate((1.0, 1.01, 0.99), start=1):
            store.add_trial(run_id, seq=seq, phase="baseline", label=f"defaults #{seq}", env={}, status="ok",
                            measurements=[Measurement(size_bytes=s, time_us=1.0, algbw_gbps=busbw * factor,
                                                      busbw_gbps=busbw * factor) for s in DEMO_VERIFY_SIZES])
        store.finish_run(run_id, status="ok", summary={"chosen": "NCCL defaults"},
                         rows=[ReportRow.from_dict({"size_bytes": s, "default_busbw_gbps": busbw,
                                                    "tuned_busbw_gbps": busbw, "default_noise_pct": 1.0})
                               for s in DEMO_VERIFY_SIZES])
    return run_id


def test_baseline_fails_a_measurement_slower_than_that_run_beyond_noise(config: Path, state: Path,
                                                                        fake_python: Path) -> None:
    base = _record_baseline(state, 2.0)
    same = _verify_with({s: 2.0 for s in DEMO_VERIFY_SIZES}, config, state, fake_python, threshold_pct=90.0,
                        use_current=True, baseline_run=base)
    assert same.passed and same.code == "passed", same.reason
    # 25% slower at every size: within the 90% drift allowed, but beyond the baseline's noise.
    slow = _verify_with({s: 1.5 for s in DEMO_VERIFY_SIZES}, config, state, fake_python, threshold_pct=90.0,
                        use_current=True, baseline_run=base)
    assert not slow.passed and slow.code == "slower_than_baseline"
    assert slow.reason.startswith(f"3 size(s) slower than run {base} beyond the noise")
    without = _verify_with({s: 1.5 for s in DEMO_VERIFY_SIZES}, config, state, fake_python, threshold_pct=90.0,
                           use_current=True)
    assert without.passed, without.reason


def test_baseline_run_that_does_not_exist_is_a_usage_error(config: Path, state: Path) -> None:
    rc, _out, err = cli("verify", "--demo", SNAPSHOT, "--config", config, "--state-dir", state, "--current",
                        "--baseline", "999")
    assert rc == 2 and "--baseline 999: no such run" in err


# -- with a class profile in force: the node against its class ----------------------------------------


def _class_profile(state: Path, directory: Path, medians: dict[int, tuple[float, float]],
                   noise: dict[int, tuple[float, float]]) -> Path:
    """A class profile of two demo nodes whose per-node numbers of the chosen setting are these
    (size -> (node 1, node 2) median GB/s and noise %), as `fleet decide` would write them."""
    from fleet_fixtures import demo_profile

    from nccltune.fleet.decide import dumps_profile
    from nccltune.fleet.outlier import chosen_setting

    directory.mkdir()
    path = directory / "profile.json"
    doc = demo_profile(state, SNAPSHOT, path)
    setting = chosen_setting(doc)
    assert setting is not None
    for i, node in enumerate(doc["evidence"]["nodes"]):
        node["per_size"] = [{"setting": setting[0], "topology_file": setting[1], "collective": "all_reduce",
                             "size_bytes": size, "samples": 3, "median_busbw_gbps": medians[size][i],
                             "noise_pct": noise[size][i]} for size in sorted(medians)]
    path.write_text(dumps_profile(doc))
    return path


def test_a_class_size_whose_allowed_drop_reaches_100_percent_is_named_not_passed(
        config: Path, state: Path, tmp_path: Path, fake_python: Path) -> None:
    """Class numbers with 60% noise at 1 MiB allow a 120% drop there: no measurement can fail it, so
    the size is left out of the verdict and named, as against the node's own sweep."""
    from nccltune.fleet.apply import apply_profile

    medians = {262144: (1.0, 1.0), 1 << 20: (4.0, 4.4), 4 << 20: (8.0, 8.0)}
    noise = {262144: (0.5, 0.5), 1 << 20: (60.0, 60.0), 4 << 20: (0.5, 0.5)}
    profile = _class_profile(state, tmp_path / "noisy", medians, noise)
    apply_profile(_cfg(config, state), profile, demo=str(SNAPSHOT))
    result = _verify_with({262144: 1.0, 1 << 20: 0.1, 4 << 20: 8.0}, config, state, fake_python, threshold_pct=5.0)
    row = next(r for r in result.rows if r.size_bytes == 1 << 20)
    assert row.allowed_pct == pytest.approx(120.0) and not row.verifiable
    assert result.code == "passed" and "not verifiable" in result.reason and "1MiB (allowed -120%)" in result.reason
    assert "at 2 size(s)" in result.reason


def test_with_a_class_profile_verify_compares_the_node_with_its_class(config: Path, state: Path, tmp_path: Path,
                                                                      fake_python: Path) -> None:
    """Hand-worked: at 1 MiB the class's nodes measured 4.0 and 4.4 GB/s (median 4.2, the lowest
    4.76% below it), with 1% and 3% noise (typical 2%: twice is 4%); with a 5% threshold the node
    may fall 5% below 4.2 (to 3.99). 4.05 passes, 3.90 (7.1% below) does not."""
    from nccltune.checks.doctor import class_findings
    from nccltune.fleet.apply import apply_profile

    medians = {262144: (1.0, 1.0), 1 << 20: (4.0, 4.4), 4 << 20: (8.0, 8.0)}
    noise = {262144: (0.5, 0.5), 1 << 20: (1.0, 3.0), 4 << 20: (0.5, 0.5)}
    profile = _class_profile(state, tmp_path / "narrow", medians, noise)
    apply_profile(_cfg(config, state), profile, demo=str(SNAPSHOT))
    within = {262144: 1.0, 1 << 20: 4.05, 4 << 20: 8.0}
    result = _verify_with(within, config, state, fake_python, threshold_pct=5.0)
    assert result.passed, result.reason
    assert result.reference == "class" and result.expectation.startswith("class profile profile.json (class ")
    row = next(r for r in result.rows if r.size_bytes == 1 << 20)
    assert (row.expected_gbps, row.allowed_pct, row.ok) == (pytest.approx(4.2), pytest.approx(5.0), True)
    assert row.drift_pct == pytest.approx(100 * (4.05 / 4.2 - 1))
    below = {**within, 1 << 20: 3.9}
    result = _verify_with(below, config, state, fake_python, threshold_pct=5.0)
    assert not result.passed and result.code == "below_class"
    class_id = json.loads(profile.read_text())["node_class"]["id"]
    assert result.reason == (f"1MiB: 3.90 GB/s is 7.1% below the median 4.20 GB/s of the 2 node(s) of its class "
                             f"{class_id} (allowed 5.0%)")
    # The class's own spread widens the bar: had its lowest node been 10% below the median, 3.90 is within.
    wide = _class_profile(state, tmp_path / "wide", {**medians, 1 << 20: (3.78, 4.62)}, noise)
    apply_profile(_cfg(config, state), wide, demo=str(SNAPSHOT))
    assert _verify_with(below, config, state, fake_python, threshold_pct=5.0).passed
    # Back to the narrow class, by hand: exit 1, doctor's finding, the metric.
    apply_profile(_cfg(config, state), profile, demo=str(SNAPSHOT))
    with mock.patch.dict(os.environ, {"FAKE_BUSBW": json.dumps({str(k): v for k, v in below.items()})}):
        rc, out, err = cli("verify", "--demo", SNAPSHOT, "--config", config, "--state-dir", state, "--python",
                           fake_python, "--threshold", "5", "--json")
    assert rc == 1, err
    assert json.loads(out)["code"] == "below_class"
    with Store(state / "history.db") as store:
        fingerprint = store.runs(limit=1, kind="verify")[0].fingerprint
        (finding,) = class_findings(store, fingerprint)
    assert (finding.severity, finding.code) == ("warning", "class-outlier")
    assert f"below its class {class_id}" in finding.message and "1048576 B -7.1% (allowed -5.0%)" in finding.message
    rc, out, _err = cli("doctor", "--demo", SNAPSHOT, "--config", config, "--state-dir", state, "--json")
    assert "class-outlier" in [f["code"] for f in json.loads(out)["findings"]]
    metrics = (state / "metrics" / "nccltune.prom").read_text()
    assert f'nccltune_class_outlier{{class="{class_id}"}} 1.0' in metrics
