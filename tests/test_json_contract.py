"""The JSON contract: every `--json` document of the command line matches its schema in `schemas/`,
per-size rows have one shape, numbers are rounded by one rule, and reasons carry stable codes
(every code the source can emit is in its schema's enum, collected from the source).

The documents come from the real commands on the shared demo sweep's state (a copy where a
command writes), so that a key added to a document without its schema fails here.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from conftest import REPO
from demo_state import SNAPSHOT, DemoSweep, clean_env, copy_state

from nccltune.checks.topocheck import TopoCheck
from nccltune.cli import main
from nccltune.fleet.jsonschema import SchemaViolation, validate
from nccltune.report.jsondoc import ROUNDING, dumps
from nccltune.report.machine import topocheck_doc

SCHEMAS = REPO / "schemas"
KINDS = ("topology", "plan", "sweep", "history", "report", "verify", "doctor", "topocheck", "env", "compare",
         "import", "nccl-tests", "fleet-status")
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
    copy_state(demo_sweep.state, state)
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
    # nccl-tests' document of the sweep (no schema_version: it is nccl-tests' format), read back in.
    docs["nccl-tests"] = cli_json("report", "--format", "nccl-tests-json", *common)[1]
    written = state.parent / "all_reduce_perf.json"
    written.write_text(json.dumps(docs["nccl-tests"]))
    docs["import"] = cli_json("import", written, "--json", *common)[1]
    docs["report-import"] = cli_json("report", "--run", docs["import"]["run_id"], "--json", *common)[1]
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
    return {"history-run": "history", "report-import": "report"}.get(name, name)


@pytest.mark.parametrize("name", ["sweep", "plan", "history", "history-run", "report", "doctor", "topology",
                                  "env", "verify", "topocheck", "nccl-tests", "import", "report-import"])
def test_every_document_matches_its_schema(documents: dict[str, dict[str, Any]], name: str) -> None:
    validate(documents[name], schema(_kind_schema(name)))


def test_every_documents_kind_names_its_schema_file(documents: dict[str, dict[str, Any]]) -> None:
    """`kind` is the stem of the schema file that describes the document; nccl-tests' own format
    has none. Exports and class profiles (read back from disk) also take the kinds they had before."""
    for name, doc in documents.items():
        if name == "nccl-tests":
            assert "kind" not in doc
            continue
        assert (SCHEMAS / f"{doc['kind']}.schema.json").is_file(), (name, doc["kind"])
        validate(doc, schema(doc["kind"]))
    for kind, old in (("export", "nccltune-export"), ("profile", "nccltune-class-profile")):
        assert schema(kind)["properties"]["kind"]["enum"] == [kind, old]


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
    for name in ("sweep", "history-run", "report", "verify", "import", "report-import"):
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


def _literal_codes(node: ast.expr, where: str) -> set[str]:
    """The codes an argument can take: a string literal, or either branch of `a if c else b`.
    Anything else (an f-string, a variable) could emit a code no schema lists."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _literal_codes(node.body, where) | _literal_codes(node.orelse, where)
    raise AssertionError(f"{where}: a code that is not spelled out ({ast.unparse(node)})")


def _call_args(tree: ast.AST, func: str, position: int) -> list[tuple[int, ast.expr]]:
    """(line, argument) of every call of `func` (a name) at `position` (or its `code=` keyword)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == func:
            arg = next((k.value for k in node.keywords if k.arg == "code"), None)
            if arg is None and len(node.args) > position:
                arg = node.args[position]
            assert arg is not None, f"{func}() on line {node.lineno} without a code"
            found.append((node.lineno, arg))
    return found


def test_doctor_codes_are_the_schema_enum() -> None:
    source = REPO / "nccltune" / "checks" / "doctor.py"
    tree = ast.parse(source.read_text())
    calls = _call_args(tree, "Finding", 1)
    codes = {c for line, arg in calls for c in _literal_codes(arg, f"doctor.py:{line}")}
    enum = schema("doctor")["properties"]["findings"]["items"]["properties"]["code"]["enum"]
    assert len(calls) > 25 and {"forced-algo", "forced-proto", "cuda-launch-blocking"} <= codes
    assert codes and codes == set(enum)


def test_doctor_emits_the_forced_codes_and_they_validate(tmp_path: Path) -> None:
    """The codes the source spells out are the ones a run emits (the forced-algorithm pair)."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, clean_env(NCCL_ALGO="Ring", NCCL_PROTO="Simple"), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["doctor", "--demo", str(SNAPSHOT), "--json", "--state-dir", str(tmp_path)])
    doc = json.loads(out.getvalue())
    validate(doc, schema("doctor"))
    assert rc in (0, 1) and {"forced-algo", "forced-proto"} <= {f["code"] for f in doc["findings"]}


