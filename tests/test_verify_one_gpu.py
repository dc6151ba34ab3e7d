"""verify on a node with one GPU: the published table's shapes N x 1 formed with N rank processes on
the one GPU, each its own NCCL_HOSTID, and what NCCL ran proven from rank 0's log (nccl.ran).

The CPU runs the same path on the demo's one-GPU recording (tests/fixtures/h200x1-vm.json): the
runner starts N gloo ranks through the hosts launch; gloo writes no NCCL log, so rank 0 writes a
real NCCL 2.28.9 log recorded on a one-GPU H200 with 2 and 4 NCCL hosts
(fixtures/nccllog/h200x1-nccl-hosts) through tests/nccllogreplay, with the recording's table and
plugin paths as this test published them. The verdicts (pass, table stale, table malformed, plugin
not loaded, table not applied) are those logs'."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import jsonschema
import pytest
from conftest import REPO
from prometheus_client.parser import text_string_to_metric_families

from nccltune.checks.onegpu import (
    FALLBACK_HOSTS,
    MAX_HOSTS,
    NOT_TIMED,
    QUICK_BYTES,
    ShapeCheck,
    plan_checks,
    worker_size,
)
from nccltune.checks.verify import VerifyResult, run_verify
from nccltune.cli import main
from nccltune.collectives import COLLECTIVES
from nccltune.config import Config, load_config
from nccltune.config.overrides import with_overrides
from nccltune.errors import CheckFailed, UsageError
from nccltune.fleet.jsonschema import validate
from nccltune.metrics import render, snapshot_from_store
from nccltune.nccl.ran import WhatRan, combined, published_table
from nccltune.publish import publish_setting
from nccltune.publish.setting import Provenance, Setting, Tuner
from nccltune.report.runs import verify_doc, verify_text
from nccltune.store import Store
from nccltune.trials.launch.base import TrialSpec
from nccltune.trials.launch.hosts import HOSTID_VAR, HostsOnOneGpuLaunch
from nccltune.tuner.table import TableEntry, TunerTable, render_table

pytest.importorskip("torch")

H200X1 = str(REPO / "tests" / "fixtures" / "h200x1-vm.json")
LOGS = REPO / "tests" / "fixtures" / "nccllog" / "h200x1-nccl-hosts"
REPLAY = REPO / "tests" / "nccllogreplay"
SCHEMA = json.loads((REPO / "schemas" / "verify.schema.json").read_text())
FP = "0123abcd4567ef89"


def _table(*shapes: int, algo: str = "ring", proto: str = "ll", hi: int = 1 << 20) -> TunerTable:
    """An all_reduce entry up to `hi` bytes for each shape N x 1."""
    return TunerTable(FP, tuple(TableEntry("allreduce", 0, hi, n, n, 1, algo, proto, 0, nccl="2.28.9") for n in shapes))


# -- what the check forms ---------------------------------------------------------------------------


def test_the_tables_shapes_n_x_1_are_formed_up_to_the_bound_and_the_others_named() -> None:
    table = TunerTable(FP, (
        TableEntry("allreduce", 0, 1 << 20, 2, 2, 1, "ring", "ll", 0, nccl="2.28.9"),
        TableEntry("allgather", 8 << 20, 1 << 40, 2, 2, 1, "ring", "simple", 0, nccl="2.28.9"),
        TableEntry("allreduce", 0, 1 << 40, 4, 4, 1, "tree", "simple", 0, nccl="2.28.9"),
        TableEntry("allreduce", 0, 1 << 40, 8, 8, 1, "ring", "ll", 0, nccl="2.28.9"),
        TableEntry("allreduce", 0, 1 << 40, 2, 8, 4, "ring", "ll", 0, nccl="2.28.9"),
        TableEntry("allreduce", 0, 1 << 40, 1, 8, 8, "nvls", "simple", 0, nccl="2.28.9"),
    ))
    env = {"NCCL_TUNER_PLUGIN": "/p.so", "NCCLTUNE_TUNER_TABLE": "/t.txt"}
    plan = plan_checks(env, table, None, quick=False)
    assert [(c.label, c.collectives, c.spans) for c in plan.shapes] == [
        ("2x1", ("all_reduce", "all_gather"), 2), ("4x1", ("all_reduce",), 1)]
    assert plan.shapes[0].sizes == (4096, 65536, 1 << 20, 16 << 20, 32 << 20)
    assert plan.not_formed == ("8x1: above the bound of 4 NCCL hosts on one GPU",
                               "2x4: 4 ranks per node need as many GPUs on each node",
                               "1x8: 8 ranks per node need as many GPUs on each node")
    # each size falls in its span as NCCL counts it: all_gather's bytes are one rank's block
    ag = COLLECTIVES["all_gather"]
    assert {ag.nccl_bytes(s, 2) for s in (16 << 20, 32 << 20)} == {8 << 20, 16 << 20}
    quick = plan_checks(env, table, None, quick=True)
    assert [(c.label, c.sizes) for c in quick.shapes] == [("2x1", (QUICK_BYTES, 16 << 20))]
    assert "4x1: left to the full check (--quick forms one shape)" in quick.not_formed
    assert MAX_HOSTS == 4


def test_a_size_outside_a_narrow_span_is_not_run() -> None:
    ag = COLLECTIVES["all_gather"]
    assert worker_size(ag, 1000, 4, 1000, 1005) is None  # no whole 16-byte block inside 1000..1005
    assert worker_size(ag, 1000, 4, 1000, 1010) == 4 * 1008
    assert worker_size(ag, 1 << 20, 4, 0, 1 << 40) == 4 << 20
    assert worker_size(COLLECTIVES["all_reduce"], 4099, 2, 0, 1 << 40) == 4096


def test_without_a_readable_table_one_fallback_shape_shows_what_nccl_read() -> None:
    env = {"NCCL_TUNER_PLUGIN": "/p.so", "NCCLTUNE_TUNER_TABLE": "/t.txt"}
    plan = plan_checks(env, None, "/t.txt:3: malformed", quick=True)
    assert plan.shapes == (ShapeCheck(FALLBACK_HOSTS, ("all_reduce",), (QUICK_BYTES,)),)
    assert plan.table_problem == "/t.txt:3: malformed" and "cannot read" in plan.holds
    plan = plan_checks({"NCCL_IB_HCA": "mlx5", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, None, None, quick=False)
    assert [c.label for c in plan.shapes] == ["2x1"] and "1 NCCL variable(s): NCCL_IB_HCA" in plan.holds
    nothing = plan_checks({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, None, None, quick=False)
    assert nothing.shapes == () and nothing.holds == "no tuner table and no NCCL variable for NCCL to read"


def test_each_rank_is_its_own_nccl_host_on_the_one_gpu(tmp_path: Path) -> None:
    launch = HostsOnOneGpuLaunch(3)
    specs = launch.start(TrialSpec(1, tmp_path, ["python", "worker.py"], {"NCCL_HOSTID": "caller"}, {}, 10.0))
    assert [(s.env["RANK"], s.env["WORLD_SIZE"], s.env["LOCAL_RANK"], s.env["LOCAL_WORLD_SIZE"]) for s in specs] == [
        ("0", "3", "0", "1"), ("1", "3", "0", "1"), ("2", "3", "0", "1")]
    assert len({s.env[HOSTID_VAR] for s in specs}) == 3 and "caller" not in {s.env[HOSTID_VAR] for s in specs}
    assert len({s.env["MASTER_PORT"] for s in specs}) == 1
    assert launch.record()["label"] == "3x1" and not launch.record()["loopback"]
    with pytest.raises(ValueError):
        HostsOnOneGpuLaunch(1)


def test_verdicts_of_several_shapes_are_one_verdict_naming_each_shape() -> None:
    from nccltune.nccl.ran import Finding

    ok = WhatRan({"NCCL_TUNER_PLUGIN": "/p.so"}, "nccltune (v5)", "/t", (2, 2, 1), 5)
    bad = WhatRan({"NCCL_TUNER_PLUGIN": None}, "nccltune (v5)", "/t", (4, 4, 1), 3,
                  (Finding("table_not_applied", "table not applied at allreduce 4 B"),))
    both = combined({"2x1": ok, "4x1": bad})
    assert not both.passed and both.cells_checked == 8 and both.shape is None
    assert [f.message for f in both.findings] == ["4x1: table not applied at allreduce 4 B"]
    assert both.variables == {"NCCL_TUNER_PLUGIN": "/p.so"}
    assert combined({"2x1": ok}) is ok


def test_the_published_table_or_why_it_cannot_be_read(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text(render_table(_table(2)))
    assert published_table({"NCCLTUNE_TUNER_TABLE": str(path)}) == (_table(2), None)
    path.write_text(render_table(_table(2)) + "allreduce zero many\n")
    table, problem = published_table({"NCCLTUNE_TUNER_TABLE": str(path)})
    assert table is None and problem is not None and "content after the 'end' line" in problem
    assert published_table({}) == (None, None)


# -- the check on the CPU, with recorded NCCL logs ----------------------------------------------------


@pytest.fixture(scope="module")
def replay_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter that loads tests/nccllogreplay at every start, isolated (-I) or not: a .pth
    line puts it on sys.path; torch comes from this interpreter's site-packages."""
    venv = tmp_path_factory.mktemp("replay") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    (site,) = venv.glob("lib/python*/site-packages")
    mine = [p for p in sys.path if p.endswith("site-packages")]
    (site / "nccltune-replay.pth").write_text("\n".join([str(REPLAY), *mine]) + "\n")
    return str(venv / "bin" / "python")


