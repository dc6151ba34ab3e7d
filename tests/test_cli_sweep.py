"""`nccltune sweep`, `env`, `history` and `report` end to end, through nccltune.cli.main.

The demo runs the real pipeline (gloo, 2 ranks, the bundled 2-GPU snapshot) with a config that
keeps the trial count low: 2 runs of the defaults, one candidate, one finalist repeat.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from conftest import REPO
from demo_state import SHORT_CONFIG, DemoSweep, copy_state

from nccltune.cli import main
from nccltune.files.lock import SweepLock
from nccltune.publish import DEMO_LINE, read_set
from nccltune.publish.applied import APPLIED_VAR
from nccltune.sweep.space import CATALOGUE
from nccltune.trials.runner import RANK_RECORD
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

# Everything but NCCL_ALGO that could be measured on one node (network knobs are pruned anyway).
EXCLUDE = [name for name, t in CATALOGUE.items() if t.kind == "perf" and t.scope == "node" and name != "NCCL_ALGO"]
CONFIG = (
    "sweep:\n"
    "  baseline_repeats: 2\n"
    "  finalist_repeats: 1\n"
    "  max_finalists: 1\n"
    "  variables:\n"
    "    NCCL_ALGO: [Ring]\n"
    f"  exclude: [{', '.join(EXCLUDE)}]\n"
)
DEMO_BANNER = "CPU DEMO (gloo backend)"


def _clean_environ() -> dict[str, str]:
    # NCCL_* variables of whoever runs the tests would be pinned into the plan.
    return {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}


def cli(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {**_clean_environ(), **(env or {})}, clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def cli_json(*args: str | Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    rc, out, err = cli(*args, "--json", env=env)
    assert rc == 0, err
    doc = json.loads(out)
    assert isinstance(doc, dict)
    assert doc["schema_version"] == 1
    return doc


@pytest.fixture
def demo(demo_sweep: DemoSweep) -> DemoSweep:
    """The shared real demo sweep (conftest), read by the tests that check what it left."""
    return demo_sweep


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    return path


# -- the plan ---------------------------------------------------------------------------------------


def test_the_plan_says_how_many_trials_the_final_check_may_add(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("finalist_repeats: 1", "finalist_repeats: 2\n  max_finalist_repeats: 6"))
    doc = cli_json("sweep", "--plan", "--demo", "--config", config, "--state-dir", tmp_path / "state")
    # 2 baselines, 2 screening runs, then the finalist, the topology file and the defaults: 2
    # rounds at the first look, 6 at the last (sweep.max_final_trials 0: no bound).
    estimate = doc["estimate"]
    assert (estimate["trials"], estimate["most_trials"]) == (2 + 2 + 3 * 2, 2 + 2 + 3 * 6)
    assert estimate["most_seconds"] > estimate["seconds"] > 0
    rc, out, _err = cli("sweep", "--plan", "--demo", "--config", config, "--state-dir", tmp_path / "state")
    assert rc == 0
    assert "Estimate: about 10 trials" in out and "At most 22 trials" in out


def test_plan_json_lists_what_is_measured_pruned_and_the_estimate(config: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    doc = cli_json("sweep", "--plan", "--demo", "--config", config, "--state-dir", state)
    assert doc["kind"] == "plan"
    assert doc["demo"] is True and DEMO_BANNER in doc["label"]
    assert doc["backend"] == "gloo" and doc["nranks"] == 2
    assert doc["measure"] == {"NCCL_ALGO": ["Ring"]}
    pruned = {(p["name"], p["value"]): p["reason"] for p in doc["pruned"]}
    assert all(reason for reason in pruned.values())
    assert pruned[("NCCL_BUFFSIZE", "*")] == "excluded by config (sweep.exclude)"
    assert "single-node" in pruned[("NCCL_NET_GDR_LEVEL", "*")]
    # 2 baselines, NCCL_ALGO=Ring and the topology file alone, then one round of the finalist,
    # the topology file and the defaults.
    assert doc["estimate"]["trials"] == 2 + 2 + 2 + 1
    assert doc["estimate"]["seconds"] > 0
    # One finalist round asked for: the final check adds none, so the most is the estimate.
    assert (doc["estimate"]["most_trials"], doc["estimate"]["most_seconds"]) == (7, doc["estimate"]["seconds"])
    assert doc["policy"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    # A plan measures nothing and keeps no state.
    assert not state.exists()


def test_plan_on_the_pcie_snapshot_prunes_by_topology(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("sweep:\n  profile: large\n")
    doc = cli_json("sweep", "--plan", "--demo", "pcie-4gpu-2socket", "--config", config,
                   "--state-dir", tmp_path / "state")
    assert doc["profile"] == "large"
    assert doc["measure"]["NCCL_P2P_LEVEL"] == ["LOC", "SYS"]
    # Protocols are measured per size (for the tuner table) here: never LL128 on this PCIe node.
    assert "LL128" not in doc["measure"].get("NCCL_PROTO", [])
    assert doc["per_size"]["active"] and doc["per_size"]["candidates"]
    assert all(c["env"].get("NCCL_PROTO") != "LL128" for c in doc["per_size"]["candidates"])
    assert "NCCL_NVLS_ENABLE" not in doc["measure"]
    reasons = {(p["name"], p["value"]): p["reason"] for p in doc["pruned"]}
    assert "default" in reasons[("NCCL_P2P_LEVEL", "PXB")]
    assert "LL128" in reasons[("NCCL_PROTO", "LL128")]


def test_plan_text_is_labelled_as_a_demo(config: Path, tmp_path: Path) -> None:
    rc, out, err = cli("sweep", "--plan", "--demo", "--config", config, "--state-dir", tmp_path / "s")
    assert rc == 0, err
    assert out.startswith(f"*** {DEMO_BANNER}")
    assert "NCCL_ALGO: Ring" in out


def test_unpin_sweeps_a_variable_the_environment_sets(config: Path, tmp_path: Path) -> None:
    args = ["sweep", "--plan", "--demo", "--config", str(config), "--state-dir", str(tmp_path / "s")]
    pinned = cli_json(*args, env={"NCCL_ALGO": "Tree"})
    unpinned = cli_json(*args, "--unpin", "NCCL_ALGO", env={"NCCL_ALGO": "Tree"})
    assert pinned["pinned"]["NCCL_ALGO"] == {"value": "Tree", "source": "environment", "warning": None}
    assert "NCCL_ALGO" not in pinned["measure"]
    assert "NCCL_ALGO" not in unpinned["pinned"]
    assert unpinned["measure"] == {"NCCL_ALGO": ["Ring"]}


# -- a real demo sweep ------------------------------------------------------------------------------


def test_demo_sweep_json_is_labelled_and_publishes(demo: DemoSweep) -> None:
    doc = demo.doc
    assert doc["schema_version"] == 1 and doc["kind"] == "sweep"
    assert doc["demo"] is True and DEMO_BANNER in doc["label"]
    assert doc["summary"].startswith("[CPU demo, not NCCL numbers]")
    assert doc["backend"] == "gloo"
    assert doc["torch_version"]
    assert doc["method"] == "in-place; host clock"  # gloo: torch's all_reduce, host-timed
    assert doc["failed_trials"] == []
    # 2 baselines and 2 screened; then the topology file alone (and NCCL_ALGO=Ring only when it
    # screened above the noise) and one more run of the defaults.
    assert doc["trials"] in (6, 7)
    run_dir = demo.state / "runs" / f"{doc['run_id']:05d}"
    assert len(list(run_dir.glob("trial-*"))) == doc["trials"]
    assert [r["size_bytes"] for r in doc["sizes"]] == [4096, 16384, 65536, 262144, 1048576, 4194304]
    assert all(r["default_busbw_gbps"] > 0 for r in doc["sizes"])
    published = doc["published"]
    for key in ("sh", "env", "json"):
        assert Path(published[key]).parent == demo.state
        assert Path(published[key]).is_file()
    assert published["generation"] == 1
    assert doc["published_env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    # No NCCL variable of the demo host leaks in; only what the search chose and the policy.
    assert set(doc["published_env"]) <= {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ALGO", "NCCL_TOPO_FILE"}
    if "NCCL_TOPO_FILE" in doc["published_env"]:
        # The generation's own copy, as the published files name it; the stable path holds the same XML.
        own = Path(doc["published_env"]["NCCL_TOPO_FILE"])
        assert own == demo.state / "generations" / "1" / "ncclTopology.xml"
        assert own.read_text() == (demo.state / "ncclTopology.xml").read_text()
    # With --json, stdout is the one document (parsed above) and the per-trial progress lines go to
    # stderr, one per trial, numbered in order.
    lines = [ln for ln in demo.stderr.splitlines() if ln.startswith("nccltune: trial ")]
    assert [int(ln.split()[2].split("/")[0]) for ln in lines] == list(range(1, doc["trials"] + 1))


def test_published_files_can_be_sourced_by_sh(demo: DemoSweep) -> None:
    expected = demo.doc["published_env"]
    sh_text = (demo.state / "nccl.sh").read_text()
    sourced = _sourced(demo.state / "nccl.sh")
    assert {k: sourced[k] for k in expected} == expected
    assert DEMO_LINE in sh_text
    env_file = (demo.state / "nccl.env").read_text()
    assert DEMO_LINE in env_file
    assert _assignments(env_file) == expected
    # The last line: the marker of what the file sets (the set's generation and digest, every name).
    got = read_set(demo.state)
    assert got is not None
    assert env_file.splitlines()[-1] == f"{APPLIED_VAR}={got.set_id}:{','.join(sorted(expected))}"
    assert sourced[APPLIED_VAR] == f"{got.set_id}:{','.join(sorted(expected))}"
    doc = json.loads((demo.state / "nccl.json").read_text())
    assert doc["env"] == expected
    assert doc["provenance"]["demo"] is True and doc["provenance"]["backend"] == "gloo"
    # Nothing half-written is left next to them.
    assert not [p.name for p in demo.state.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]


def _sourced(path: Path) -> dict[str, str]:
    """The environment after `. path` in a POSIX sh that starts with nothing but PATH."""
    got = subprocess.run(["sh", "-c", 'set -e; . "$1"; env', "sh", str(path)], capture_output=True,
                         text=True, check=True, env={"PATH": os.environ["PATH"]})
    return dict(line.split("=", 1) for line in got.stdout.splitlines() if "=" in line)


def _assignments(text: str) -> dict[str, str]:
    """The variables a published text sets, less the marker of what it sets."""
    return dict(line.split("=", 1) for line in text.splitlines()
                if line and not line.startswith(("#", f"{APPLIED_VAR}=")))


@pytest.mark.parametrize("fmt", ["env", "sh", "json"])
def test_env_prints_what_was_published(demo: DemoSweep, fmt: str, tmp_path: Path) -> None:
    rc, out, err = cli("env", "--format", fmt, *demo.args())
    assert rc == 0, err
    expected = demo.doc["published_env"]
    if fmt == "json":
        doc = json.loads(out)
        assert doc["env"] == expected
        assert doc["provenance"]["demo"] is True
    elif fmt == "env":
        assert _assignments(out) == expected
        assert DEMO_LINE in out
    else:
        script = tmp_path / "printed.sh"
        script.write_text(out)
        sourced = _sourced(script)
        assert {k: sourced[k] for k in expected} == expected
        assert DEMO_LINE in out


@pytest.mark.parametrize(("fmt", "name"), [("env", "nccl.env"), ("sh", "nccl.sh")])
def test_env_prints_the_published_file_exactly(demo: DemoSweep, fmt: str, name: str) -> None:
    rc, out, err = cli("env", "--format", fmt, *demo.args())
    assert rc == 0, err
    assert out == (demo.state / name).read_text()


def test_env_without_anything_published_is_a_check_failure(tmp_path: Path, config: Path) -> None:
    rc, _out, err = cli("env", "--config", config, "--state-dir", tmp_path / "empty")
    assert rc == 1
    assert "nothing is published" in err


def test_history_records_the_run(demo: DemoSweep) -> None:
    doc = cli_json("history", *demo.args())
    assert doc["kind"] == "history"
    run = doc["runs"][0]
    assert run["id"] == demo.doc["run_id"]
    assert (run["kind"], run["status"], run["backend"], run["demo"]) == ("sweep", "ok", "gloo", True)
    # The run keeps the setting as measured, with the stable copy of the topology file; the
    # published set names its generation's own copy.
    measured = {**demo.doc["published_env"], **demo.doc["single_node_env"]}
    if "NCCL_TOPO_FILE" in measured:
        measured["NCCL_TOPO_FILE"] = str(demo.state / "ncclTopology.xml")
    assert run["chosen_env"] == measured
    one = cli_json("history", "--run", str(run["id"]), *demo.args())
    assert len(one["trials"]) == demo.doc["trials"]
    assert [t["seq"] for t in one["trials"]] == list(range(1, demo.doc["trials"] + 1))
    assert all(t["status"] == "ok" for t in one["trials"])
    assert [t["phase"] for t in one["trials"][:2]] == ["baseline", "baseline"]
    assert one["trials"][-1]["phase"] == "baseline"
    rc, out, err = cli("history", *demo.args())
    assert rc == 0, err
    assert "[CPU demo]" in out


def test_history_of_an_unknown_run_is_a_usage_error(demo: DemoSweep) -> None:
    rc, _out, err = cli("history", "--run", "999", *demo.args())
    assert rc == 2 and "no run 999" in err


def test_report_shows_the_last_sweep(demo: DemoSweep) -> None:
    doc = cli_json("report", *demo.args())
    assert doc["kind"] == "report"
    assert DEMO_BANNER in doc["label"]
    assert doc["run"]["id"] == demo.doc["run_id"]
    assert doc["sizes"] == demo.doc["sizes"]
    assert doc["trials"] == demo.doc["trials"]
    rc, out, err = cli("report", *demo.args())
    assert rc == 0, err
    assert out.startswith(f"*** {DEMO_BANNER}")


def test_a_second_sweep_in_text_form_publishes_a_new_generation(demo: DemoSweep, tmp_path: Path) -> None:
    state = tmp_path / "state"
    copy_state(demo.state, state)
    # The shortest sweep: a new generation is published whatever the sweep searched.
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump(SHORT_CONFIG))
    rc, out, err = cli("sweep", "--demo", "--config", short, "--state-dir", state)
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"*** {DEMO_BANNER}") and lines[-1].startswith(f"*** {DEMO_BANNER}")
    assert json.loads((state / "nccl.json").read_text())["provenance"]["generation"] == 2
    runs = cli_json("history", *demo.args(state))["runs"]
    assert [r["status"] for r in runs] == ["ok", "ok"]


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA driver")
def test_plain_sweep_without_nvml_exits_69_and_points_to_demo(config: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    rc, out, err = cli("sweep", "--config", config, "--state-dir", state)
    assert rc == 69
    assert out == ""
    assert "--demo" in err
    assert not state.exists()


def test_unknown_config_key_exits_78_naming_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("sweep:\n  baseline_repeats: 2\n  finalist_repeat: 1\n")
    state = tmp_path / "state"
    rc, _out, err = cli("sweep", "--demo", "--config", config, "--state-dir", state)
    assert rc == 78
    assert f"{config}:3" in err and "finalist_repeat" in err
    assert not state.exists()


@pytest.mark.parametrize(("value", "problem"), [
    ("NCCL_P2P_LEVEL: [nvl]", "case-sensitive"),
    ('NCCL_ALGO: ["allreduce:ring;tree"]', "only the first entry may omit the function"),
    ('NCCL_BUFFSIZE: ["010"]', "octal"),
    ('NCCL_NTHREADS: ["100"]', "multiple of 32"),
    ("NCCL_ALOG: [Ring]", "not a variable nccltune knows"),
])
def test_invalid_sweep_variables_exit_78(tmp_path: Path, value: str, problem: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"sweep:\n  variables:\n    {value}\n")
    state = tmp_path / "state"
    rc, _out, err = cli("sweep", "--demo", "--config", config, "--state-dir", state)
    assert rc == 78
    assert f"{config}:3" in err and problem in err
    assert not (state / "history.db").exists() and not (state / "runs").exists()
    rc, _out, err = cli("sweep", "--plan", "--demo", "--config", config, "--state-dir", state)
    assert rc == 78 and problem in err


def test_a_second_sweep_while_the_lock_is_held_exits_75(config: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with SweepLock(state / "sweep.lock"):
        rc, _out, err = cli("sweep", "--demo", "--config", config, "--state-dir", state)
    assert rc == 75
    assert f"pid {os.getpid()}" in err
    assert not (state / "history.db").exists() and not (state / "runs").exists()


def test_an_unwritable_state_dir_is_refused_and_leaves_nothing(config: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    state = blocker / "state"
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, out, err = cli("sweep", "--demo", "--config", config, "--state-dir", state)
    assert rc != 0
    assert str(state) in err
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert blocker.read_text() == "not a directory\n"


# -- Ctrl-C -----------------------------------------------------------------------------------------


def _recorded_ranks(state: Path) -> set[int]:
    """The pids in the sweep's rank record (RANK_RECORD: one "pid start_time" line per live rank)."""
    try:
        return {int(line.split()[0]) for line in (state / RANK_RECORD).read_text().splitlines() if line.strip()}
    except OSError:
        return set()