def _plan_codes() -> tuple[set[str], set[str]]:
    """(codes of plan.pruned, codes of per-size candidates) as sweep/plan.py spells them: the first
    argument of every Why(...), and the per-size table, CodedCandidate(...)'s code and the Why
    constants those name."""
    from nccltune.sweep import plan

    tree = ast.parse((REPO / "nccltune" / "sweep" / "plan.py").read_text())
    pruned = {c for line, arg in _call_args(tree, "Why", 0) for c in _literal_codes(arg, f"plan.py:{line}")}
    named = {node.targets[0].id: node.value.args[0].value for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
             and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
             and node.value.func.id == "Why" and isinstance(node.value.args[0], ast.Constant)}
    per_size = set(plan.CANDIDATE_CODES.values())
    for line, arg in _call_args(tree, "CodedCandidate", 2):
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.attr == "code":
            per_size.add(named[arg.value.id])
        else:
            per_size |= _literal_codes(arg, f"plan.py:{line}")
    # The per-size candidates' own codes, where pertable names one.
    pertable = ast.parse((REPO / "nccltune" / "sweep" / "pertable.py").read_text())
    for node in ast.walk(pertable):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "PrunedCandidate"
                and len(node.args) > 2):
            per_size |= _literal_codes(node.args[2], f"pertable.py:{node.lineno}")
    return pruned, per_size


def test_pruned_codes_are_the_plan_schemas_enum() -> None:
    pruned, per_size = _plan_codes()
    plan_defs = schema("plan")["$defs"]
    assert pruned == set(plan_defs["pruned"]["properties"]["code"]["enum"])
    assert per_size == set(plan_defs["per_size_pruned"]["properties"]["code"]["enum"])
    assert {"same-path-signature", "no-rdma-nic", "single-node-network"} <= pruned and "one-rank" in per_size


def test_every_per_size_candidate_left_out_has_a_code() -> None:
    """The per-size candidates come from sweep/pertable.py, named by what they are: each name the
    candidates can take has its code, for every shape and collective."""
    from nccltune.sweep.pertable import algo_proto_candidates
    from nccltune.sweep.plan import candidate_code

    _pruned, per_size = _plan_codes()
    seen = set()
    for ll128 in (True, False):
        for nranks, nnodes in ((1, 1), (2, 1), (8, 1), (2, 2), (16, 2)):
            for collective in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
                for p in algo_proto_candidates(ll128=ll128, nranks=nranks, nnodes=nnodes, collective=collective)[1]:
                    seen.add(candidate_code(p))
    assert seen <= per_size and "one-rank" in seen and "ll128-not-auto" in seen


def test_the_plan_document_gives_every_pruned_candidate_a_code(documents: dict[str, dict[str, Any]]) -> None:
    doc = documents["plan"]
    assert doc["pruned"] and all(p["code"] and p["reason"] for p in doc["pruned"])
    assert {p["code"] for p in doc["pruned"]} >= {"single-node-network"}
    assert doc["reason"] is None
    assert all(p["code"] for p in (doc["per_size"] or {}).get("pruned", []))


def test_verify_verdict_code_matches_the_outcome(documents: dict[str, dict[str, Any]]) -> None:
    doc = documents["verify"]
    assert doc["code"] == ("passed" if doc["passed"] else doc["code"])
    assert doc["passed"] is (doc["code"] == "passed")


def test_an_active_per_size_plan_names_its_pruned_candidates_by_code(tmp_path: Path) -> None:
    """The default config's demo plan has the tuner table: its left-out candidates carry codes
    too (with NCCL_ALGO pinned in the environment, the algorithm/protocol pairs are `pinned`)."""
    for extra, expected in (({}, {"nvls-never-swept", "collnet-unavailable", "pat-not-applicable"}),
                            ({"NCCL_ALGO": "Ring"}, {"pinned"})):
        out = io.StringIO()
        with mock.patch.dict(os.environ, clean_env(**extra), clear=True), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(io.StringIO()):
            rc = main(["sweep", "--demo", str(SNAPSHOT), "--plan", "--json", "--state-dir", str(tmp_path / "s")])
        doc = json.loads(out.getvalue())
        validate(doc, schema("plan"))
        assert rc == 0 and doc["per_size"] is not None
        assert expected <= {p["code"] for p in doc["per_size"]["pruned"]}, doc["per_size"]


def test_a_provenance_with_a_run_but_not_its_history_breaks_the_env_schema() -> None:
    schema = json.loads((REPO / "schemas" / "env.schema.json").read_text())
    prov_schema = {"$defs": schema.get("$defs", {}), **schema["properties"]["provenance"]}
    base = {"backend": "nccl", "demo": False, "generation": 1, "topology_fingerprint": "0123456789abcdef"}
    validate({**base, "run_id": 3, "history": "/var/lib/nccltune/history.db"}, prov_schema)
    validate(base, prov_schema)
    with pytest.raises(SchemaViolation, match="'run_id' needs 'history' beside it"):
        validate({**base, "run_id": 3}, prov_schema)
    with pytest.raises(SchemaViolation, match="'history' needs 'run_id' beside it"):
        validate({**base, "history": "/var/lib/nccltune/history.db"}, prov_schema)


def test_the_sweeps_decision_lists_every_finalists_verdict(documents: dict[str, dict[str, Any]]) -> None:
    decision = documents["sweep"]["decision"]
    assert decision is not None
    finalists = decision["finalists"]
    # The demo is an A/A test (gloo ignores NCCL's variables): every finalist judged, none eligible,
    # and the one shown first-class is among them.
    assert finalists and all(not f["eligible"] and f["runs"] >= 1 for f in finalists)
    assert decision["candidate"] in [f["candidate"] for f in finalists]
    assert not decision["published"]
