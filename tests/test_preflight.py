"""What cannot be published is found before the first trial, in `sweep --plan` too, and the
message names the config file and line. Real CLI processes, real files and a real read-only mount."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nccltune.errors import EXIT_CONFIG

REPO = Path(__file__).resolve().parents[1]


def sweep(tmp_path: Path, config: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", "--config", str(cfg),
                           "--state-dir", str(tmp_path / "state"), *extra],
                          capture_output=True, text=True, timeout=120, env=env, check=False)


def assert_nothing_measured(tmp_path: Path) -> None:
    assert not (tmp_path / "state" / "runs").exists()
    assert not (tmp_path / "state" / "history.db").exists()


@pytest.mark.parametrize("plan", [True, False])
@pytest.mark.parametrize(("value", "why"), [("$(id)", "forbidden character '$'"),
                                            ("a" * 2000, "2000 characters long")])
def test_an_unpublishable_pin_names_the_config_line(tmp_path: Path, plan: bool, value: str, why: str) -> None:
    got = sweep(tmp_path, f"sweep:\n  pin:\n    NCCL_SOCKET_IFNAME: '{value}'\n", *(["--plan"] if plan else []))
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert f"{tmp_path / 'config.yaml'}:3: NCCL_SOCKET_IFNAME" in got.stderr and why in got.stderr
    assert "environment:" not in got.stderr and "Traceback" not in got.stderr
    assert_nothing_measured(tmp_path)


def test_a_pinned_plugin_is_refused_before_the_sweep(tmp_path: Path) -> None:
    got = sweep(tmp_path, "sweep:\n  pin:\n    NCCL_NET_PLUGIN: /tmp/evil.so\n", "--plan")
    assert got.returncode == EXIT_CONFIG
    assert f"{tmp_path / 'config.yaml'}:3: NCCL_NET_PLUGIN" in got.stderr and "load code" in got.stderr


@pytest.mark.parametrize("plan", [True, False])
def test_a_publish_dir_that_is_a_file_is_refused_before_the_sweep(tmp_path: Path, plan: bool) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    got = sweep(tmp_path, f"publish:\n  dir: {blocker}\n", *(["--plan"] if plan else []))
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert str(blocker) in got.stderr and "not a directory" in got.stderr
    assert_nothing_measured(tmp_path)
    assert blocker.read_text() == "x"


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ro"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield path
    subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_publish_dir_is_refused_before_the_sweep(tmp_path: Path, read_only_dir: Path) -> None:
    got = sweep(tmp_path, f"publish:\n  dir: {read_only_dir / 'pub'}\n")
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert str(read_only_dir) in got.stderr and "not writable" in got.stderr
    assert_nothing_measured(tmp_path)


def test_plan_prints_a_hostile_environment_value_escaped(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    env.update(PYTHONPATH=str(REPO), NCCL_SOCKET_IFNAME="eth0\nMeasured: forged\x1b[2J")
    got = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", "--plan", "--config", str(cfg),
                          "--state-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=120, env=env, check=False)
    assert got.returncode == 0, got.stderr
    assert "\x1b" not in got.stdout
    assert "\nMeasured: forged" not in got.stdout
    assert "NCCL_SOCKET_IFNAME=eth0\\nMeasured: forged\\x1b[2J" in got.stdout


@pytest.mark.parametrize("plan", [True, False])
def test_a_state_dir_nccl_cannot_take_is_refused_before_the_first_trial(tmp_path: Path, plan: bool) -> None:
    """The topology file lies in the state directory and is published as NCCL_TOPO_FILE: a path
    with a space could not be published after the last trial, so the sweep does not start."""
    state = tmp_path / "my state"
    got = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", "--state-dir", str(state),
                          *(["--plan"] if plan else [])], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert f"{state / 'ncclTopology.xml'}: the state directory gives the topology file a path" in got.stderr
    assert "forbidden character ' '" in got.stderr and "--state-dir" in got.stderr
    assert got.stderr.count("nccltune: error:") == 1 and "Traceback" not in got.stderr
    assert not state.exists()