@pytest.fixture
def clean_environ() -> Iterator[None]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL", "REPLAY_"))}
    with mock.patch.dict(os.environ, env, clear=True):
        yield


def _config(tmp_path: Path, python: str) -> Config:
    return with_overrides(load_config(None), state_dir=str(tmp_path / "state"), **{"bench.python": python,
                                                                                  "bench.trial_timeout_s": 120})


def _publish(cfg: Config, table: TunerTable | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """A published set with this table and a stand-in plugin (no NCCL here loads it); its paths."""
    prov = Provenance(nccltune_version="0.2.0", created_at="2026-01-01T00:00:00+00:00", topology_fingerprint="f" * 16,
                      nccl_version="2.28.9", backend="gloo", demo=True, profile="training", tuning_fingerprint=FP)
    tuner = Tuner(b"\x7fELF stand-in", render_table(table)) if table is not None else None
    published = publish_setting(cfg, Setting(env or {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, prov, tuner=tuner))
    return dict(published.env)


def _replay(env: dict[str, str], **logs: Path) -> None:
    """Rank 0 of N ranks writes logs["n<N>"], the recording's paths as `env` names them."""
    for key, path in logs.items():
        os.environ[f"REPLAY_NCCL_LOG_{key[1:]}"] = str(path)
    subst = {"/tmp/tp/libnccl-tuner-nccltune.so": env.get("NCCL_TUNER_PLUGIN", ""),
             "/tmp/tp/t.so": env.get("NCCL_TUNER_PLUGIN", ""),
             "/tmp/tp/ll.table": env.get("NCCLTUNE_TUNER_TABLE", "")}
    os.environ["REPLAY_SUBST"] = "\n".join(f"{old}=>{new}" for old, new in subst.items() if new)


def _stale_or_malformed(tmp_path: Path, which: str) -> Path:
    """The recorded 2x1 job's INFO lines with the plugin's WARN about a stale or malformed table in
    place of its "using table" line (those WARNs were recorded under NCCL_DEBUG=WARN)."""
    info = [line for line in (LOGS / "table-ring-ll-2x1.rank0.nccl.log").read_text().splitlines()
            if "using table" not in line]
    warns = [line for line in (LOGS / "table-malformed-and-stale.warn.log").read_text().splitlines()
             if "nccltune tuner" in line and f"is {which}" in line][:1]
    path = tmp_path / f"{which}.log"
    path.write_text("\n".join(info + warns) + "\n")
    return path


def _host_ids(cfg: Config, label: str) -> set[str]:
    logs = (Path(cfg.state_dir) / "verify" / label / "trial-001" / "rank").glob("nccl.*.log")
    return {line.rsplit(" ", 1)[1] for p in logs for line in p.read_text().splitlines()
            if "NCCL_HOSTID set by environment" in line}


def _check(result: VerifyResult) -> dict[str, object]:
    doc = json.loads(json.dumps({"schema_version": 1, **verify_doc(result)}))
    jsonschema.validate(doc, SCHEMA)
    validate(doc, SCHEMA)  # nccltune's own reader of its schemas, as the JSON contract test uses it
    text = verify_text(result)
    assert NOT_TIMED in text and "Wall time:" in text
    return doc


@pytest.mark.usefixtures("clean_environ")
def test_the_table_nccl_followed_passes_with_its_choices_compared(tmp_path: Path, replay_python: str) -> None:
    cfg = _config(tmp_path, replay_python)
    env = _publish(cfg, _table(2))
    _replay(env, n2=LOGS / "table-ring-ll-2x1.rank0.nccl.log")
    result = run_verify(cfg, demo=H200X1)
    doc = _check(result)
    assert result.passed and result.code == "passed", result.reason
    assert result.nccl_ran is not None and result.nccl_ran["cells_checked"] == 6  # 4 B, 4 KiB ... 1 MiB
    assert result.nccl_ran["shape"] == [2, 2, 1] and result.nccl_ran["table"] == env["NCCLTUNE_TUNER_TABLE"]
    one = doc["one_gpu"]
    assert isinstance(one, dict) and one["timed"] is False and one["note"] == NOT_TIMED
    assert [(s["label"], s["status"], s["sizes"]) for s in one["shapes"]] == [("2x1", "ok", [4096, 65536, 1 << 20])]
    assert _host_ids(cfg, "2x1") == {"nccltune-check-host0", "nccltune-check-host1"}
    assert result.rows == [] and result.reference == "none"
    # nothing timed is stored: the trial is in the history without measurements
    with Store(Path(cfg.state_dir) / "history.db") as store:
        (trial,) = store.trials(result.run_id or 0)
    assert trial.status == "ok" and trial.measurements == ()


@pytest.mark.usefixtures("clean_environ")
def test_a_stale_table_fails_with_its_code_in_text_json_and_metrics(tmp_path: Path, replay_python: str) -> None:
    cfg = _config(tmp_path, replay_python)
    env = _publish(cfg, _table(2))
    _replay(env, n2=_stale_or_malformed(tmp_path, "stale"))
    result = run_verify(cfg, demo=H200X1)
    doc = _check(result)
    assert (result.passed, result.code) == (False, "table_stale")
    assert doc["nccl_ran"]["findings"][0]["code"] == "table_stale"
    assert f"[table_stale] the tuner plugin said: table {env['NCCLTUNE_TUNER_TABLE']} is stale" in verify_text(result)
    with Store(Path(cfg.state_dir) / "history.db") as store:
        text = render(snapshot_from_store(store, fingerprint=result.fingerprint))
    got = {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}
    assert got["nccltune_verify_nccl_ran_passed"] == [({}, 0.0)]
    findings = {labels["code"]: value for labels, value in got["nccltune_verify_nccl_ran_finding"]}
    assert findings["table_stale"] == 1.0 and sum(findings.values()) == 1.0


@pytest.mark.usefixtures("clean_environ")
def test_a_malformed_table_fails_with_its_code_and_why_nccltune_cannot_read_it(tmp_path: Path,
                                                                               replay_python: str) -> None:
    cfg = _config(tmp_path, replay_python)
    env = _publish(cfg, _table(2))
    table_file = Path(env["NCCLTUNE_TUNER_TABLE"])
    table_file.chmod(0o644)
    table_file.write_text(table_file.read_text() + "allreduce zero many\n")
    _replay(env, n2=_stale_or_malformed(tmp_path, "malformed"))
    result = run_verify(cfg, demo=H200X1)
    doc = _check(result)
    assert (result.passed, result.code) == (False, "table_malformed")
    one = doc["one_gpu"]
    assert isinstance(one, dict) and "content after the 'end' line" in str(one["table_problem"])
    # the table's shapes are unknown: the smallest job over several nodes shows what the plugin said
    assert [s["label"] for s in one["shapes"]] == [f"{FALLBACK_HOSTS}x1"]


@pytest.mark.usefixtures("clean_environ")
def test_a_plugin_nccl_did_not_load_fails(tmp_path: Path, replay_python: str) -> None:
    cfg = _config(tmp_path, replay_python)
    env = _publish(cfg, _table(2), {"NCCL_NVLS_ENABLE": "0"})
    _replay(env, n2=LOGS / "defaults-2hosts.rank0.nccl.log")
    result = run_verify(cfg, demo=H200X1, quick=True)
    _check(result)
    assert (result.passed, result.code) == (False, "plugin_not_loaded")
    assert result.nccl_ran is not None and result.nccl_ran["variables"]["NCCL_NVLS_ENABLE"] == "0"
    assert result.checked.startswith("quick: ")


@pytest.mark.usefixtures("clean_environ")
def test_each_shape_is_formed_and_a_shape_nccl_did_not_follow_is_named(tmp_path: Path, replay_python: str) -> None:
    """2x1 and 4x1 in the table: NCCL followed the 2x1 entry; on 4 hosts (the recording ran a 2x1
    table there) NCCL kept its own choices, which differ from this table's 4x1 entry."""
    cfg = _config(tmp_path, replay_python)
    env = _publish(cfg, _table(2, 4, hi=64 << 10))
    _replay(env, n2=LOGS / "table-ring-ll-2x1.rank0.nccl.log", n4=LOGS / "table-ring-ll-other-shape-4x1.rank0.nccl.log")
    result = run_verify(cfg, demo=H200X1)
    doc = _check(result)
    assert (result.passed, result.code) == (False, "table_not_applied")
    assert result.reason.startswith("4x1: table not applied at allreduce 4 B: NCCL ran TREE/LL, the table says ring/ll")
    one = doc["one_gpu"]
    assert isinstance(one, dict) and [(s["label"], s["nccl_ran"]["passed"]) for s in one["shapes"]] == [
        ("2x1", True), ("4x1", False)]
    assert len(_host_ids(cfg, "4x1")) == 4


@pytest.mark.usefixtures("clean_environ")
def test_the_command_line_quick_form_says_what_it_checked(tmp_path: Path, replay_python: str) -> None:
    cfg = _config(tmp_path, replay_python)
    env = _publish(cfg, _table(2))
    _replay(env, n2=LOGS / "table-ring-ll-2x1.rank0.nccl.log")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"bench": {"python": replay_python}}))
    args = ["verify", "--demo", H200X1, "--quick", "--config", str(config), "--state-dir", cfg.state_dir]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*args, "--json"])
    assert rc == 0, err.getvalue()
    doc = json.loads(out.getvalue())
    jsonschema.validate(doc, SCHEMA)
    assert doc["one_gpu"]["quick"] is True and doc["one_gpu"]["shapes"][0]["sizes"] == [QUICK_BYTES]
    assert doc["checked"].startswith("quick: NCCL's log of rank 0 of N NCCL hosts on the one GPU for 2x1")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    assert rc == 0
    assert "2x1: 2 NCCL hosts on the one GPU, all_reduce at 64KiB: ok" in out.getvalue()
    assert "Wall time:" in out.getvalue() and "(quick check)" in out.getvalue()


