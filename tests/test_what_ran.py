"""verify's proof of what NCCL ran (nccl/ran.py), on real NCCL 2.28.9 logs recorded on a one-GPU H200
node with 2 and 4 NCCL hosts (fixtures/nccllog/h200x1-nccl-hosts; the table-* logs ran nccltune's
plugin built on that node with a one-entry table `allreduce 0 <max> 2 2 1 <algo> <proto> 0`)."""

from __future__ import annotations

from pathlib import Path

from nccltune.nccl.debuglog import parse_nccl_log
from nccltune.nccl.ran import CODES, what_ran
from nccltune.tuner.table import TableEntry, TunerTable

FIXTURES = Path(__file__).parent / "fixtures" / "nccllog" / "h200x1-nccl-hosts"
PLUGIN = "/tmp/tp/libnccl-tuner-nccltune.so"
# The allreduce sizes the recorded jobs logged choices for (warm-up's 4 bytes, then 4 KiB ... 256 MiB).
LOGGED = {4, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20}


def _log(name: str) -> str:
    return (FIXTURES / name).read_text()


def _table(algo: str, proto: str, nnodes: int = 2) -> TunerTable:
    return TunerTable("0123abcd4567ef89",
                      (TableEntry("allreduce", 0, 1 << 40, nnodes, nnodes, 1, algo, proto, 0, nccl="2.28.9"),))


