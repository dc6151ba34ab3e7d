"""`nccltune env` and `nccltune exec` over what a demo sweep published."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from nccltune.cli import main

pytest.importorskip("torch")

from demo_state import DemoSweep, clean_env

POLICY = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@pytest.fixture
def published(seeded: Path) -> dict[str, str]:
    env = json.loads((seeded / "nccl.json").read_text())["env"]
    assert isinstance(env, dict)
    return env


def cli(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, clean_env(**(env or {})), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def nccltune_exec(state: Path, *cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # exec replaces the process, so it runs in its own interpreter.
    return subprocess.run([sys.executable, "-m", "nccltune", "exec", "--state-dir", str(state), "--", *cmd],
                          capture_output=True, text=True, env=clean_env(**(env or {})), timeout=60)


# -- env ------------------------------------------------------------------------------------------------


def test_env_json_has_a_schema_version_and_the_published_env(seeded: Path, published: dict[str, str],
                                                             demo_sweep: DemoSweep) -> None:
    rc, out, err = cli("env", "--format", "json", "--state-dir", seeded)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema_version"] == 1
    assert doc["env"] == published
    assert published[POLICY] == "3"
    # The state says what the sweep published: its winner, or NCCL's defaults kept.
    state = "defaults" if demo_sweep.doc["chosen"] == "NCCL defaults" else "tuned"
    assert doc["provenance"]["demo"] is True and doc["provenance"]["state"] == state
    rc, sh, err = cli("env", "--as-published", "--state-dir", seeded)
    assert rc == 0, err
    assert f"# state: {state}\n" in sh


def test_env_with_nothing_published_exits_1(tmp_path: Path) -> None:
    rc, out, err = cli("env", "--format", "json", "--state-dir", tmp_path)
    assert rc == 1 and out == ""
    assert "nothing is published" in err and "nccltune sweep" in err


# -- exec -------------------------------------------------------------------------------------------------


def test_exec_runs_the_command_with_the_published_environment(seeded: Path, published: dict[str, str]) -> None:
    got = nccltune_exec(seeded, "sh", "-c", 'printf %s "$TORCH_NCCL_ASYNC_ERROR_HANDLING"')
    assert got.returncode == 0, got.stderr
    assert got.stdout == published[POLICY]
    assert got.stderr == ""
    got = nccltune_exec(seeded, "env")
    seen = dict(line.split("=", 1) for line in got.stdout.splitlines() if "=" in line)
    assert {k: seen.get(k) for k in published} == published


def test_exec_lets_a_variable_the_caller_set_win_and_says_so(seeded: Path, published: dict[str, str]) -> None:
    got = nccltune_exec(seeded, "sh", "-c", 'printf %s "$TORCH_NCCL_ASYNC_ERROR_HANDLING"', env={POLICY: "1"})
    assert got.returncode == 0, got.stderr
    assert got.stdout == "1"
    assert f"nccltune: {POLICY}=1 set by the job is kept (published: {published[POLICY]})" in got.stderr
    # The same value as published is no override: nothing to say.
    same = nccltune_exec(seeded, "true", env={POLICY: published[POLICY]})
    assert same.returncode == 0 and same.stderr == ""


def test_exec_passes_the_arguments_and_the_exit_status_through(seeded: Path) -> None:
    got = nccltune_exec(seeded, "sh", "-c", 'printf "%s|" "$@"; exit 7', "sh", "a b", "", "--", "-x")
    assert got.returncode == 7
    assert got.stdout == "a b||--|-x|"


@pytest.mark.parametrize("args", [["exec"], ["exec", "--"]])
def test_exec_without_a_command_is_a_usage_error(args: list[str], seeded: Path) -> None:
    rc, out, err = cli(args[0], "--state-dir", seeded, *args[1:])
    assert rc == 2
    assert out == ""
    assert "give a command after --" in err


def test_exec_of_a_missing_command_exits_127_like_a_shell(seeded: Path) -> None:
    got = nccltune_exec(seeded, "/nonexistent/command")
    assert got.returncode == 127
    assert "cannot run /nonexistent/command" in got.stderr
    assert "Traceback" not in got.stderr


def test_exec_of_a_file_without_the_run_bit_exits_126(seeded: Path, tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)
    got = nccltune_exec(seeded, str(script))
    assert got.returncode == 126
    assert f"cannot run {script}" in got.stderr and got.stdout == ""


def test_exec_with_nothing_published_runs_with_the_current_environment(tmp_path: Path) -> None:
    got = nccltune_exec(tmp_path, "sh", "-c", 'printf %s "${TORCH_NCCL_ASYNC_ERROR_HANDLING-unset}"')
    assert got.returncode == 0
    assert got.stdout == "unset"
    assert "nothing is published" in got.stderr and "runs untuned" in got.stderr
