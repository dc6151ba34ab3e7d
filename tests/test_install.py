"""`nccltune install`: the systemd units with ExecStart pointing at the installed executable."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from unittest import mock

import pytest

from nccltune.cli import main
from nccltune.install import UNITS, systemd_quote, units_dir

SOURCE = units_dir()


def install(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["install", *(str(a) for a in args)])
    return rc, out.getvalue(), err.getvalue()


def differing_lines(installed: str, source: str) -> list[tuple[str, str]]:
    a, b = installed.splitlines(), source.splitlines()
    assert len(a) == len(b)
    return [(x, y) for x, y in zip(a, b, strict=True) if x != y]


def test_install_rewrites_exec_start_and_keeps_the_rest(tmp_path: Path) -> None:
    rc, out, err = install("--prefix", tmp_path, "--no-enable", "--binary", "/opt/x/bin/nccltune")
    assert rc == 0, err
    units = tmp_path / "etc/systemd/system"
    assert sorted(p.name for p in units.iterdir()) == sorted(UNITS)
    daemon = (units / "nccltune.service").read_text()
    sweep = (units / "nccltune-sweep.service").read_text()
    assert differing_lines(daemon, (SOURCE / "nccltune.service").read_text()) == [
        ("ExecStart=/opt/x/bin/nccltune daemon", "ExecStart=/usr/local/bin/nccltune daemon")]
    assert differing_lines(sweep, (SOURCE / "nccltune-sweep.service").read_text()) == [
        ("ExecStart=/opt/x/bin/nccltune sweep", "ExecStart=/usr/local/bin/nccltune sweep")]
    # ExecReload runs kill, not nccltune: untouched.
    assert "ExecReload=/bin/kill -HUP $MAINPID" in daemon
    assert daemon.endswith("\n") and not daemon.endswith("\n\n")
    for name in UNITS:
        assert (units / name).stat().st_mode & 0o777 == 0o644
    assert f"installed {units / 'nccltune.service'} (ExecStart /opt/x/bin/nccltune)" in out
    config = tmp_path / "etc/nccltune/config.yaml"
    assert config.read_text() == (SOURCE.parent / "examples" / "config.yaml").read_text()
    assert "config.yaml (all defaults" in out
    assert not [p for p in (tmp_path / "etc").rglob(".*")], "temp files left"


def test_install_keeps_an_existing_config(tmp_path: Path) -> None:
    config = tmp_path / "etc/nccltune/config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("daemon:\n  quiet_period_s: 600\n")
    rc, out, err = install("--prefix", tmp_path, "--no-enable", "--binary", "/opt/x/bin/nccltune")
    assert rc == 0, err
    assert config.read_text() == "daemon:\n  quiet_period_s: 600\n"
    assert "config.yaml" not in out


def test_installing_again_replaces_the_units(tmp_path: Path) -> None:
    assert install("--prefix", tmp_path, "--no-enable", "--binary", "/opt/a/nccltune")[0] == 0
    assert install("--prefix", tmp_path, "--no-enable", "--binary", "/opt/b/nccltune")[0] == 0
    text = (tmp_path / "etc/systemd/system/nccltune.service").read_text()
    assert "ExecStart=/opt/b/nccltune daemon" in text and "/opt/a/" not in text


@pytest.mark.parametrize(("path", "written"), [
    ("/opt/my venv/bin/nccltune", '"/opt/my venv/bin/nccltune"'),
    ("/opt/100%/nccltune", "/opt/100%%/nccltune"),
    ("/opt/$HOME/nccltune", "/opt/$$HOME/nccltune"),
])
def test_a_binary_path_is_written_as_systemd_reads_it(tmp_path: Path, path: str, written: str) -> None:
    rc, _out, err = install("--prefix", tmp_path, "--no-enable", "--binary", path)
    assert rc == 0, err
    text = (tmp_path / "etc/systemd/system/nccltune.service").read_text()
    assert f"ExecStart={written} daemon\n" in text
    assert systemd_quote(path) == written


def test_enable_without_systemctl_is_an_error_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    rc, _out, err = install("--prefix", tmp_path / "root", "--binary", "/opt/x/bin/nccltune",
                            env={"PATH": str(empty)})
    assert rc == 1
    assert "systemctl not found" in err


def test_enable_reloads_and_enables_the_service(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    rc, out, err = install("--prefix", tmp_path / "root", "--binary", "/opt/x/bin/nccltune",
                           env={"PATH": str(bin_dir)})
    assert rc == 0, err
    assert calls.read_text().splitlines() == ["daemon-reload", "enable --now nccltune.service"]
    assert out.splitlines()[-2:] == ["systemctl daemon-reload", "systemctl enable --now nccltune.service"]
