"""What a local user can put in front of root besides the files root trusts: a module planted
where root stands (never imported by a probe, a search for torch or a trial), and documents made
to break the readers (nested past any stack, a key twice, NaN, an environment value no launcher
may source), a full disk and a read-only history. Each: a documented exit code, the file named,
no traceback, nothing published changed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NCCL_TESTS_OUTPUT, fill_up
from demo_state import SNAPSHOT, DemoSweep, clean_env, copy_state
from fleet_fixtures import demo_profile
from second_user import published_digests

from nccltune.errors import EXIT_CHECK_FAILED, EXIT_CONFIG, EXIT_OK, InputError, UnavailableError
from nccltune.files import trust
from nccltune.files.inputfile import MAX_JSON_DEPTH, loads_strict
from nccltune.fleet.decide import dumps_profile
from nccltune.store import Store
from nccltune.trials import runner as runner_module
from nccltune.trials.probe import probe_nccl
from nccltune.trials.runner import Runner, find_worker_python

CLI_S = 240.0


def nccltune(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *map(str, args)], capture_output=True, text=True,
                          env=clean_env(), timeout=CLI_S, cwd=cwd, check=False)


def refused(got: subprocess.CompletedProcess[str], *named: str, code: int = EXIT_CONFIG) -> None:
    assert got.returncode == code, got.stderr
    assert "Traceback" not in got.stderr
    for name in named:
        assert name in got.stderr, got.stderr


# -- a planted torch.py ------------------------------------------------------------------------------


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """A directory holding a torch.py that leaves a marker file when imported, made the working
    directory and put on PYTHONPATH; and the marker's path."""
    here = tmp_path / "planted"
    here.mkdir()
    marker = tmp_path / "torch-was-imported"
    (here / "torch.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(here)
    monkeypatch.setenv("PYTHONPATH", str(here))
    yield here, marker


def test_the_planted_module_is_imported_by_a_python_that_is_not_isolated(planted: tuple[Path, Path]) -> None:
    # The control: the plant works, so its absence below means something.
    here, marker = planted
    subprocess.run([sys.executable, "-c", "import torch"], cwd=here, check=False, capture_output=True)
    assert marker.exists()


def test_the_probe_never_imports_from_the_working_directory(planted: tuple[Path, Path]) -> None:
    pytest.importorskip("torch")
    _, marker = planted
    info = probe_nccl(sys.executable)
    assert not marker.exists()
    assert info.get("torch_version"), info  # the real torch answered


def test_the_search_for_an_interpreter_with_torch_is_isolated(planted: tuple[Path, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _, marker = planted
    system_python = shutil.which("python3", path=trust.SAFE_PATH)
    if system_python is None or os.path.realpath(system_python) == os.path.realpath(sys.executable):
        pytest.skip("no other python3 in the system directories to search")
    # As on a node whose nccltune has no torch: the search asks the system's interpreters.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    try:
        found = find_worker_python(None)
    except UnavailableError as exc:  # no interpreter with torch is an answer too
        found = type(exc).__name__
    assert not marker.exists(), found


def test_a_demo_trial_never_imports_from_the_working_directory(planted: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _, marker = planted
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    assert base_env["PYTHONPATH"].endswith("planted")
    trial = Runner(python=sys.executable, backend="gloo", nranks=2, base_env=base_env, work_dir=tmp_path / "work",
                   timeout_s=120.0)
    result = trial.run({}, [4096], warmup=1, iters=2, label="planted")
    assert result.status == "ok", result.reason
    assert not marker.exists()
    argv = trust.python_argv(sys.executable, str(runner_module.WORKER))
    assert argv[1] == "-I"


# -- documents made to break the readers ----------------------------------------------------------------


def test_strict_json_refuses_depth_duplicates_and_nan() -> None:
    with pytest.raises(ValueError, match="nested deeper"):
        loads_strict("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested deeper"):
        loads_strict("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    assert loads_strict("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    with pytest.raises(ValueError, match="duplicate key 'env'"):
        loads_strict('{"env": {}, "env": {"NCCL_P2P_DISABLE": "1"}}')
    with pytest.raises(ValueError, match="NaN is not JSON"):
        loads_strict('{"gain": NaN}')
    with pytest.raises(ValueError, match="Infinity is not JSON"):
        loads_strict('{"gain": -Infinity}')
    # Half a UTF-16 pair is no character: such a text has no UTF-8 form to write anywhere.
    with pytest.raises(ValueError, match=r"\$\.env\.NCCL_ALGO: a lone surrogate escape"):
        loads_strict('{"env": {"NCCL_ALGO": "Ring\\ud800"}}')
    with pytest.raises(ValueError, match=r"\$\.runs\[1\] \(a key\): a lone surrogate escape"):
        loads_strict('{"runs": [{}, {"\\udfff": 1}]}')
    assert loads_strict('["\\ud83d\\ude00", "\\\\ud800"]') == ["\U0001F600", "\\ud800"]


@pytest.fixture(scope="module")
def profile(demo_sweep: DemoSweep, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    return out, demo_profile(demo_sweep.state, SNAPSHOT, out)


def _apply(demo_sweep: DemoSweep, tmp_path: Path, path: Path) -> tuple[subprocess.CompletedProcess[str], bool]:
    """`apply PATH` on a copy of the demo node; whether the published set stayed byte for byte."""
    state = tmp_path / "state"
    if not state.exists():
        copy_state(demo_sweep.state, state)
    before = published_digests(state)
    got = nccltune("apply", path, "--demo", SNAPSHOT, *demo_sweep.args(state), cwd=tmp_path)
    return got, published_digests(state) == before


def test_apply_refuses_a_deep_a_duplicated_and_a_nan_profile_without_a_traceback(
        demo_sweep: DemoSweep, profile: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    written, doc = profile
    deep = tmp_path / "deep.json"
    deep.write_text('{"kind": ' + "[" * 200_000 + "]" * 200_000 + "}")
    got, unchanged = _apply(demo_sweep, tmp_path, deep)
    refused(got, str(deep), "nested deeper")
    assert unchanged
    twice = tmp_path / "twice.json"
    text = written.read_text()
    twice.write_text(text.replace('"env": {', '"env": {"NCCL_P2P_DISABLE": "1"}, "env": {', 1))
    got, unchanged = _apply(demo_sweep, tmp_path, twice)
    refused(got, str(twice), "duplicate key 'env'")
    assert unchanged
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps({**doc, "evidence": {**doc["evidence"], "verdict": float("nan")}}))
    got, unchanged = _apply(demo_sweep, tmp_path, nan)
    refused(got, str(nan), "NaN is not JSON")
    assert unchanged
    # The same profile, well formed, is applied: the refusals were for what they name.
    got, unchanged = _apply(demo_sweep, tmp_path, written)
    assert got.returncode == EXIT_OK, got.stderr
    assert not unchanged


def test_apply_refuses_a_profile_whose_text_has_no_utf8_form_before_anything_is_written(
        demo_sweep: DemoSweep, profile: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A lone surrogate escape in a profile was published, and then the command's own output
    could not be written: refused as the profile is read, with nothing published."""
    written, _ = profile
    bad = tmp_path / "surrogate.json"
    bad.write_text(written.read_text().replace('"chosen": "', '"chosen": "\\ud800', 1))
    got, unchanged = _apply(demo_sweep, tmp_path, bad)
    refused(got, str(bad), "$.chosen: a lone surrogate escape")
    assert unchanged
    # A profile file named by undecodable bytes: its name cannot be published as nccl.json's text.
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/\xff.json"))
    shutil.copyfile(written, odd)
    got, unchanged = _apply(demo_sweep, tmp_path, odd)
    refused(got, "provenance.note: not valid UTF-8 text")
    assert unchanged


def test_fleet_decide_refuses_nan_and_duplicated_exports_and_never_writes_nan(
        demo_sweep: DemoSweep, profile: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    written, _ = profile
    exports = sorted(written.parent.glob("profile.export-*.json"))
    assert len(exports) == 2
    doc = json.loads(exports[0].read_text())
    doc["runs"][0]["trials"][0]["measurements"][0]["busbw_gbps"] = float("nan")
    nan = tmp_path / "nan.export.json"
    nan.write_text(json.dumps(doc))  # Python writes NaN; no JSON reader should take it
    out = tmp_path / "profile.json"
    refused(nccltune("fleet", "decide", nan, exports[1], "--out", out, cwd=tmp_path), str(nan), "NaN is not JSON")
    assert not out.exists()
    twice = tmp_path / "twice.export.json"
    twice.write_text(exports[0].read_text().replace('"hostname": ', '"hostname": "forged", "hostname": ', 1))
    refused(nccltune("fleet", "decide", twice, exports[1], "--out", out, cwd=tmp_path), str(twice),
            "duplicate key 'hostname'")
    deep = tmp_path / "deep.export.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    refused(nccltune("fleet", "decide", deep, exports[1], "--out", out, cwd=tmp_path), str(deep), "nested deeper")
    assert not out.exists()
    got = nccltune("fleet", "decide", *exports, "--out", out, cwd=tmp_path)
    assert got.returncode == EXIT_OK, got.stderr
    assert "NaN" not in out.read_text() and "Infinity" not in out.read_text()
    with pytest.raises(InputError, match="JSON cannot carry"):
        dumps_profile({"gain_pct": float("nan")})


# -- import --------------------------------------------------------------------------------------------


def test_import_refuses_an_environment_value_no_launcher_may_source(tmp_path: Path) -> None:
    doc = json.loads((NCCL_TESTS_OUTPUT / "all_reduce_perf.v3-2rank.handmade.json").read_text())
    doc["env"] = [*doc["env"], "NCCL_ALGO=Ring;touch${IFS}/tmp/owned"]
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(doc))
    state = tmp_path / "state"
    got = nccltune("import", path, "--state-dir", state, cwd=tmp_path)
    refused(got, str(path), f"$.env[{len(doc['env']) - 1}]", "NCCL_ALGO", "forbidden character ';'")
    if (state / "history.db").exists():
        with Store(state / "history.db") as store:
            assert store.runs(limit=5) == []


@pytest.mark.parametrize(("entry", "message"), [
    ("NCCL_HOSTID=node-a", "NCCL_HOSTID: names this node to NCCL"),
    ("NCCL_COMM_ID=10.0.0.1:5000", "NCCL_COMM_ID: is the address of one job's bootstrap root"),
    ("NCCL_TOPO_FILE=/home/me/topo.xml", "NCCL_TOPO_FILE: names a file or a library of that run"),
    ("NCCL_NET_PLUGIN=/tmp/libnccl-net.so", "NCCL_NET_PLUGIN: names a file or a library of that run"),
])
def test_import_keeps_no_variable_a_setting_may_not_hold(tmp_path: Path, entry: str, message: str) -> None:
    """An import's env is kept as the setting measured (exported, offered to fleet decide): a node's
    identity or a file of that run is none, so the document is refused and nothing stored."""
    doc = json.loads((NCCL_TESTS_OUTPUT / "all_reduce_perf.v3-2rank.handmade.json").read_text())
    doc["env"] = [*doc["env"], entry]
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(doc))
    state = tmp_path / "state"
    got = nccltune("import", path, "--state-dir", state, cwd=tmp_path)
    refused(got, str(path), f"$.env[{len(doc['env']) - 1}]", message, "remove it from the document's env")
    if (state / "history.db").exists():
        with Store(state / "history.db") as store:
            assert store.runs(limit=5) == []


def test_a_full_disk_during_import_says_enospc(tmpfs: Path, tmp_path: Path) -> None:
    state = tmpfs / "state"
    first = nccltune("import", NCCL_TESTS_OUTPUT / "all_reduce_perf.v3-1rank.h200.json", "--state-dir", state,
                     cwd=tmp_path)
    assert first.returncode == EXIT_OK, first.stderr
    fill_up(tmpfs)
    got = nccltune("import", NCCL_TESTS_OUTPUT / "all_reduce_perf.v3-2rank.handmade.json", "--state-dir", state,
                   cwd=tmp_path)
    refused(got, str(state / "history.db"), "No space left on device (ENOSPC)", code=EXIT_CHECK_FAILED)
    assert "EIO" not in got.stderr


def test_a_read_only_history_gives_no_traceback(demo_sweep: DemoSweep, tmp_path: Path) -> None:
    state = tmp_path / "state"
    copy_state(demo_sweep.state, state)
    db = state / "history.db"
    with Store(db) as store:
        store.runs(limit=1)  # the WAL checkpointed into the file
    if subprocess.run(["mount", "--bind", str(db), str(db)], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot bind-mount a file here")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(db)], capture_output=True,
                          check=False).returncode != 0:
            pytest.skip("cannot make a bind mount read-only here")
        before = published_digests(state)
        perf = NCCL_TESTS_OUTPUT / "all_reduce_perf.v3-2rank.handmade.json"
        for args, codes in ((("history",), (EXIT_OK, EXIT_CONFIG)), (("import", perf), (EXIT_CONFIG,)),
                            (("export", "--demo", SNAPSHOT), (EXIT_OK, EXIT_CONFIG)),
                            (("sweep", "--demo", SNAPSHOT), (EXIT_CONFIG,))):
            got = nccltune(*args, *demo_sweep.args(state), cwd=tmp_path)
            assert got.returncode in codes, (args, got.stderr)
            assert "Traceback" not in got.stderr, (args, got.stderr)
            if got.returncode == EXIT_CONFIG:
                assert str(db) in got.stderr and "history database" in got.stderr
        assert published_digests(state) == before
    finally:
        subprocess.run(["umount", str(db)], check=False)