def _wait_for(predicate: Any, timeout_s: float, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the sweep ended early ({proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the sweep")
        time.sleep(0.05)


def test_ctrl_c_kills_the_ranks_keeps_the_published_files_and_records_the_run(
        demo: DemoSweep, tmp_path: Path) -> None:
    state = tmp_path / "state"
    copy_state(demo.state, state)
    published = {p.name: p.read_bytes() for p in state.iterdir()
                 if p.name in ("nccl.sh", "nccl.env", "nccl.json", "ncclTopology.xml")}
    assert {"nccl.sh", "nccl.env", "nccl.json"} <= set(published)
    old_runs = {p.name for p in (state / "runs").iterdir()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nccltune", "sweep", "--demo", "--config", str(demo.config),
         "--state-dir", str(state)],
        # Rank 1 hangs in every trial: the interrupt lands in the middle of the first.
        cwd=tmp_path, env={**_clean_environ(), "PYTHONPATH": str(REPO), FAULT_VAR: "hang@1"}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A test run started in the background (nohup, `&` without job control) ignores SIGINT, and
        # children inherit that; give the sweep the default disposition a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        def first_trial_running() -> bool:
            # The first trial's directory exists, both ranks are in the rank record, and rank 0
            # has set up its process group and said so.
            new = [p for p in (state / "runs").iterdir() if p.name not in old_runs]
            out = new[0] / "trial-001" / "rank0.out" if new else None
            if out is None or not out.is_file() or out.stat().st_size == 0:
                return False
            rank_pids.update(_recorded_ranks(state))
            return len(rank_pids) == 2

        rank_pids: set[int] = set()

        _wait_for(first_trial_running, 60, proc)
        # What a terminal's Ctrl-C does: SIGINT to the foreground process group (the ranks run in
        # sessions of their own, so they do not get it).
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # pragma: no cover - only when the test already failed
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert len(rank_pids) == 2
    for pid in rank_pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert not _processes_under(state)
    # The last published files are byte-for-byte what they were.
    for name, data in published.items():
        assert (state / name).read_bytes() == data, name
    assert not [p.name for p in state.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    runs = cli_json("history", "--config", demo.config, "--state-dir", state)["runs"]
    assert runs[0]["status"] == "interrupted"
    assert runs[0]["id"] == max(int(n) for n in old_runs) + 1
    assert runs[1]["status"] == "ok"
    # The lock went with the process.
    SweepLock(state / "sweep.lock").acquire()


def _processes_under(directory: Path) -> list[int]:
    """Processes whose working directory is inside `directory` (trial ranks run in theirs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd.startswith(str(directory)):
            found.append(int(entry.name))
    return found
