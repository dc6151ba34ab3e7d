"""After the CPU demo (`bash bringup.sh` without GPUs) the next commands find the demo's state."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from demo_state import copy_state

from nccltune.cli import DEMO_STATE_DIR, main


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def after_demo(seeded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ./nccltune-demo, and a config whose state directory is empty."""
    copy_state(seeded, tmp_path / DEMO_STATE_DIR)
    empty = tmp_path / "state"
    empty.mkdir()
    (tmp_path / "config.yaml").write_text(f"state_dir: {empty}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_history_and_report_fall_back_to_the_demo_and_say_so(after_demo: Path) -> None:
    for command in ("history", "report"):
        rc, out, err = run(command, "--config", "config.yaml")
        assert rc == 0, err
        assert out.strip()
        assert f"reading the CPU demo's state in {after_demo / DEMO_STATE_DIR}" in err
    rc, out, err = run("history", "--config", "config.yaml", "--json")
    assert rc == 0, err
    assert json.loads(out)["runs"]
    rc, quiet_out, err = run("--quiet", "history", "--config", "config.yaml")
    assert rc == 0 and quiet_out.strip() and err == "", "--quiet: warnings and errors only"


def test_env_falls_back_and_demo_flag_reads_the_demo_without_a_note(after_demo: Path) -> None:
    rc, out, err = run("env", "--config", "config.yaml")
    assert rc == 0, err
    assert "export " in out and "reading the CPU demo's state" in err
    rc, out, err = run("history", "--config", "config.yaml", "--demo")
    assert rc == 0, err
    assert "reading the CPU demo's state" not in err and out.strip()


def test_an_explicit_state_dir_never_falls_back(after_demo: Path) -> None:
    rc, _out, err = run("history", "--config", "config.yaml", "--state-dir", str(after_demo / "state"))
    assert rc == 1
    assert "no history at" in err and "CPU demo" not in err


def test_topo_shows_the_demo_topology_where_the_node_cannot_be_read(after_demo: Path) -> None:
    pytest.importorskip("pynvml")
    from nccltune.errors import UnavailableError
    from nccltune.topology.snapshot import record_snapshot

    try:
        record_snapshot()
    except UnavailableError:
        pass
    else:
        pytest.skip("this machine has NVML: topo reads the node itself")
    rc, out, err = run("topo")
    assert rc == 69, "a recording shown because the node could not be read is EX_UNAVAILABLE"
    assert "showing the CPU demo's recorded topology" in err and "h200x2-nvswitch-vm.json" in err
    assert "NOT this node's" in err and "exiting 69" in err
    assert "GPU0" in out
    rc, out2, err = run("topo", "--demo")
    assert rc == 0, err
    assert out2 == out and "CPU demo" not in err


def test_bringup_prints_where_the_cli_is_and_the_next_steps(tmp_path: Path) -> None:
    import subprocess

    from tests.conftest import REPO

    script = (REPO / "bringup.sh").read_text()
    start = script.index("next_steps() {")
    function = script[start:script.index("\n}\n", start) + 3]
    shell = f'{function}\ncd "$1" && next_steps .venv --demo --json --state-dir "/srv/a b"; next_steps .venv "" --plan'
    got = subprocess.run(["bash", "-c", shell, "bash", str(tmp_path)], capture_output=True, text=True, check=True)
    assert got.stdout == ""
    assert f"nccltune is installed at {tmp_path}/.venv/bin/nccltune" in got.stderr
    assert f"{tmp_path}/.venv/bin/nccltune history --state-dir /srv/a\\ b" in got.stderr
    assert f"{tmp_path}/.venv/bin/nccltune topo --demo" in got.stderr
    assert got.stderr.count("nccltune is installed") == 1, "--plan measured nothing: no next steps"
