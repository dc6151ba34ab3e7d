"""A sweep killed after its generation became current, before it closed its run, is recorded as
having published that generation; a dead run that no generation names stays interrupted.

The kill is a real one (SIGKILL, as kill -9 or the OOM killer): a real CPU-demo sweep runs in a
child whose Store.finish_run is wrapped by the test so that the child kills itself at the moment
the sweep closes its run with a published generation, that is right after the publish."""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from demo_state import EXCLUDE, SNAPSHOT, clean_env

from nccltune.files.atomicfile import TEMP_NAME_RE
from nccltune.publish import read_set
from nccltune.store import PublishedRun, Store
from nccltune.trials.session import close_dead_runs

REPO = Path(__file__).resolve().parents[1]

# The fewest trials a demo sweep makes: nothing swept, the defaults twice, the topology file alone.
CONFIG: dict[str, Any] = {
    "sweep": {"baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1, "exclude": [*EXCLUDE, "NCCL_ALGO"]},
    "tuner": {"plugin": "keep"},
}

# The child: nccltune's own command line, with finish_run replaced by a self-kill when the sweep
# closes its run as published. Nothing of this lives in nccltune.
KILLED_AT_FINISH = """
import os, signal, sys
from nccltune.store.history import Store

def finish_run(self, run_id, **kw):
    if kw.get("published_generation") is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(f"the sweep closed its run without a generation: {kw}")

Store.finish_run = finish_run
from nccltune.cli import main
sys.exit(main(sys.argv[1:]))
"""


# The child: nccltune's own command line, killed (SIGKILL) in the middle of writing the file whose
# path ends with argv[1]: after its temp file is written, before the rename.
KILLED_MID_WRITE = """
import os, signal, sys
from nccltune.files import atomicfile

target = sys.argv.pop(1)
real = atomicfile.write_temp

def write_temp(path, data, mode, owner=None):
    tmp = real(path, data, mode, owner)
    if str(path).endswith(target):
        os.kill(os.getpid(), signal.SIGKILL)
    return tmp

atomicfile.write_temp = write_temp
from nccltune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _nccltune(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=str(REPO)), timeout=120, cwd=cwd, check=False)


def _patched_sweep(child: str, tmp_path: Path, *child_args: str,
                   config_doc: dict[str, Any] = CONFIG) -> subprocess.CompletedProcess[str]:
    """A demo sweep of CONFIG into tmp_path/state, run by `child` (nccltune's command line with a
    test-only patch applied first, given `child_args` before the command's own)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_doc))
    return subprocess.run(
        [sys.executable, "-c", child, *child_args, "sweep", "--demo", str(SNAPSHOT), "--config", str(config),
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, env=clean_env(PYTHONPATH=str(REPO)), timeout=300, cwd=tmp_path, check=False)


def test_a_sweep_killed_right_after_its_publish_is_recorded_as_published(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    state = tmp_path / "state"
    killed = _patched_sweep(KILLED_AT_FINISH, tmp_path)
    assert killed.returncode == -9, killed.stderr
    published = read_set(state)
    assert published is not None
    prov = published.provenance
    assert prov["history"] == str((state / "history.db").resolve())
    # Killed before closing: the record still says running.
    with Store(state / "history.db") as store:
        (run,) = store.runs()
        assert (run.id, run.status, run.published_generation) == (prov["run_id"], "running", None)

    got = _nccltune("history", "--json", "--state-dir", str(state), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    (doc,) = json.loads(got.stdout)["runs"]
    assert (doc["id"], doc["status"], doc["published_generation"]) == (prov["run_id"], "ok", published.generation)
    assert doc["finished_at"] is not None and doc["chosen_env"] == published.env
    assert f"publishing generation {published.generation}" in doc["summary"]["summary"]
    assert doc["summary"]["trials"] >= 3


@pytest.mark.parametrize("target", ["runs/00001/ncclTopology.xml", "state/ranks.running",
                                    "metrics/nccltune.prom"])
def test_a_sweep_killed_mid_write_leaves_no_temp_file_after_the_next_start(tmp_path: Path, target: str) -> None:
    """Killed between writing a temp file and renaming it (the run's topology copy, the record of
    running ranks in the state directory, the metrics after the run): the next sweep's start
    removes what the dead writer left, wherever nccltune writes, and leaves no temp file of its own."""
    pytest.importorskip("torch")
    state = tmp_path / "state"
    with_metrics = {**CONFIG, "publish": {"metrics_dir": "metrics"}}
    killed = _patched_sweep(KILLED_MID_WRITE, tmp_path, target, config_doc=with_metrics)
    assert killed.returncode == -9, killed.stderr
    left = [p for p in state.rglob("*") if TEMP_NAME_RE.match(p.name)]
    assert left and all(p.name.startswith(f".{Path(target).name}.tmp-") for p in left), left

    again = _nccltune("sweep", "--demo", str(SNAPSHOT), "--config", str(tmp_path / "config.yaml"),
                      "--state-dir", str(state), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert [p for p in state.rglob("*") if ".tmp-" in p.name] == []


def _publish_naming(state: Path, run_id: int, history: Path) -> int:
    """A generation whose provenance names `run_id` of `history` (as a sweep's does)."""
    from nccltune.config import Config
    from nccltune.publish import Provenance, Setting, publish_setting

    prov = Provenance(nccltune_version="0", created_at="2030-01-02T03:04:05+00:00", topology_fingerprint="0" * 16,
                      nccl_version=None, backend="gloo", demo=True, profile=None, run_id=run_id,
                      history=str(history.resolve()))
    cfg = Config(state_dir=str(state))
    return publish_setting(cfg, Setting({"NCCL_ALGO": "Ring"}, prov, where="test")).generation


def _start(store: Store) -> int:
    return store.start_run(kind="sweep", fingerprint="fp", backend="gloo", demo=True, profile=None,
                           nccl_version=None, driver_version=None, torch_version=None, nccltune_version="0",
                           hostname="h", topology={}, config={})


def test_only_the_run_the_current_generation_names_is_recorded_as_published(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    with Store(state / "history.db") as store:
        named, other = _start(store), _start(store)
        generation = _publish_naming(state, named, state / "history.db")
        assert close_dead_runs(store, state) == 2
        runs = {r.id: r for r in store.runs()}
    assert (runs[named].status, runs[named].published_generation) == ("ok", generation)
    assert runs[named].finished_at is not None and runs[named].finished_at.startswith("2030-01-02T03:04:05")
    assert (runs[other].status, runs[other].published_generation, runs[other].finished_at) == \
        ("interrupted", None, None)


def test_a_run_named_by_another_historys_generation_stays_interrupted(tmp_path: Path) -> None:
    """The same run id in another state directory's history is another run."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    with Store(state / "history.db") as store:
        run = _start(store)
        _publish_naming(state, run, tmp_path / "elsewhere" / "history.db")
        assert close_dead_runs(store, state) == 1
        (record,) = store.runs()
    assert (record.status, record.published_generation) == ("interrupted", None)


def test_a_dead_run_with_nothing_published_stays_interrupted(tmp_path: Path) -> None:
    with Store(tmp_path / "history.db") as store:
        run = _start(store)
        assert close_dead_runs(store, tmp_path / "nothing-here") == 1
        assert store.mark_interrupted() == 0
        (record,) = store.runs()
    assert (record.id, record.status, record.published_generation) == (run, "interrupted", None)


def test_the_store_leaves_a_finished_run_named_as_published_alone(tmp_path: Path) -> None:
    with Store(tmp_path / "history.db") as store:
        run = _start(store)
        store.finish_run(run, status="failed")
        moment = _dt.datetime(2030, 1, 1, tzinfo=_dt.timezone.utc)
        assert store.mark_interrupted(PublishedRun(run, 3, moment, {})) == 0
        (record,) = store.runs()
    assert (record.status, record.published_generation) == ("failed", None)


# The child: SIGTERM (systemd stopping the unit, scancel) arrives right after the publish, while the
# sweep writes its summary.
TERMINATED_AFTER_PUBLISH = """
import os, signal, sys
from nccltune.pipeline import stages

summary = stages._Sweep._summary

def terminated(self, *args, **kw):
    os.kill(os.getpid(), signal.SIGTERM)
    return summary(self, *args, **kw)

stages._Sweep._summary = terminated
from nccltune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_sweep_terminated_right_after_its_publish_records_the_generation(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    state = tmp_path / "state"
    ended = _patched_sweep(TERMINATED_AFTER_PUBLISH, tmp_path)
    assert ended.returncode != 0, ended.stdout
    published = read_set(state)
    assert published is not None
    with Store(state / "history.db") as store:
        (run,) = store.runs()
        assert (run.id, run.status, run.published_generation) == (published.provenance["run_id"], "ok",
                                                                   published.generation)
        assert run.summary["ended_after_publish"] == published.generation
        assert run.chosen_env == published.env


def test_verify_after_a_run_recovered_as_published_says_why_it_has_no_expectation(tmp_path: Path) -> None:
    from nccltune import __version__
    from nccltune.checks.verify import _expectations
    from nccltune.config import load_config, with_overrides
    from nccltune.errors import CheckFailed
    from nccltune.node import load_node

    cfg = with_overrides(load_config(None), state_dir=str(tmp_path / "state"))
    node = load_node(cfg, str(SNAPSHOT))
    (tmp_path / "state").mkdir()
    with Store(tmp_path / "state" / "history.db") as store:
        run = store.start_run(kind="sweep", fingerprint=node.fingerprint, backend=node.backend, demo=True,
                              profile=None, nccl_version=None, driver_version=None, torch_version=None,
                              nccltune_version=__version__, hostname="n", topology={}, config={})
        created = _dt.datetime.now(_dt.timezone.utc)
        assert store.mark_interrupted(PublishedRun(run_id=run, generation=1, published_at=created, env={})) == 1
        with pytest.raises(CheckFailed, match=f"sweep {run} published generation 1 but ended before"):
            _expectations(store, node, None, False, [1 << 20], ("all_reduce",))
