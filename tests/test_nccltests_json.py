"""nccl-tests' JSON document (-J, format version 3): `report --format nccl-tests-json` writes one,
`import` reads one into the history as a run of kind "import", and `compare` puts it beside
nccltune's own runs. The checked-in document is hand-made from the format (keys and number
formatting as nccl-tests' writer produces them) with the numbers of the recorded 2x H200 table
in all_reduce_perf.default.txt; malformed variants of it are refused with exit 78."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from conftest import NCCL_TESTS_OUTPUT, REPO
from demo_state import DemoSweep, clean_env, copy_state

from nccltune.cli import main
from nccltune.compare import compare_runs, upgrade_check
from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.fleet.jsonschema import validate
from nccltune.records import Measurement, ReportRow
from nccltune.report.nccltests_json import import_document, parse_document, version_code, version_of_code
from nccltune.store import Store
from nccltune.trials.nccltests import parse_output

FIXTURE = NCCL_TESTS_OUTPUT / "all_reduce_perf.v3-2rank.handmade.json"
TABLE = NCCL_TESTS_OUTPUT / "all_reduce_perf.default.txt"
SCHEMAS = REPO / "schemas"
MiB = 1 << 20


def schema(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return doc


def cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, clean_env(), clear=True), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def fixture_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(FIXTURE.read_text())
    return doc


# -- the format -----------------------------------------------------------------------------------


def test_the_hand_made_document_has_nccl_tests_shape() -> None:
    doc = fixture_doc()
    validate(doc, schema("nccl-tests"))
    # As nccl-tests' writer lays it out: version first, end_time last, devices inside config,
    # booleans as text, the root column as 6-wide text, doubles with six decimals.
    assert next(iter(doc)) == "version" and list(doc)[-1] == "end_time" and doc["version"] == 3
    assert doc["config"]["devices"][0]["hostname"] == "vm" and doc["config"]["blocking_collectives"] == "false"
    assert doc["results"][0]["root"] == "    -1"
    assert '"bus_bw":0.050000' in FIXTURE.read_text()


def test_nccls_version_code() -> None:
    assert version_code("2.28.9") == 22809 and version_of_code(22809) == "2.28.9"
    assert version_code("2.28.9+cuda13.0") == 22809
    assert version_code("2.7.8") == 2708 and version_of_code(2708) == "2.7.8"
    assert version_code(None) is None and version_code("n/a") is None


def test_the_document_reads_as_the_same_binarys_table() -> None:
    got = parse_document(FIXTURE.read_bytes(), str(FIXTURE))
    rows, version = parse_output(TABLE.read_text())
    assert (got.collective, got.binary, got.nranks, got.nccl_version) == ("all_reduce", "all_reduce_perf", 2, version)
    assert (got.datatype, got.redop, got.root, got.checked, got.hostname) == ("float", "sum", -1, True, "vm")
    (cycle,) = got.cycles
    assert [(r.size_bytes, r.time_us, r.algbw_gbps, r.busbw_gbps) for r in cycle["out_of_place"]] == \
        [(r.size_bytes, r.time_us, r.algbw_gbps, r.busbw_gbps) for r in rows]
    assert [r.busbw_gbps for r in cycle["in_place"]] == [r.inplace_busbw_gbps for r in rows]
    assert got.counts[MiB] == MiB // 4 and got.primary == "out_of_place" and got.notes == []


def test_a_document_all_reduce_perf_wrote_on_a_one_gpu_node_imports() -> None:
    """all_reduce_perf (nccl-tests 2.19.6, built against NCCL 2.28.9) run with -g 1 -J on a 1x H200
    node; its environment list is cut to the NCCL variables, as the rest describes that machine."""
    path = NCCL_TESTS_OUTPUT / "all_reduce_perf.v3-1rank.h200.json"
    got = parse_document(path.read_bytes(), str(path))
    assert (got.collective, got.binary, got.nranks, got.nccl_version) == ("all_reduce", "all_reduce_perf", 1, "2.28.9")
    (cycle,) = got.cycles
    out = cycle["out_of_place"]
    assert [r.size_bytes for r in out] == [4096 * 4**i for i in range(8)]
    # One rank: the bus factor is 0, so busbw is 0 and algbw carries the number.
    assert all(r.busbw_gbps == 0.0 and r.nwrong == 0 for r in out)
    assert out[-1].algbw_gbps == pytest.approx(1894.5, abs=0.1)
    assert got.notes == []


def test_only_ncclss_variables_of_the_environment_are_kept() -> None:
    got = parse_document(FIXTURE.read_bytes(), str(FIXTURE))
    # nccl-tests writes the whole environment (tokens included); the history keeps NCCL's variables.
    assert got.env == {"NCCL_DEBUG": "WARN", "NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


# -- import ---------------------------------------------------------------------------------------


def test_import_stores_a_run_that_history_report_and_compare_show(tmp_path: Path) -> None:
    state = tmp_path / "state"
    rc, out, err = cli("import", FIXTURE, "--json", "--state-dir", state)
    assert rc == 0, err
    doc = json.loads(out)
    validate(doc, schema("import"))
    run_id = doc["run_id"]
    assert (doc["backend"], doc["nranks"], doc["nccl_version"], doc["cycles"]) == ("nccl-tests", 2, "2.28.9", 1)
    assert doc["sizes"][0] == {"size_bytes": 1024, "collective": "all_reduce", "count": 256,
                               "out_of_place": {"time_us": 21.87, "algbw_gbps": 0.05, "busbw_gbps": 0.05, "wrong": 0},
                               "in_place": {"time_us": 20.18, "algbw_gbps": 0.05, "busbw_gbps": 0.05, "wrong": 0}}
    with Store(state / "history.db") as store:
        (run,) = store.runs()
        trials = store.trials(run.id)
    assert (run.kind, run.status, run.backend, run.hostname, run.demo) == ("import", "ok", "nccl-tests", "vm", False)
    assert [(t.phase, t.label, t.status) for t in trials] == [("import", "all_reduce_perf out of place #1", "ok"),
                                                              ("import", "all_reduce_perf in place #1", "ok")]
    assert "HF_TOKEN" not in json.dumps([t.env for t in trials]) + json.dumps(run.config)

    rc, out, _ = cli("history", "--state-dir", state)
    assert rc == 0 and "import" in out and "nccl-tests" in out and "all_reduce_perf (nccl-tests)" in out
    rc, out, _ = cli("report", "--run", run_id, "--state-dir", state)
    assert rc == 0 and "out-of-place" in out and "in-place" in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["1073741824"])
    assert row.split() == ["1073741824", "268435456", "float", "sum", "-1", "3261.98", "329.17", "329.17", "0",
                           "3231.45", "332.28", "332.28", "0"]
    rc, out, _ = cli("report", "--run", run_id, "--json", "--state-dir", state)
    report = json.loads(out)
    validate(report, schema("report"))
    assert rc == 0 and report["imported"]["placement"] == "out_of_place" and len(report["imported"]["sizes"]) == 11
    # Written out again, it is the document that came in, number for number.
    rc, out, _ = cli("report", "--run", run_id, "--format", "nccl-tests-json", "--state-dir", state)
    again = json.loads(out)
    validate(again, schema("nccl-tests"))
    assert rc == 0 and again["results"] == fixture_doc()["results"] and again["nccl_version"] == 22809
    assert again["config"]["devices"] == fixture_doc()["config"]["devices"]
    # Compared with itself: the same numbers, size by size.
    rc, out, _ = cli("import", FIXTURE, "--state-dir", state)
    assert rc == 0
    rc, out, _ = cli("compare", run_id, run_id + 1, "--json", "--state-dir", state)
    cmp = json.loads(out)
    assert rc == 0 and {s["verdict"] for s in cmp["sizes"]} == {"same"} and len(cmp["sizes"]) == 11
    assert cmp["sizes"][-1]["a_busbw_gbps"] == 329.17  # out of place: nccl-tests' headline column


def _write(tmp_path: Path, doc: Any, name: str = "doc.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=1))
    return path


def _edit(change: Any) -> Any:
    doc = fixture_doc()
    change(doc)
    return doc


MALFORMED: dict[str, tuple[Any, str]] = {
    "truncated": (FIXTURE.read_text()[:500], r"doc\.json:1: not JSON"),
    "an array": ([1, 2], r"\$: expected an object"),
    "version 2": (_edit(lambda d: d.update(version=2)), r"\$\.version: format version 2; nccltune reads version 3"),
    "no results": (_edit(lambda d: d.pop("results")), r"\$: missing key 'results'"),
    "empty results": (_edit(lambda d: d.update(results=[])), r"\$\.results: no result with numbers"),
    "a word for busbw": (_edit(lambda d: d["results"][3]["out_of_place"].update(bus_bw="fast")),
                         r"\$\.results\[3\]\.out_of_place\.bus_bw: expected a number"),
    "a negative time": (_edit(lambda d: d["results"][0]["in_place"].update(time=-1.0)),
                        r"\$\.results\[0\]\.in_place\.time: expected a number of at least 0"),
    "no time": (_edit(lambda d: d["results"][2]["out_of_place"].pop("time")),
                r"\$\.results\[2\]\.out_of_place: missing key 'time'"),
    "half a wrong element": (_edit(lambda d: d["results"][1]["out_of_place"].update(nwrong=0.5)),
                             r"\$\.results\[1\]\.out_of_place\.nwrong: expected a whole count"),
    "a root that is no rank": (_edit(lambda d: d["results"][4].update(root="all")), r"\$\.results\[4\]\.root"),
    "a size that is text": (_edit(lambda d: d["results"][4].update(size="1M")), r"\$\.results\[4\]\.size"),
    "no device": (_edit(lambda d: d["config"].update(devices=[])), r"\$\.config\.devices: empty"),
    "no ranks per thread": (_edit(lambda d: d["config"].update(ngpus=0)), r"\$\.config\.ngpus"),
    "an unknown binary": (_edit(lambda d: d["args"].__setitem__(0, "./build/hypercube_perf")),
                          r"\$\.args\[0\]: '\./build/hypercube_perf' is not a \*_perf binary nccltune knows"),
    "two data types": (_edit(lambda d: d["results"][5].update(type="half")),
                       r"\$\.results\[5\]: type half, .*several data types"),
    "an env entry that is no text": (_edit(lambda d: d["env"].append(7)), r"\$\.env\[7\]: expected text"),
    "NaN outside a string": (FIXTURE.read_text().replace('"bus_bw":0.050000', '"bus_bw":NaN', 1),
                             r"not an nccl-tests document: NaN is not JSON"),
    "the text table": (TABLE.read_text(), r"doc\.json:1: not JSON"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_document_is_refused_with_exit_78_and_nothing_is_stored(tmp_path: Path, case: str) -> None:
    doc, message = MALFORMED[case]
    path = _write(tmp_path, doc)
    with pytest.raises(InputError, match=message) as info:
        parse_document(path.read_bytes(), str(path))
    assert str(path) in str(info.value)
    state = tmp_path / "state"
    rc, _out, err = cli("import", path, "--state-dir", state)
    assert rc == EXIT_CONFIG and str(path) in err, err
    assert not (state / "history.db").exists()


def test_a_broken_document_names_its_line(tmp_path: Path) -> None:
    text = json.dumps(fixture_doc(), indent=1).replace('"alg_bw": 2.9', '"alg_bw": 2.9.1', 1)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "2.9.1" in t)
    path = _write(tmp_path, text)
    rc, _out, err = cli("import", path, "--state-dir", tmp_path / "state")
    assert rc == EXIT_CONFIG and f"{path}:{line}: not JSON" in err


def test_the_text_table_gets_a_hint_to_write_json(tmp_path: Path) -> None:
    rc, _out, err = cli("import", TABLE, "--state-dir", tmp_path / "state")
    assert rc == EXIT_CONFIG and "run it with -J FILE.json" in err


def test_a_directory_is_no_document(tmp_path: Path) -> None:
    rc, _out, err = cli("import", tmp_path, "--state-dir", tmp_path / "state")
    assert rc == EXIT_CONFIG and "is a directory" in err


def test_a_renamed_binary_needs_collective_and_a_known_one_must_agree(tmp_path: Path) -> None:
    path = _write(tmp_path, _edit(lambda d: d["args"].__setitem__(0, "/opt/bin/ar_perf_custom")))
    assert parse_document(path.read_bytes(), str(path), collective="all_reduce").collective == "all_reduce"
    with pytest.raises(InputError, match=r"measures all_reduce, not all_gather"):
        parse_document(FIXTURE.read_bytes(), str(FIXTURE), collective="all_gather")
    rc, _out, err = cli("import", FIXTURE, "--collective", "allreduce", "--state-dir", tmp_path / "state")
    assert rc == 2 and "all_reduce" in err and "sendrecv" in err  # argparse lists the names


def _cycles_doc() -> dict[str, Any]:
    """Two cycles (-N 2) of three sizes, the second slower at 1 MiB, and a "nan" nccl-tests wrote."""
    doc = fixture_doc()
    first = [r for r in doc["results"] if r["size"] in (65536, MiB, 4 * MiB)]
    second = json.loads(json.dumps(first))
    second[1]["out_of_place"].update(time=47.48, alg_bw=22.085, bus_bw=22.085)
    second[2]["in_place"].update(time="nan", alg_bw="nan", bus_bw="nan")
    doc["results"] = first + second
    return doc


def test_cycles_become_trials_and_nan_is_left_out(tmp_path: Path) -> None:
    path = _write(tmp_path, _cycles_doc())
    got = parse_document(path.read_bytes(), str(path))
    assert len(got.cycles) == 2 and [len(c["in_place"]) for c in got.cycles] == [3, 2]
    assert any("4194304 B in place" in n and "left out" in n for n in got.notes)
    with Store(tmp_path / "history.db") as store:
        run_id = import_document(store, got, fingerprint="unknown")
        assert [t.label for t in store.trials(run_id)] == [
            "all_reduce_perf out of place #1", "all_reduce_perf in place #1",
            "all_reduce_perf out of place #2", "all_reduce_perf in place #2"]
        # compare takes the out-of-place trials: the median of two cycles, and their spread as noise.
        got_cmp = compare_runs(store, run_id, run_id)
    one = next(s for s in got_cmp.sizes if s.size_bytes == MiB)
    assert one.a_busbw_gbps == pytest.approx((44.17 + 22.085) / 2) and one.noise_pct > 30


def test_wrong_elements_make_a_wrong_result_trial(tmp_path: Path) -> None:
    path = _write(tmp_path, _edit(lambda d: d["results"][2]["out_of_place"].update(nwrong=12.0)))
    with Store(tmp_path / "history.db") as store:
        run_id = import_document(store, parse_document(path.read_bytes(), str(path)), fingerprint="unknown")
        out_of_place, in_place = store.trials(run_id)
    assert (out_of_place.status, out_of_place.reason) == ("wrong_result", "#wrong at 1 size(s): 16384 B: 12")
    assert in_place.status == "ok"
    assert [m.correct for m in out_of_place.measurements][:4] == [True, True, False, True]


def test_a_bus_factor_for_other_ranks_is_a_note(tmp_path: Path) -> None:
    # Four ranks listed, but busbw == algbw: a 2-rank all-reduce's factor, not 4 ranks' 1.5.
    path = _write(tmp_path, _edit(lambda d: d["config"].update(ngpus=4)))
    got = parse_document(path.read_bytes(), str(path))
    assert got.nranks == 4 and any("not 1.5000" in n for n in got.notes)


# -- imports are never a sweep's result ------------------------------------------------------------

FP = "0123456789abcdef"


def _sweep(store: Store, nccl: str, busbw: float) -> int:
    run = store.start_run(kind="sweep", fingerprint=FP, backend="nccl", demo=False, profile="balanced",
                          nccl_version=nccl, driver_version="570.1", torch_version="2.7.0", nccltune_version="0",
                          hostname="vm", topology={"gpus": 2}, config={})
    for seq in (1, 2):
        store.add_trial(run, seq=seq, phase="baseline", label=f"defaults #{seq}", env={}, status="ok",
                        measurements=[Measurement(MiB, 100.0, busbw, busbw)])
    row = ReportRow(MiB, 1.0, busbw, 1.0, busbw, 1.0)
    store.finish_run(run, status="ok", summary={"chosen": "NCCL defaults", "nccl_version": nccl}, chosen_env={},
                     published_generation=1, rows=[row])
    return run


def test_no_reader_of_a_sweeps_result_takes_an_import(tmp_path: Path) -> None:
    from nccltune.fleet.export import select_run_ids
    from nccltune.metrics import snapshot_from_store

    state = tmp_path / "state"
    state.mkdir()
    with Store(state / "history.db") as store:
        first = _sweep(store, "2.21.5", 100.0)
        sweep = _sweep(store, "2.28.9", 100.0)
        # Newer than both, same topology, another NCCL and much slower: taken for a sweep, it
        # would be the latest run, the verify baseline, an upgrade and a regression.
        imported = import_document(store, parse_document(FIXTURE.read_bytes(), str(FIXTURE)), fingerprint=FP)
        latest = store.latest_run(FP)
        assert latest is not None and latest.id == sweep
        assert [(r.size_bytes, r.default_busbw_gbps) for r in latest.rows] == [(MiB, 100.0)]  # verify's baseline
        published = store.latest_published(FP)
        assert published is not None and published.run_id == sweep
        run = store.run(sweep)
        assert run is not None
        check = upgrade_check(store, run, warn=False)
        assert check is not None and check.previous_run_id == first
        assert select_run_ids(store, FP, None) == [first, sweep]
        with pytest.raises(InputError, match="not an ok sweep"):
            select_run_ids(store, FP, imported)
        snap = snapshot_from_store(store, fingerprint=FP)
        assert snap.sweeps_total == 2
        assert [r.id for r in store.runs(limit=None)][:1] == [imported]  # history shows it
    rc, out, _ = cli("report", "--json", "--state-dir", state)
    assert rc == 0 and json.loads(out)["run"]["id"] == sweep  # the last sweep, not the import


# -- the round trip through the demo sweep ------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_state(demo_sweep: DemoSweep, tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoSweep, Path]:
    state = tmp_path_factory.mktemp("ntjson") / "state"
    copy_state(demo_sweep.state, state)
    return demo_sweep, state


def test_report_import_compare_round_trip_gives_the_same_numbers(demo_state: tuple[DemoSweep, Path],
                                                                   tmp_path: Path) -> None:
    sweep, state = demo_state
    run_id = sweep.doc["run_id"]
    common = ["--config", sweep.config, "--state-dir", state]
    for setting in ("published", "defaults"):
        rc, out, err = cli("report", "--format", "nccl-tests-json", "--setting", setting, *common)
        assert rc == 0, err
        assert f"run {run_id} (the last sweep" in err and "median of" in err  # says what it wrote
        doc = json.loads(out)
        validate(doc, schema("nccl-tests"))
        own = doc["nccltune"]
        assert own["demo"] is True and own["backend"] == "gloo" and own["run_id"] == run_id
        # The demo's worker measures through torch.distributed, in place: out_of_place is left empty.
        assert {r["out_of_place"] is None for r in doc["results"]} == {True}
        assert doc["config"]["ngpus"] * len(doc["config"]["devices"]) == 2 and doc["nccl_version"] is None
        path = _write(tmp_path, out, f"{setting}.json")
        rc, out, err = cli("import", path, "--json", *common)
        assert rc == 0, err
        imported = json.loads(out)
        assert imported["demo"] is True and imported["label"] and imported["placement"] == "in_place"
        rc, out, _ = cli("compare", run_id, imported["run_id"], "--side", setting, "--json", *common)
        cmp = json.loads(out)
        assert rc == 0 and cmp["sizes"] and {s["verdict"] for s in cmp["sizes"]} == {"same"}
        for s in cmp["sizes"]:
            # Equal: the document keeps every digit of the medians it wrote.
            assert (s["a_busbw_gbps"], s["change_pct"]) == (s["b_busbw_gbps"], 0.0)


def test_one_trial_is_written_as_measured(demo_state: tuple[DemoSweep, Path]) -> None:
    sweep, state = demo_state
    run_id = sweep.doc["run_id"]
    with Store(state / "history.db") as store:
        trial = store.trials(run_id)[0]
    rc, out, err = cli("report", "--format", "nccl-tests-json", "--run", run_id, "--trial", trial.seq,
                       "--config", sweep.config, "--state-dir", state)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["nccltune"]["trials"] == [trial.seq]
    measured = {m.size_bytes: m for m in trial.measurements}
    assert [r["size"] for r in doc["results"]] == sorted(measured)
    for r in doc["results"]:
        m = measured[r["size"]]
        assert r["in_place"] == {"time": m.time_us, "alg_bw": m.algbw_gbps, "bus_bw": m.busbw_gbps,
                                 "nwrong": 0.0 if m.correct else 1.0}
        assert r["count"] == r["size"] // 4 and r["type"] == "float" and r["redop"] == "sum"


def test_report_refuses_what_it_cannot_write(demo_state: tuple[DemoSweep, Path]) -> None:
    sweep, state = demo_state
    common = ["--config", sweep.config, "--state-dir", state]
    rc, _out, err = cli("report", "--trial", "1", *common)
    assert rc == 2 and "only with --format nccl-tests-json" in err
    rc, _out, err = cli("report", "--format", "nccl-tests-json", "--collective", "allgather", *common)
    assert rc == 2 and "all_gather" in err and "all_to_all" in err
    rc, _out, err = cli("report", "--format", "nccl-tests-json", "--collective", "all_gather", *common)
    assert rc == 1 and "no all_gather measurements (it measured all_reduce)" in err
    rc, _out, err = cli("report", "--format", "nccl-tests-json", "--trial", "999", *common)
    assert rc == 2 and "has no trial 999" in err
    rc, _out, err = cli("report", "--format", "nccl-tests-json", "--json", *common)
    assert rc == 2 and "contradict" in err
