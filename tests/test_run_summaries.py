"""A run's summary as typed records (nccltune/store/summaries.py): each kind of document the history
has kept reads back and writes out key for key, older documents read with defaults, a field of the
wrong type is named, and the store writes and reads the records."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from demo_state import DemoSweep

from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.store import ImportSummary, Store, SummaryError, SweepSummary, VerifyRow, VerifySummary

META: dict[str, Any] = dict(fingerprint="fp", backend="gloo", demo=True, profile=None, nccl_version=None,
                            driver_version=None, torch_version=None, nccltune_version="0", hostname="h",
                            topology={}, config={})

# Each document as the writers have stored it (their dict literals, before the records).
MEASURED_SWEEP = {
    "chosen": "NCCL_ALGO=Ring", "summary": "[CPU demo] Ring 3% faster", "nccl_version": None,
    "torch_version": "2.13.0", "method": "in-place; host clock", "trials": 7,
    "failed": [["NCCL_ALGO=Tree", "timeout"]], "plan_pruned": 2, "collectives": ["all_reduce"],
    "not_measured": {"all_to_all": "gloo: no one-rank send"},
    "tuner_table": {"status": "off", "published": None},
}
SHAPE_SWEEP = {**MEASURED_SWEEP, "job": {"label": "2x2", "nnodes": 2, "ranks_per_node": 2},
               "not_published": "measured for the job shape 2x2: a class profile decides for it"}
IMAGE_SWEEP = {**MEASURED_SWEEP, "image": {"image": "img@sha256:" + "ab" * 32, "image_digest": "sha256:" + "ab" * 32,
                                           "runtime": "podman", "image_os": "Debian GNU/Linux 12 (bookworm)"}}
UNMEASURED_SWEEP = {"chosen": "nothing measured", "summary": "one GPU", "trials": 0, "failed": [], "plan_pruned": 0}
ENDED_SWEEP = {"error": "KeyboardInterrupt", "trials": 3}
ENDED_AFTER_PUBLISH = {"error": "SIGTERM", "trials": 5, "ended_after_publish": 4}
RECOVERED_SWEEP = {"chosen": "as published", "trials": 5, "summary": "ended after publishing generation 4"}
ROW = {"size_bytes": 4096, "measured_gbps": 0.5, "expected_gbps": 0.49, "allowed_pct": 10.0, "drift_pct": 2.0,
       "ok": True, "collective": "all_reduce", "verifiable": True}
VERIFY = {"passed": True, "code": "passed", "reason": "bus bandwidth as expected", "expectation": "sweep 1",
          "rows": [ROW], "env_source": "published", "method": None, "reference": "sweep", "checked": "all_reduce",
          "class_profile": None, "nccl_ran": None}
ONE_GPU_VERIFY = {"passed": False, "code": "plugin_not_loaded", "reason": "no plugin", "expectation": "the set",
                  "env_source": "published", "reference": "none", "checked": "rank 0", "nccl_ran": {"passed": False},
                  "one_gpu": {"outcomes": []}}
INTERRUPTED_VERIFY = {"error": "interrupted"}
IMPORT = {
    "chosen": "all_reduce_perf (nccl-tests)", "summary": "imported x.json", "source_file": "x.json",
    "collective": "all_reduce", "binary": "all_reduce_perf", "nranks": 8, "placement": "out_of_place",
    "method": "out-of-place; all_reduce_perf (nccl-tests document)", "datatype": "float", "redop": "sum", "root": 0,
    "counts": {"1024": 256}, "cycles": 1, "nccl_version": None, "trials": 2, "notes": [], "not_measured": {},
    "document": {"version": 1, "start_time": None},
}
FAILED_IMPORT = {"error": "the import stopped before its last trial", "trials": 1}


@pytest.mark.parametrize(("record", "doc"), [
    (SweepSummary, MEASURED_SWEEP), (SweepSummary, SHAPE_SWEEP), (SweepSummary, IMAGE_SWEEP),
    (SweepSummary, UNMEASURED_SWEEP),
    (SweepSummary, ENDED_SWEEP), (SweepSummary, ENDED_AFTER_PUBLISH), (SweepSummary, RECOVERED_SWEEP),
    (VerifySummary, VERIFY), (VerifySummary, ONE_GPU_VERIFY), (VerifySummary, INTERRUPTED_VERIFY),
    (ImportSummary, IMPORT), (ImportSummary, FAILED_IMPORT),
])
def test_every_stored_document_reads_and_writes_back_key_for_key(record: Any, doc: dict[str, Any]) -> None:
    assert record.from_doc(doc).to_doc() == doc


def test_the_writers_constructors_give_the_documents_they_always_wrote() -> None:
    assert SweepSummary.ended("KeyboardInterrupt", 3).to_doc() == ENDED_SWEEP
    assert SweepSummary.ended("SIGTERM", 5, ended_after_publish=4).to_doc() == ENDED_AFTER_PUBLISH
    assert VerifySummary(error="interrupted").to_doc() == INTERRUPTED_VERIFY
    # A measured sweep names its versions and method even where nothing reported them.
    bare = SweepSummary(chosen="x", collectives=("all_reduce",)).to_doc()
    assert (bare["nccl_version"], bare["torch_version"], bare["method"]) == (None, None, None)
    # A verify row's document is the one verify stored with vars(row).
    assert VerifyRow.from_doc(ROW).to_doc() == ROW and list(VerifyRow.from_doc(ROW).to_doc()) == list(ROW)


def test_older_documents_read_with_the_defaults_of_what_they_lack() -> None:
    old_row = {"size_bytes": 1 << 20, "measured_gbps": 12.5, "expected_gbps": 25.0, "allowed_pct": 5.0,
               "drift_pct": -50.0, "ok": False}
    (row,) = VerifySummary.from_doc({"passed": False, "rows": [old_row]}).rows or ()
    assert (row.collective, row.verifiable, row.ok) == ("all_reduce", True, False)
    assert SweepSummary.from_doc({}) == SweepSummary()
    assert SweepSummary.from_doc({"chosen": "x"}).job_nnodes == 1
    assert SweepSummary.from_doc(SHAPE_SWEEP).job_nnodes == 2
    # A key this nccltune does not know (a newer one's) is left alone, not refused.
    assert SweepSummary.from_doc({"chosen": "x", "later_field": 1}).chosen == "x"


@pytest.mark.parametrize(("record", "doc", "field"), [
    (SweepSummary, {"trials": "3"}, "trials"),
    (SweepSummary, {"trials": True}, "trials"),
    (SweepSummary, {"failed": [["only a label"]]}, "failed"),
    (SweepSummary, {"not_measured": {"broadcast": 3}}, "not_measured"),
    (SweepSummary, {"image": {"image_digest": 7}}, "image"),
    (VerifySummary, {"passed": "yes"}, "passed"),
    (VerifySummary, {"rows": [{"size_bytes": 8, "drift_pct": "-3"}]}, "rows.drift_pct"),
    (VerifySummary, {"rows": [{"ok": True}]}, "rows.size_bytes"),
    (ImportSummary, {"counts": {"1024": "256"}}, "counts"),
])
def test_a_field_of_the_wrong_type_is_named(record: Any, doc: dict[str, Any], field: str) -> None:
    with pytest.raises(SummaryError) as got:
        record.from_doc(doc)
    assert got.value.name == field and str(got.value).startswith(f"{field}: ")


def test_the_store_writes_the_records_document_and_reads_it_typed(tmp_path: Path) -> None:
    with Store(tmp_path / "history.db") as store:
        sweep = store.start_run(kind="sweep", **META)
        store.finish_run(sweep, status="ok", summary=SweepSummary.from_doc(SHAPE_SWEEP))
        verify = store.start_run(kind="verify", **META)
        store.finish_run(verify, status="ok", summary=VerifySummary.from_doc(VERIFY))
        bad = store.start_run(kind="sweep", **META)
        store.finish_run(bad, status="ok", summary={"chosen": "x", "trials": "seven"})
        sweep_run, verify_run, bad_run = store.run(sweep), store.run(verify), store.run(bad)
    assert sweep_run is not None and verify_run is not None and bad_run is not None
    raw = sqlite3.connect(tmp_path / "history.db")
    stored = dict(raw.execute("SELECT id, summary_json FROM runs").fetchall())
    raw.close()
    assert json.loads(stored[sweep]) == SHAPE_SWEEP and json.loads(stored[verify]) == VERIFY
    assert sweep_run.sweep_summary.job_nnodes == 2 and sweep_run.outcome == SweepSummary.from_doc(SHAPE_SWEEP)
    assert verify_run.verify_summary.rows == (VerifyRow.from_doc(ROW),)
    with pytest.raises(TypeError, match="verify run"):
        _ = verify_run.sweep_summary
    with pytest.raises(InputError) as got:
        _ = bad_run.outcome
    assert got.value.exit_code == EXIT_CONFIG
    assert f"history run {bad}" in str(got.value) and "summary field trials" in str(got.value)


def test_a_real_sweeps_summary_is_the_record_it_reads_as(demo_sweep: DemoSweep) -> None:
    """The demo sweep's stored summary (the report rows live in their own table) is its record's document."""
    raw = sqlite3.connect(demo_sweep.state / "history.db")
    (text,) = raw.execute("SELECT summary_json FROM runs WHERE kind = 'sweep' ORDER BY id DESC LIMIT 1").fetchone()
    raw.close()
    doc = json.loads(text)
    record = SweepSummary.from_doc(doc)
    assert record.to_doc() == doc
    assert record.chosen == demo_sweep.doc["chosen"] and record.trials == demo_sweep.doc["trials"]
    assert record.collectives is not None and record.error is None
