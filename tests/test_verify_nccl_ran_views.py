"""What NCCL ran, as verify shows it: the text, `--json` (against schemas/verify.schema.json) and the
metrics, from a real NCCL 2.28.9 log whose choices differ from the table (the one rule: nccl.ran)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from prometheus_client.parser import text_string_to_metric_families

from nccltune import __version__
from nccltune.checks.verify import VerifyResult
from nccltune.metrics import render, snapshot_from_store
from nccltune.nccl.debuglog import parse_nccl_log
from nccltune.nccl.ran import CODES, what_ran
from nccltune.report.jsondoc import dumps
from nccltune.report.runs import verify_doc, verify_text
from nccltune.store import Store
from nccltune.tuner.table import TableEntry, TunerTable

REPO = Path(__file__).parent.parent
LOG = REPO / "tests" / "fixtures" / "nccllog" / "h200x1-nccl-hosts" / "table-ring-ll-2x1.rank0.nccl.log"
ENV = {"NCCL_TUNER_PLUGIN": "/tmp/tp/libnccl-tuner-nccltune.so", "NCCLTUNE_TUNER_TABLE": "/tmp/tp/ll.table",
       "NCCL_NVLS_ENABLE": "0", "NCCL_IB_HCA": "mlx5_0"}


def _ran(algo: str, proto: str) -> dict[str, object]:
    table = TunerTable("0123abcd4567ef89",
                       (TableEntry("allreduce", 0, 1 << 40, 2, 2, 1, algo, proto, 0, nccl="2.28.9"),))
    return what_ran(parse_nccl_log(LOG.read_text()), ENV, table).doc()


def _result(ran: dict[str, object] | None) -> VerifyResult:
    passed = ran is None or bool(ran["passed"])
    return VerifyResult(passed=passed, reason="r", env=ENV, env_source="published", rows=[], demo=False,
                        fingerprint="f" * 16, code="passed" if passed else "table_not_applied", nccl_ran=ran)


def test_text_and_json_show_what_nccl_ran_with_the_codes() -> None:
    schema = json.loads((REPO / "schemas" / "verify.schema.json").read_text())
    wrong = _result(_ran("tree", "simple"))
    doc = json.loads(dumps(verify_doc(wrong)))  # what `verify --json` prints
    jsonschema.validate(doc, schema)
    assert doc["nccl_ran"]["findings"][0]["code"] == "table_not_applied"
    text = verify_text(wrong)
    assert "NCCL ran: NOT as published; tuner nccltune (v5); table /tmp/tp/ll.table for 2 node(s) x 1 rank(s)" in text
    assert "[table_not_applied] table not applied at allreduce " in text
    assert "allreduce 4096 B: NCCL ran RING/LL, the table says tree/simple" in text
    assert "NCCL never logged reading: NCCL_IB_HCA" in text  # no InfiniBand there: NCCL never read it
    right = verify_text(_result(_ran("ring", "ll")))
    assert "NCCL ran: as published" in right and "[" not in right.split("NCCL ran:")[1]
    assert "NCCL ran" not in verify_text(_result(None))  # the CPU demo: no NCCL log
    jsonschema.validate(json.loads(dumps(verify_doc(_result(None)))), schema)


def _metrics(tmp_path: Path, ran: dict[str, object] | None) -> dict[str, list[tuple[dict[str, str], float]]]:
    tmp_path.mkdir()
    with Store(tmp_path / "history.db") as store:
        run_id = store.start_run(kind="verify", fingerprint="f" * 16, topology={"source": "nvml"}, backend="nccl",
                                 demo=False, profile="training", nccl_version="2.28.9", driver_version=None,
                                 torch_version=None, nccltune_version=__version__, hostname="n", config={})
        summary: dict[str, object] = {"passed": True, "rows": []}
        if ran is not None:
            summary["nccl_ran"] = ran
        store.finish_run(run_id, status="ok" if ran is None or ran["passed"] else "failed", summary=summary)
        text = render(snapshot_from_store(store, fingerprint="f" * 16))
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_metrics_carry_the_verdict_and_each_finding_code(tmp_path: Path) -> None:
    got = _metrics(tmp_path / "wrong", _ran("tree", "simple"))
    assert got["nccltune_verify_nccl_ran_passed"] == [({}, 0.0)]
    findings = {labels["code"]: value for labels, value in got["nccltune_verify_nccl_ran_finding"]}
    assert findings == {code: float(code == "table_not_applied") for code in CODES}
    got = _metrics(tmp_path / "right", _ran("ring", "ll"))
    assert got["nccltune_verify_nccl_ran_passed"] == [({}, 1.0)]
    assert {v for _, v in got["nccltune_verify_nccl_ran_finding"]} == {0.0}
    got = _metrics(tmp_path / "demo", None)
    assert "nccltune_verify_nccl_ran_passed" not in got and "nccltune_verify_nccl_ran_finding" not in got