def _env(table: str = "/tmp/tp/ll.table", **extra: str) -> dict[str, str]:
    return {"NCCL_TUNER_PLUGIN": PLUGIN, "NCCLTUNE_TUNER_TABLE": table, "NCCL_NVLS_ENABLE": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", **extra}


def test_the_table_nccl_followed_passes_with_every_cell_checked() -> None:
    got = what_ran(parse_nccl_log(_log("table-ring-ll-2x1.rank0.nccl.log")), _env(), _table("ring", "ll"))
    assert got.passed, got.findings
    assert got.tuner == "nccltune (v5)" and got.table == "/tmp/tp/ll.table"
    assert got.shape == (2, 2, 1)
    assert got.cells_checked == len(LOGGED)
    # TORCH_ and NCCLTUNE_ variables are not NCCL's: never looked for in its log
    assert got.variables == {"NCCL_NVLS_ENABLE": "0", "NCCL_TUNER_PLUGIN": PLUGIN}


def test_a_table_nccl_did_not_follow_fails_naming_the_sizes() -> None:
    got = what_ran(parse_nccl_log(_log("table-ring-ll-2x1.rank0.nccl.log")), _env(), _table("tree", "simple"))
    assert [f.code for f in got.findings] == ["table_not_applied"]
    assert "allreduce 4096 B: NCCL ran RING/LL, the table says tree/simple" in got.findings[0].message
    assert "(+2 more)" in got.findings[0].message  # 10 sizes, 8 shown


def test_the_tree_table_was_followed_too() -> None:
    got = what_ran(parse_nccl_log(_log("table-tree-simple-2x1.rank0.nccl.log")), _env("/tmp/tp/tree.table"),
                   _table("tree", "simple"))
    assert got.passed, got.findings
    assert got.cells_checked > 0


def test_a_shape_the_table_does_not_hold_keeps_ncclss_choices_and_passes() -> None:
    """4 hosts under a 2x1 table: the plugin applies nothing, NCCL keeps RING/SIMPLE at large sizes."""
    got = what_ran(parse_nccl_log(_log("table-ring-ll-other-shape-4x1.rank0.nccl.log")),
                   _env(NCCL_TUNER_PLUGIN="/tmp/tp/t.so"), _table("ring", "ll"))
    assert got.passed, got.findings
    assert got.shape == (4, 4, 1) and got.cells_checked == 0


def test_a_stale_or_malformed_table_is_named_with_its_code() -> None:
    # The recorded job's own INFO lines with the plugin's WARNs of a malformed and a stale table in
    # place of its "using table" line (those WARNs were recorded under NCCL_DEBUG=WARN).
    info = [line for line in _log("table-ring-ll-2x1.rank0.nccl.log").splitlines() if "using table" not in line]
    warns = [line for line in _log("table-malformed-and-stale.warn.log").splitlines() if "nccltune tuner" in line]
    got = what_ran(parse_nccl_log("\n".join(info + warns)), _env(), _table("ring", "ll"))
    assert sorted({f.code for f in got.findings}) == ["table_malformed", "table_stale"]
    assert got.table is None and got.cells_checked == 0


def test_no_plugin_loaded_and_a_variable_nccl_read_otherwise() -> None:
    got = what_ran(parse_nccl_log(_log("defaults-2hosts.rank0.nccl.log")),
                   _env(NCCL_NVLS_ENABLE="1", NCCL_IB_HCA="mlx5_0"), _table("ring", "ll"))
    codes = [f.code for f in got.findings]
    assert codes == ["variable_differs", "plugin_not_loaded"]
    assert "NCCL_NVLS_ENABLE: published '1', NCCL ran with '0'" in got.findings[0].message
    assert got.unconfirmed == ["NCCL_IB_HCA", "NCCL_TUNER_PLUGIN"]  # never read on a node without IB, no plugin


def test_the_table_the_plugin_used_must_be_the_published_one() -> None:
    got = what_ran(parse_nccl_log(_log("table-ring-ll-2x1.rank0.nccl.log")), _env("/var/lib/nccltune/t.txt"),
                   _table("ring", "ll"))
    assert "table_other" in [f.code for f in got.findings]


def test_codes_are_stable_and_in_the_document() -> None:
    got = what_ran(parse_nccl_log(_log("defaults-2hosts.rank0.nccl.log")), _env(), None)
    doc = got.doc()
    assert doc["passed"] is False and {f["code"] for f in doc["findings"]} <= set(CODES)


def test_verify_judges_rank0s_log_of_its_trial_against_the_published_table(tmp_path: Path) -> None:
    """verify's own path: rank 0's log found in the trial's directory, the published table read from
    the path the published set names (the recorded log's table path moved to this test's directory)."""
    from nccltune.checks.verify import _what_ran
    from nccltune.records import TrialResult
    from nccltune.trials.nccllog import debug_env
    from nccltune.tuner.table import render_table

    table_path = tmp_path / "ll.table"
    table_path.write_text(render_table(_table("tree", "simple")), encoding="ascii")
    rank_dir = Path(debug_env(tmp_path)["NCCL_DEBUG_FILE"]).parent
    rank_dir.mkdir(parents=True, exist_ok=True)
    text = _log("table-ring-ll-2x1.rank0.nccl.log").replace("/tmp/tp/ll.table", str(table_path))
    (rank_dir / "nccl.698.log").write_text(text)
    result = TrialResult(status="ok", reason=None, sizes=[], wall_s=1.0, start={"pid": 698}, log_dir=str(tmp_path))
    got = _what_ran(result, _env(str(table_path)))
    assert got is not None and [f.code for f in got.findings] == ["table_not_applied"]
    assert got.table == str(table_path) and got.cells_checked == len(LOGGED)
    assert _what_ran(None, _env()) is None  # no good trial: nothing to judge


def test_verify_codes_are_the_schemas_enum() -> None:
    import json
    import typing

    from nccltune.checks.verify import VerifyCode

    schema = json.loads((Path(__file__).parent.parent / "schemas" / "verify.schema.json").read_text())
    assert list(typing.get_args(VerifyCode)) == schema["properties"]["code"]["enum"]
    ran = schema["$defs"]["nccl_ran"]["properties"]["findings"]["items"]["properties"]["code"]["enum"]
    assert ran == list(CODES) and set(CODES) <= set(typing.get_args(VerifyCode))
