"""`nccltune install`: the systemd units with ExecStart pointing at the installed executable."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
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
    rc, _out, err = install("--prefix", tmp_path / "root", "--enable", "--binary", "/opt/x/bin/nccltune",
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
    rc, out, err = install("--prefix", tmp_path / "root", "--enable", "--binary", "/opt/x/bin/nccltune",
                           env={"PATH": str(bin_dir)})
    assert rc == 0, err
    assert calls.read_text().splitlines() == ["daemon-reload", "enable --now nccltune.service"]
    assert out.splitlines()[-2:] == ["systemctl daemon-reload", "systemctl enable --now nccltune.service"]


def fake_systemctl(tmp_path: Path) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    fake = bin_dir / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}, calls


def test_a_prefix_implies_no_systemctl_and_installs_the_launchers(tmp_path: Path) -> None:
    env, calls = fake_systemctl(tmp_path)
    root = tmp_path / "root"
    rc, out, err = install("--prefix", root, "--binary", "/opt/x/bin/nccltune", env=env)
    assert rc == 0, err
    assert not calls.exists(), "systemctl ran for a prefix"
    launchers = SOURCE.parent / "launchers"
    wrapper = root / "usr/local/bin/nccltune-torchrun"
    prolog = root / "etc/slurm/nccltune-task-prolog.sh"
    assert wrapper.read_text() == (launchers / "nccltune-torchrun").read_text()
    assert prolog.read_text() == (launchers / "slurm-prolog.sh").read_text()
    assert wrapper.stat().st_mode & 0o777 == 0o755 and prolog.stat().st_mode & 0o777 == 0o755
    assert f"installed {wrapper}" in out and "TaskProlog=/etc/slurm/nccltune-task-prolog.sh" in out


def test_dry_run_writes_nothing_and_says_what_it_would_do(tmp_path: Path) -> None:
    env, calls = fake_systemctl(tmp_path)
    root = tmp_path / "root"
    rc, out, err = install("--prefix", root, "--enable", "--dry-run", "--binary", "/opt/x/bin/nccltune", env=env)
    assert rc == 0, err
    assert not root.exists() and not calls.exists()
    unit = root / "etc/systemd/system/nccltune.service"
    assert f"would write {unit} (mode 0644) (ExecStart /opt/x/bin/nccltune)" in out
    assert f"would write {root / 'usr/local/bin/nccltune-torchrun'} (mode 0755)" in out
    assert out.splitlines()[-2:] == ["would run systemctl daemon-reload",
                                     "would run systemctl enable --now nccltune.service"]


def uninstall(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["uninstall", *(str(a) for a in args)])
    return rc, out.getvalue(), err.getvalue()


def test_uninstall_removes_only_unchanged_files_and_never_the_state(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert install("--prefix", root, "--binary", "/opt/x/bin/nccltune")[0] == 0
    state = root / "var/lib/nccltune"
    state.mkdir(parents=True)
    (state / "history.db").write_text("x")
    config = root / "etc/nccltune/config.yaml"
    config.write_text("daemon:\n  quiet_period_s: 60\n")  # the operator's edit
    rc, out, err = uninstall("--prefix", root, "--dry-run")
    assert rc == 0, err
    assert (root / "etc/systemd/system/nccltune.service").exists() and "would remove" in out
    rc, out, err = uninstall("--prefix", root)
    assert rc == 0, err
    assert not (root / "etc/systemd/system/nccltune.service").exists()
    assert not (root / "usr/local/bin/nccltune-torchrun").exists()
    assert not (root / "etc/nccltune/installed.json").exists()
    assert config.read_text() == "daemon:\n  quiet_period_s: 60\n"
    assert f"kept {config}: changed since install" in out
    assert (state / "history.db").read_text() == "x"
    rc, out, _err = uninstall("--prefix", root)
    assert rc == 0 and "nothing to uninstall" in out


def test_uninstall_with_disable_disables_the_service_first(tmp_path: Path) -> None:
    from nccltune.install import uninstall as uninstall_units

    env, calls = fake_systemctl(tmp_path)
    root = tmp_path / "root"
    assert install("--prefix", root, "--binary", "/opt/x/bin/nccltune")[0] == 0
    # What `nccltune uninstall` (no prefix) does, below a prefix: disable, remove, reload.
    with mock.patch.dict(os.environ, env):
        uninstall_units(root, disable=True)
    assert calls.read_text().splitlines() == ["disable --now nccltune.service", "daemon-reload"]
    assert not (root / "etc/systemd/system/nccltune.service").exists()


def test_a_prefix_is_a_destdir_every_recorded_path_is_the_final_one(tmp_path: Path) -> None:
    root = tmp_path / "destdir"
    config = root / "etc/nccltune/config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("state_dir: /srv/nccltune\npublish:\n  cdi_dir: /var/run/cdi\n  nccl_conf: /etc/nccl.conf\n"
                      "  metrics_dir: /var/lib/node-exporter\n")
    # No --binary: ExecStart is the target's nccltune, never the one running this install.
    rc, _out, err = install("--prefix", root)
    assert rc == 0, err
    for name in UNITS:
        text = (root / "etc/systemd/system" / name).read_text()
        assert "ExecStart=/usr/local/bin/nccltune " in text
        assert str(root) not in text and ".venv" not in text and sys.prefix not in text
        assert ("ReadWritePaths=-/srv/nccltune -/var/run/cdi -/etc -/var/lib/node-exporter\n" in text)
    manifest = json.loads((root / "etc/nccltune/installed.json").read_text())
    assert sorted(manifest["files"]) == ["/etc/slurm/nccltune-task-prolog.sh",
                                         "/etc/systemd/system/nccltune-sweep.service",
                                         "/etc/systemd/system/nccltune.service", "/usr/local/bin/nccltune-torchrun"]
    # Uninstall below the same DESTDIR finds every file by its final name.
    rc, _out, err = uninstall("--prefix", root)
    assert rc == 0, err
    assert not (root / "etc/systemd/system/nccltune.service").exists()
    assert not (root / "usr/local/bin/nccltune-torchrun").exists()


def test_the_shipped_units_list_what_the_default_config_writes() -> None:
    from nccltune.config.schema import Config
    from nccltune.install import read_write_paths

    line = read_write_paths(Config().written_dirs())
    assert line == "ReadWritePaths=-/var/lib/nccltune"
    for name in UNITS:
        assert [x for x in (SOURCE / name).read_text().splitlines() if x.startswith("ReadWritePaths=")] == [line]


def test_written_dirs_names_each_directory_once_and_none_below_another() -> None:
    from nccltune.config.schema import Config, PublishConfig

    cfg = Config(state_dir="/var/lib/nccltune", publish=PublishConfig(
        dir="pub", topology_file="/var/lib/nccltune/topo/x.xml", cdi_dir="/etc/cdi", nccl_conf="/etc/nccl.conf",
        metrics_dir="metrics"))
    assert cfg.written_dirs() == (Path("/var/lib/nccltune"), Path("/etc"))


def test_written_dirs_hold_the_node_feature_files_directory() -> None:
    from nccltune.config.schema import Config, PublishConfig

    nfd = "/etc/kubernetes/node-feature-discovery/features.d/nccltune"
    cfg = Config(state_dir="/var/lib/nccltune", publish=PublishConfig(node_features_file=nfd))
    assert cfg.written_dirs() == (Path("/var/lib/nccltune"), Path(nfd).parent)


def test_uninstall_refuses_a_manifest_others_may_edit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert install("--prefix", root, "--binary", "/opt/x/bin/nccltune")[0] == 0
    manifest = root / "etc/nccltune/installed.json"
    manifest.chmod(0o666)
    rc, _out, err = uninstall("--prefix", root)
    assert rc == 78 and "install manifest" in err and "world-writable" in err
    assert (root / "etc/systemd/system/nccltune.service").exists()
