"""The JSON contract: every `--json` document of the command line matches its schema in `schemas/`,
per-size rows have one shape, numbers are rounded by one rule, and reasons carry stable codes.

The documents come from the real commands on the shared demo sweep's state (a copy where a
command writes), so that a key added to a document without its schema fails here.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from conftest import REPO
from demo_state import SNAPSHOT, DemoSweep, clean_env

from nccltune.cli import main
from nccltune.fleet.schema import SchemaViolation, validate
from nccltune.render import ROUNDING, dumps, topocheck_doc
from nccltune.topocheck import TopoCheck

SCHEMAS = REPO / "schemas"
KINDS = ("topology", "plan", "sweep", "history", "report", "verify", "doctor", "topocheck", "env", "compare")
ROW_LISTS = ("sizes", "rows", "measurements")


def schema(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return doc


def cli_json(*args: str | Path) -> tuple[int, dict[str, Any]]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, clean_env(), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    assert out.getvalue().strip(), err.getvalue()
    doc: dict[str, Any] = json.loads(out.getvalue())
    return rc, doc


@pytest.fixture(scope="module")
def documents(demo_sweep: DemoSweep, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One document of each kind, from the real commands."""
    state = tmp_path_factory.mktemp("contract") / "state"
    shutil.copytree(demo_sweep.state, state, symlinks=True)
    common = ["--config", demo_sweep.config, "--state-dir", state]
    run_id = demo_sweep.doc["run_id"]
    docs = {"sweep": demo_sweep.doc}
    docs["plan"] = cli_json("sweep", "--demo", SNAPSHOT, "--plan", "--json", *common)[1]
    docs["history"] = cli_json("history", "--json", *common)[1]
    docs["history-run"] = cli_json("history", "--run", run_id, "--json", *common)[1]
    docs["report"] = cli_json("report", "--json", *common)[1]
    docs["doctor"] = cli_json("doctor", "--demo", SNAPSHOT, "--json", *common)[1]
    docs["topology"] = cli_json("topo", "--input", SNAPSHOT, "--json", *common)[1]
    docs["env"] = cli_json("env", "--format", "json", *common)[1]
    docs["verify"] = cli_json("verify", "--demo", SNAPSHOT, "--threshold", "90", "--json", *common)[1]
    docs["topocheck"] = json.loads(dumps(topocheck_doc(_topocheck())))
    return docs


def _topocheck() -> TopoCheck:
    """A check as `topo check` makes it on a GPU node (it needs NCCL, so the CPU tests build one)."""
    return TopoCheck(xml="/tmp/t.xml", passed=True, verdict="NCCL loaded the file", loaded=True, open_error=None,
                     hints=[], warnings=[], errors=[], transports={"P2P/CUMEM": 2},
                     graphs=[{"pattern": 4, "nchannels": 16, "bw_intra": 40.0, "type_intra": "NVL",
                              "type_inter": "PIX"}],
                     algo_proto={"1048576": "Ring/LL128"}, correct=True, busbw_gbps={1048576: 12.3456789},
                     trial_status="ok", trial_reason=None, nccl_version="2.27.5", dump=None, dump_diff=None,
                     log_dir=None)


def _kind_schema(name: str) -> str:
    return {"history-run": "history"}.get(name, name)


@pytest.mark.parametrize("name", ["sweep", "plan", "history", "history-run", "report", "doctor", "topology",
                                  "env", "verify", "topocheck"])
def test_every_document_matches_its_schema(documents: dict[str, dict[str, Any]], name: str) -> None:
    validate(documents[name], schema(_kind_schema(name)))


def test_a_key_the_schema_does_not_know_is_refused(documents: dict[str, dict[str, Any]]) -> None:
    doc = json.loads(json.dumps(documents["sweep"]))
    doc["sizes"][0]["busbw"] = 1.0
    with pytest.raises(SchemaViolation, match=r"sizes\[0\]\.busbw"):
        validate(doc, schema("sweep"))
    bad = json.loads(json.dumps(documents["verify"]))
    bad["code"] = "fine"
    with pytest.raises(SchemaViolation, match="code"):
        validate(bad, schema("verify"))


def test_there_is_a_schema_for_every_kind_and_shared_definitions_agree() -> None:
    seen: dict[str, Any] = {}
    for kind in KINDS:
        doc = schema(kind)
        assert doc["$schema"].startswith("https://json-schema.org/")
        for name, definition in doc.get("$defs", {}).items():
            # A definition copied into several schemas (the rows, the run) is the same everywhere.
            assert seen.setdefault(name, definition) == definition, f"{kind}: $defs.{name} differs"
    assert {"report_row", "measurement_row", "verify_row", "run", "failed_trial", "pruned"} <= set(seen)


def _rows(doc: Any, where: str = "$") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ROW_LISTS and isinstance(value, list):
                found += [(f"{where}.{key}", v) for v in value if isinstance(v, dict)]
            found += _rows(value, f"{where}.{key}")
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += _rows(value, f"{where}[{i}]")
    return found


def test_every_per_size_row_starts_with_size_and_collective(documents: dict[str, dict[str, Any]]) -> None:
    count = 0
    for name in ("sweep", "history-run", "report", "verify"):
        for where, row in _rows(documents[name]):
            if "size_bytes" not in row:
                continue  # a verification's stored summary rows are prose-side history
            count += 1
            assert list(row)[:2] == ["size_bytes", "collective"], f"{name} {where}: {list(row)}"
            assert row["collective"] == "all_reduce"
    assert count > 20


def _floats(doc: Any, key: str | None = None) -> list[tuple[str | None, float]]:
    if isinstance(doc, float):
        return [(key, doc)]
    if isinstance(doc, dict):
        return [f for k, v in doc.items() for f in _floats(v, k if not k.isdigit() else key)]
    if isinstance(doc, list):
        return [f for v in doc for f in _floats(v, key)]
    return []


def test_numbers_are_rounded_by_one_rule(documents: dict[str, dict[str, Any]]) -> None:
    checked = 0
    for name, doc in documents.items():
        for key, value in _floats(doc):
            digits = next((d for suffix, d in ROUNDING if key and key.endswith(suffix)), None)
            if digits is None:
                continue
            checked += 1
            assert value == round(value, digits), f"{name}: {key}={value} has more than {digits} decimals"
    assert checked > 50
    # The topo-check's map of busbw by size takes its key's rule too.
    assert documents["topocheck"]["busbw_gbps"] == {"1048576": 12.346}


def test_doctor_codes_are_the_schema_enum() -> None:
    source = (REPO / "nccltune" / "doctor.py").read_text()
    codes = set(re.findall(r'Finding\((?:"[a-z]+"|"warning" if \w+ else "error"),\s*"([a-z0-9_-]+)"', source))
    enum = schema("doctor")["properties"]["findings"]["items"]["properties"]["code"]["enum"]
    assert codes and codes == set(enum)


def test_verify_verdict_code_matches_the_outcome(documents: dict[str, dict[str, Any]]) -> None:
    doc = documents["verify"]
    assert doc["code"] == ("passed" if doc["passed"] else doc["code"])
    assert doc["passed"] is (doc["code"] == "passed")
