"""The per-size stage in the plan and the sweep: trial counts on the 2x H200 recording, the tuner.plugin
key, an NCCL_TUNER_PLUGIN already set (plan and doctor), and a CPU-demo sweep end to end with its table."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from demo_state import SNAPSHOT, clean_env

from nccltune.checks.doctor import diagnose
from nccltune.collectives import COLLECTIVES
from nccltune.config import Config, TunerConfig, parse_config
from nccltune.errors import InputError
from nccltune.fleet.jsonschema import validate
from nccltune.nccl.site import SiteTuner
from nccltune.nccl.sitetuner import existing_tuner
from nccltune.node import Node, load_node
from nccltune.pipeline import SweepPipeline
from nccltune.pipeline.tablestage import TableOutcome
from nccltune.records import Measurement, TrialResult
from nccltune.sweep.space import CATALOGUE
from nccltune.topology.paths import compute_paths
from nccltune.trials.session import TrialSession
from nccltune.tuner.build import find_compiler
from nccltune.tuner.table import parse_table

# Without NCCL variables and with no NCCL conf file of whoever runs the tests.
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "NCCL_CONF_FILE": "/nonexistent/nccl.conf"}


# The GPU node's plans here share one real probe of the worker interpreter's NCCL (conftest).
pytestmark = pytest.mark.usefixtures("nccl_probed_once")


def _node(cfg: Config, gpu: bool) -> Node:
    node = load_node(cfg, str(SNAPSHOT))
    # The same topology as the GPU node reads it, measured with NCCL: the config's size ladder.
    return dataclasses.replace(node, demo=False, backend="nccl") if gpu else node


def _plan(cfg: Config, env: dict[str, str], gpu: bool = False) -> tuple[SweepPipeline, int]:
    pipe = SweepPipeline(cfg, env=env, node=_node(cfg, gpu))
    plan, search = pipe.plan()
    return pipe, pipe.estimate_trials(plan, search)


def test_the_demo_plan_on_the_2x_h200_recording_stays_within_25_trials() -> None:
    pipe, trials = _plan(Config(), ENV)
    plan = pipe.plan()[0]
    assert plan.per_size is not None and plan.per_size.active
    assert not plan.per_size.measured_with_nccl
    assert len(plan.per_size.candidates) == 6  # Ring/Tree x Simple/LL/LL128 (LL128 on: all NVLink, sm90)
    assert plan.per_size.channels
    for name in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        assert name not in plan.variables
    assert trials <= 25


def test_the_gpu_plan_on_the_2x_h200_recording_stays_within_25_trials_and_3_minutes() -> None:
    cfg = Config()
    # The GPU node's environment pins NCCL_NVLS_ENABLE=0 (nccl-init-log of the recording).
    pipe, trials = _plan(cfg, {**ENV, "NCCL_NVLS_ENABLE": "0"}, gpu=True)
    plan = pipe.plan()[0]
    assert plan.per_size is not None and plan.per_size.active and plan.per_size.measured_with_nccl
    assert plan.pinned["NCCL_NVLS_ENABLE"].value == "0"
    assert "NCCL_NVLS_ENABLE" not in plan.variables
    assert not any(c.algo == "nvls" for c in plan.per_size.candidates)
    assert trials <= 25
    assert pipe.estimate_seconds(plan, trials) <= 180


def test_the_plan_text_and_json_list_the_per_size_candidates() -> None:
    from nccltune.report.sweep import plan_doc, plan_text

    pipe, trials = _plan(Config(), ENV)
    plan = pipe.plan()[0]
    text = plan_text(plan, pipe.node(), trials, 60.0, "balanced")
    assert "Per size" in text and "NCCL_ALGO=Tree NCCL_PROTO=LL128" in text
    assert "not measured with NCCL" in text or "not measured, with NCCL" in text or "CPU demo: the table" in text
    doc = plan_doc(plan, pipe.node(), trials, 60.0, "balanced")
    assert doc["per_size"]["active"] is True and len(doc["per_size"]["candidates"]) == 6


def test_tuner_plugin_key_parses_and_rejects_with_the_config_style() -> None:
    assert parse_config("tuner:\n  plugin: keep\n").tuner == TunerConfig("keep")
    assert Config().tuner.plugin == "auto"
    with pytest.raises(InputError) as exc:
        parse_config("tuner:\n  plugin: nccltun\n", "c.yaml")
    assert "c.yaml:2" in str(exc.value) and "nccltune" in str(exc.value)


@pytest.mark.parametrize("mode, active", [("auto", False), ("nccltune", True), ("keep", False)])
def test_an_existing_tuner_is_kept_or_replaced_as_the_config_says(mode: str, active: bool) -> None:
    cfg = Config(tuner=TunerConfig(mode))  # type: ignore[arg-type]
    env = {**ENV, "NCCL_TUNER_PLUGIN": "/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so"}
    pipe, _ = _plan(cfg, env)
    plan = pipe.plan()[0]
    assert plan.per_size is not None and plan.per_size.active is active
    notes = " ".join(plan.notes)
    if mode == "auto":
        assert "per-size tuner table not active" in notes
        assert "NCCL_TUNER_PLUGIN=/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so (from the environment)" in notes
        assert plan.variables["NCCL_ALGO"]  # the environment-only search measures them as before
    elif mode == "nccltune":
        assert "REPLACED" in notes
    else:
        assert "tuner.plugin is keep" in notes


def test_an_existing_tuner_from_an_nccl_conf_file_is_named(tmp_path: Path) -> None:
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_DEBUG=WARN\nNCCL_TUNER_PLUGIN=sitetuner\n")
    assert existing_tuner({}, [conf]) == SiteTuner("sitetuner", str(conf))
    # The environment comes first, as with NCCL; nccltune's own plugin is not a foreign tuner.
    assert existing_tuner({"NCCL_TUNER_PLUGIN": "other"}, [conf]) == SiteTuner("other", "the environment")
    assert existing_tuner({"NCCL_TUNER_PLUGIN": "/x/libnccl-tuner-nccltune.so"}, [conf]) is None
    topo = load_node(Config(), str(SNAPSHOT)).topo
    findings = diagnose(topo, compute_paths(topo), env={}, publish_dir=tmp_path / "none", conf_files=[conf])
    got = [f for f in findings if f.code == "tuner-plugin-kept"]
    assert len(got) == 1 and "NCCL_TUNER_PLUGIN=sitetuner" in got[0].message and str(conf) in got[0].message
    loud = diagnose(topo, compute_paths(topo), env={}, publish_dir=tmp_path / "none", conf_files=[conf],
                    tuner_mode="nccltune")
    assert [f.severity for f in loud if f.code == "tuner-plugin-replaced"] == ["warning"]


def test_no_compiler_means_no_table_in_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nccltune.pipeline.planning.find_compiler", lambda cc=None: None)
    pipe, _ = _plan(Config(), ENV, gpu=True)
    plan = pipe.plan()[0]
    assert plan.per_size is not None and not plan.per_size.active
    assert "per-size tuner table not active: no C compiler" in " ".join(plan.notes)
    assert plan.variables["NCCL_PROTO"]


# Only the per-size candidates (Ring/Tree x Simple/LL/LL128) besides the topology file: 2 runs of the
# defaults, the topology file, 6 candidates, then the final check (1 + 1): 11 short trials.
TABLE_CONFIG = {
    "sweep": {"baseline_repeats": 2, "finalist_repeats": 1,
              "exclude": [n for n, t in CATALOGUE.items() if t.kind == "perf" and t.scope == "node"
                          and n not in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")]},
}


def test_demo_sweep_end_to_end_shows_the_table_not_measured_with_nccl(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(TABLE_CONFIG))
    state = tmp_path / "state"
    got = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", str(SNAPSHOT),
                          "--config", str(config), "--state-dir", str(state)],
                         capture_output=True, text=True, env=clean_env(), timeout=600, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    # The text report shows the table beside the published environment, labelled.
    assert "Tuner table: not measured with NCCL: CPU demo" in got.stdout
    assert "nothing from it is claimed as a gain" in got.stdout
    assert "11 trials" in got.stdout
    # The stored run names the table's file in the run's directory; it parses, for this node's shape.
    from nccltune.store import Store

    with Store(state / "history.db") as store:
        run = store.runs(kind="sweep")[0]
    assert run.summary is not None
    table = run.summary["tuner_table"]
    assert table["status"] == "not measured with NCCL: CPU demo"
    assert table["published"] is None  # nothing from the table is published
    # A table is keyed by the NCCL version it was measured with; gloo ran none, so the demo's table
    # is shown (entries, report) and has no file.
    assert table["table_path"] is None
    assert any("no NCCL version to key it by" in n for n in table["notes"])
    sweep_schema = json.loads((REPO / "schemas" / "sweep.schema.json").read_text())
    validate(table, sweep_schema["$defs"]["tuner_table"], sweep_schema)
    assert table["entries"]
    assert {e["collective"] for e in table["entries"]} <= {"allreduce"}  # balanced weighs all_reduce alone
    for e in table["entries"]:
        assert f"{e['algo']}/{e['proto']}" in got.stdout
    # Nothing of the tuner reaches the published environment.
    published = (state / "nccl.env").read_text()
    assert "NCCL_TUNER_PLUGIN" not in published and "NCCLTUNE_TUNER" not in published


def test_the_table_and_plugin_are_published_in_the_set_and_the_single_node_part_apart(tmp_path: Path) -> None:
    from publishing import publish_set

    from nccltune.publish import Provenance, Tuner, read_set
    from nccltune.tuner.build import build_plugin
    from nccltune.tuner.table import TableEntry, TunerTable, render_table

    fp = "0123456789abcdef"
    run_dir = tmp_path / "runs" / "00007"
    built = build_plugin(run_dir)
    assert built.ok and built.path is not None, built.message
    text = render_table(TunerTable(fp, (TableEntry("allreduce", 0, 1 << 20, 1, 2, 2, "ring", "ll", 0, nccl="2.28.9"),)))
    prov = Provenance(nccltune_version="0", created_at="2026-12-01T00:00:00+00:00", topology_fingerprint="t",
                      nccl_version=None, backend="nccl", demo=False, profile="balanced", tuning_fingerprint=fp)
    publish_dir = tmp_path / "published"
    published = publish_set(publish_dir, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, prov,
                        single_node_env={"NCCL_MIN_NCHANNELS": "32"}, tuner=Tuner(built.path, text))
    got = read_set(publish_dir)
    assert got is not None
    generation = publish_dir / "generations" / str(published.generation)
    table_copy, plugin_copy = Path(got.env["NCCLTUNE_TUNER_TABLE"]), Path(got.env["NCCL_TUNER_PLUGIN"])
    assert table_copy.parent == plugin_copy.parent == generation  # files of the generation itself
    assert got.env["NCCLTUNE_TUNER_FINGERPRINT"] == fp
    assert "NCCL_MIN_NCHANNELS" not in got.env  # single-node only: not in what every job sources
    assert got.single_node_env == {"NCCL_MIN_NCHANNELS": "32"}
    assert table_copy.read_text() == text and plugin_copy.read_bytes() == built.path.read_bytes()
    assert parse_table(table_copy.read_text(), str(table_copy)).fingerprint == fp
def test_nccltunes_own_published_tuner_is_neither_foreign_nor_a_pin() -> None:
    own = {**ENV, "NCCL_TUNER_PLUGIN": "/var/lib/nccltune/libnccl-tuner-nccltune-0123456789abcdef.so",
           "NCCLTUNE_TUNER_TABLE": "/var/lib/nccltune/nccltune-tuner-table-0123456789abcdef.txt",
           "NCCLTUNE_TUNER_FINGERPRINT": "0123456789abcdef"}
    assert existing_tuner(own, []) is None
    pipe, _ = _plan(Config(), own)
    plan = pipe.plan()[0]
    assert plan.per_size is not None and plan.per_size.active
    assert not {"NCCL_TUNER_PLUGIN", "NCCLTUNE_TUNER_TABLE", "NCCLTUNE_TUNER_FINGERPRINT"} & set(plan.pinned)


# -- the final check protects every collective of the profile ------------------------------------------


class _Trials:
    """What TableStage asks of a trial session (trial, seq, results), answered with synthetic
    measurements: NCCL's defaults at 100 GB/s everywhere (+-0.2% from trial to trial), and what
    `speed(env, phase, collective, size)` says for everything else."""

    COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, sizes: list[int], speed: Callable[[dict[str, str], str, str, int], float]) -> None:
        self.sizes, self.speed = sizes, speed
        self.nccl_version = "2.28.9"  # what the trials' NCCL said: the table's section
        self.seq = 0
        self.results: list[tuple[dict[str, str], TrialResult]] = []

    def trial(self, env: Mapping[str, str], phase: str, label: str) -> TrialResult:
        self.seq += 1
        jitter = 1.0 + 0.002 * (self.seq % 3 - 1)
        sizes = [Measurement(s, 1.0, 1.0, (100.0 if not env else self.speed(dict(env), phase, c, s)) * jitter,
                             "RING", "LL" if s < (1 << 20) else "SIMPLE", True, 16, collective=c)
                 for c in self.COLLECTIVES for s in self.sizes]
        result = TrialResult("ok", None, sizes, 1.0, nccl={"coll_channels": 16})
        self.results.append((dict(env), result))
        return result


def _stage_result(speed: Callable[[dict[str, str], str, str, int], float],
                  tmp_path: Path) -> tuple[TableOutcome, int]:
    """The per-size stage on the 2x H200 recording as a GPU node under fsdp, its trials answered by `speed`.
    The trials measure all_reduce besides fsdp's two collectives, so the table has all-reduce entries
    too; only all_gather and reduce_scatter weigh."""
    from nccltune.pipeline.tablestage import TableStage
    from nccltune.sweep import profiles
    from nccltune.sweep.pertable import per_size_candidates
    from nccltune.sweep.select import size_stats
    from nccltune.sweep.strategy import SearchResult

    cfg = parse_config("sweep:\n  profile: fsdp\n")
    pipe, _ = _plan(cfg, ENV, gpu=True)
    plan = pipe.plan()[0]
    assert plan.per_size is not None and plan.per_size.collectives == ["all_gather", "reduce_scatter"]
    got = per_size_candidates(_Trials.COLLECTIVES, ll128=True, nranks=2, nccl_version="2.28.9")
    plan.per_size = dataclasses.replace(plan.per_size, collectives=got.collectives, candidates=got.candidates)
    trials = _Trials(plan.sizes, speed)
    base_runs = [trials.trial({}, "baseline", f"defaults #{i}").busbw_by_key() for i in (1, 2, 3)]
    result = SearchResult(base_runs, size_stats(base_runs), [], [], None, None,
                          profiles.weights("fsdp", plan.sizes, {}))
    tmp_path.mkdir()
    stage = TableStage(cfg, plan, typing.cast(TrialSession, trials), work_dir=tmp_path, common={"NCCL_TOPO_FILE": "t"},
                       nranks=2, fingerprint="0123456789abcdef", demo=False)
    return stage.run(result), max(plan.sizes)


def _table_wins(slower_all_gather_at: int | None) -> Callable[[dict[str, str], str, str, int], float]:
    """Per size: Tree/LL128 (all_reduce only) wins all_reduce, Ring/LL wins all_gather; the whole
    result with the table keeps both gains in the final check, except all_gather at one size."""
    def speed(env: dict[str, str], phase: str, collective: str, size: int) -> float:
        if phase == "final" and "NCCL_TUNER_PLUGIN" in env:
            if collective == "all_gather":
                return 90.0 if size == slower_all_gather_at else 120.0
            return 130.0 if collective == "all_reduce" else 100.0
        if env.get("NCCL_ALGO") == "allreduce:Tree" and env.get("NCCL_PROTO") == "allreduce:LL128":
            return 130.0 if collective == "all_reduce" else 100.0
        if env.get("NCCL_ALGO") == "Ring" and env.get("NCCL_PROTO") == "LL":
            return 120.0 if collective == "all_gather" else 100.0
        return 100.0
    return speed


def test_a_table_that_slows_all_gather_is_not_published_under_fsdp(tmp_path: Path) -> None:
    if find_compiler() is None:
        pytest.skip("no C compiler to build the tuner plugin")
    out, largest = _stage_result(_table_wins(slower_all_gather_at=None), tmp_path / "good")
    assert out.table is not None
    assert {e.collective for e in out.table.entries} == {"allreduce", "allgather"}
    assert {(e.algo, e.proto) for e in out.table.entries if e.collective == "allreduce"} == {("tree", "ll128")}
    assert {(e.algo, e.proto) for e in out.table.entries if e.collective == "allgather"} == {("ring", "ll")}
    assert out.publication is not None and out.chosen is out.whole  # faster where fsdp weighs, slower nowhere
    # The same table, its all_gather slower at one size beyond the noise in the final check: the gains of
    # all_reduce and of all_gather elsewhere do not buy it, and nothing of the table is published.
    out, largest = _stage_result(_table_wins(slower_all_gather_at=largest), tmp_path / "bad")
    assert out.whole is not None and out.whole.verdict is not None and not out.whole.verdict.eligible
    assert "slower than the defaults" in out.whole.verdict.reason and "all_gather" in out.whole.verdict.reason
    assert out.publication is None and out.chosen is not out.whole
    assert any("was not published" in n for n in out.notes)


@pytest.mark.parametrize(("profile", "collectives", "candidates"), [
    ("ddp", ["allreduce"], 6), ("balanced", ["allreduce"], 6), ("moe", ["allreduce"], 6),
    ("fsdp", ["allgather", "reducescatter"], 3)])
def test_the_plan_measures_per_size_what_the_tuner_steers(profile: str, collectives: list[str],
                                                          candidates: int) -> None:
    from nccltune.report.sweep import plan_doc, plan_text

    pipe, trials = _plan(parse_config(f"sweep:\n  profile: {profile}\n"), ENV, gpu=True)
    plan = pipe.plan()[0]
    ps = plan.per_size
    assert ps is not None and ps.active and [COLLECTIVES[c].tuner_name for c in ps.collectives] == collectives
    assert len(ps.candidates) == candidates
    # all_reduce the only collective a tuner steers: plain NCCL_ALGO=Tree, as before there were others.
    assert all(not c.only for c in ps.candidates)
    doc = plan_doc(plan, pipe.node(), trials, 60.0, profile)
    assert doc["per_size"]["collectives"] == collectives
    plan_schema = json.loads((REPO / "schemas" / "plan.schema.json").read_text())
    validate(doc["per_size"], plan_schema["$defs"]["per_size"], plan_schema)
    pruned = {p["what"]: p["reason"] for p in doc["per_size"]["pruned"]}
    if profile == "moe":
        assert pruned["all_to_all"].startswith("not seen by NCCL's tuner")
        assert "not measured: all_to_all: not seen by NCCL's tuner" in plan_text(plan, pipe.node(), trials, 60.0,
                                                                                  profile)
    else:
        assert "all_to_all" not in pruned


def test_a_profile_of_send_recv_alone_has_no_per_size_table() -> None:
    pipe, _ = _plan(parse_config("sweep:\n  profile: pipeline\n"), ENV, gpu=True)
    plan = pipe.plan()[0]
    assert plan.per_size is not None and not plan.per_size.active
    assert plan.per_size.inactive_text.startswith("per-size tuner table not active: no measured collective is "
                                                  "steered by a tuner (sendrecv: not seen by NCCL's tuner")
    assert plan.variables["NCCL_ALGO"]  # the whole-environment search keeps them


def test_a_profile_of_all_reduce_and_all_gather_sets_tree_for_all_reduce_alone() -> None:
    from nccltune.report.sweep import plan_text

    cfg = parse_config("sweep:\n  profile: both\n  profiles:\n    both:\n      all_reduce: {1MiB: 1}\n"
                       "      all_gather: {1MiB: 1}\n")
    pipe, trials = _plan(cfg, ENV, gpu=True)
    plan = pipe.plan()[0]
    ps = plan.per_size
    assert ps is not None and ps.collectives == ["all_reduce", "all_gather"]
    assert len(ps.candidates) == 6  # no more trials than for all_reduce alone
    assert {c.env()["NCCL_ALGO"] for c in ps.candidates} == {"Ring", "allreduce:Tree"}
    text = plan_text(plan, pipe.node(), trials, 60.0, "both")
    assert "tree/ll (allreduce only): NCCL_ALGO=allreduce:Tree NCCL_PROTO=allreduce:LL" in text
    assert "NCCL's version is not known when planning" in text