@pytest.mark.usefixtures("clean_environ")
def test_without_a_log_the_demo_proves_nothing_and_a_gpu_node_fails(tmp_path: Path) -> None:
    cfg = _config(tmp_path, sys.executable)  # no replay: gloo writes no NCCL log
    _publish(cfg, _table(2))
    demo = run_verify(cfg, demo=H200X1, quick=True)
    assert demo.passed and demo.nccl_ran is None and "nothing NCCL runs is proven" in demo.reason
    # The same recording as a GPU node's (topology.snapshot), its ranks on gloo: no NCCL log to read.
    gpu = with_overrides(cfg, **{"topology.snapshot": H200X1, "bench.backend": "gloo"})
    result = run_verify(gpu, quick=True)
    assert (result.demo, result.passed, result.code) == (False, False, "nccl_log_missing")
    _check(result)


@pytest.mark.usefixtures("clean_environ")
def test_nothing_to_prove_starts_no_rank_and_says_what_was_checked(tmp_path: Path) -> None:
    cfg = _config(tmp_path, sys.executable)
    with pytest.raises(CheckFailed, match="nothing is published"):
        run_verify(cfg, demo=H200X1)
    _publish(cfg, None)
    result = run_verify(cfg, demo=H200X1)
    _check(result)
    assert result.passed and result.reason == ("nothing NCCL runs can differ from its defaults: the published set "
                                               "holds no tuner table and no NCCL variable for NCCL to read")
    assert not (Path(cfg.state_dir) / "verify").exists()
    with pytest.raises(UsageError, match="--floor"):
        run_verify(cfg, demo=H200X1, floor_gbps=1.0)
