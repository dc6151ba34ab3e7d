"""The per-size stage in the plan and the sweep: trial counts on the 2x H200 recording, the tuner.plugin
key, an NCCL_TUNER_PLUGIN already set (plan and doctor), and a CPU-demo sweep end to end with its table."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from demo_state import SNAPSHOT, clean_env

from nccltune.config import Config, TunerConfig, parse_config
from nccltune.doctor import diagnose, existing_tuner
from nccltune.errors import InputError
from nccltune.node import Node, load_node
from nccltune.pipeline import SweepPipeline
from nccltune.sweep.space import CATALOGUE
from nccltune.topology.paths import compute_paths
from nccltune.tuner.table import parse_table

# Without NCCL variables and with no NCCL conf file of whoever runs the tests.
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "NCCL_CONF_FILE": "/nonexistent/nccl.conf"}


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
    from nccltune.render import plan_doc, plan_text

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
    assert existing_tuner({}, [conf]) == ("sitetuner", str(conf))
    # The environment comes first, as with NCCL; nccltune's own plugin is not a foreign tuner.
    assert existing_tuner({"NCCL_TUNER_PLUGIN": "other"}, [conf]) == ("other", "the environment")
    assert existing_tuner({"NCCL_TUNER_PLUGIN": "/x/libnccl-tuner-nccltune.so"}, [conf]) is None
    topo = load_node(Config(), str(SNAPSHOT)).topo
    findings = diagnose(topo, compute_paths(topo), env={}, publish_dir=tmp_path / "none", conf_files=[conf])
    got = [f for f in findings if f.code == "tuner-plugin-kept"]
    assert len(got) == 1 and "NCCL_TUNER_PLUGIN=sitetuner" in got[0].message and str(conf) in got[0].message
    loud = diagnose(topo, compute_paths(topo), env={}, publish_dir=tmp_path / "none", conf_files=[conf],
                    tuner_mode="nccltune")
    assert [f.severity for f in loud if f.code == "tuner-plugin-replaced"] == ["warning"]


def test_no_compiler_means_no_table_in_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nccltune.planning.find_compiler", lambda cc=None: None)
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
    path = Path(table["table_path"])
    assert path.parent == state / "runs" / f"{run.id:05d}"
    parsed = parse_table(path.read_text(), str(path))
    assert len(parsed.entries) == len(table["entries"])
    assert all((e.nnodes, e.nranks, e.ranks_per_node) == (1, 2, 2) for e in parsed.entries)
    for e in table["entries"]:
        assert f"{e['algo']}/{e['proto']}" in got.stdout
    # Nothing of the tuner reaches the published environment.
    published = (state / "nccl.env").read_text()
    assert "NCCL_TUNER_PLUGIN" not in published and "NCCLTUNE_TUNER" not in published


def test_the_table_and_plugin_are_published_in_the_set_and_the_single_node_part_apart(tmp_path: Path) -> None:
    from nccltune.publish import Provenance, Tuner, publish, read_set
    from nccltune.tuner.build import build_plugin
    from nccltune.tuner.table import TableEntry, TunerTable, render_table

    fp = "0123456789abcdef"
    run_dir = tmp_path / "runs" / "00007"
    built = build_plugin(run_dir)
    assert built.ok and built.path is not None, built.message
    text = render_table(TunerTable(fp, (TableEntry("allreduce", 0, 1 << 20, 1, 2, 2, "ring", "ll", 0),)))
    prov = Provenance(nccltune_version="0", created_at="2026-12-01T00:00:00+00:00", topology_fingerprint="t",
                      nccl_version=None, backend="nccl", demo=False, profile="balanced", tuning_fingerprint=fp)
    publish_dir = tmp_path / "published"
    published = publish(publish_dir, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, prov,
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
