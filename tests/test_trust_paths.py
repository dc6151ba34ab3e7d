"""Every path root writes in is walked under the trust rule as it is given, before anything is
created: the state directory from --state-dir, from --demo's ./nccltune-demo and from the config;
a parent another user can write; nccl.conf, the CDI and metrics directories, the topology copy and
the publish directory through her link; the files a command writes at a path it is given; install's
--binary and --prefix.

The attacks are built as root with files chowned to a second local user (tests/second_user.py).
Each refusal is exit 78, names the path, the offending component and its owner, prints no
traceback, creates nothing where she pointed, and leaves the published set byte for byte.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from demo_state import SNAPSHOT, DemoSweep, clean_env, copy_state
from fleet_fixtures import demo_profile
from second_user import give, mallory_uid, published_digests

from nccltune.cli import main
from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.files import trust
from nccltune.publish import Provenance, update_nccl_conf

CLI_S = 240.0


@pytest.fixture(scope="module")
def mallory() -> int:
    return mallory_uid()


def nccltune(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *map(str, args)], capture_output=True, text=True,
                          env=clean_env(), timeout=CLI_S, cwd=cwd, check=False)


def refused(got: subprocess.CompletedProcess[str], *named: str) -> None:
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert "Traceback" not in got.stderr
    for name in named:
        assert name in got.stderr, got.stderr


def in_process(*args: str | Path) -> tuple[int, str]:
    """`nccltune ARGS` in this process (install is quick and writes only below its prefix)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, err.getvalue()


def sticky_dir(tmp_path: Path) -> Path:
    """A directory like /tmp: root's, mode 1777, where she may make names of her own."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def her_link(at: Path, target: Path, uid: int) -> Path:
    at.symlink_to(target)
    return give(at, uid)


def her_dir(path: Path, uid: int) -> Path:
    path.mkdir(parents=True)
    return give(path, uid)


def state_copy(demo_sweep: DemoSweep, tmp_path: Path) -> Path:
    state = tmp_path / "state"
    copy_state(demo_sweep.state, state)
    return state


def prov() -> Provenance:
    return Provenance(nccltune_version="0", created_at="2026-01-01T00:00:00+00:00", topology_fingerprint="f",
                      nccl_version=None, backend="gloo", demo=True, profile=None)


def config_with(demo_sweep: DemoSweep, where: Path, **settings: object) -> Path:
    """The demo sweep's config with top-level settings (state_dir) or publish.* ones added."""
    doc = yaml.safe_load(demo_sweep.config.read_text())
    for key, value in settings.items():
        if key == "state_dir":
            doc[key] = value
        else:
            doc.setdefault("publish", {})[key] = value
    path = where / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# -- the walk: nothing is created before the path passes ------------------------------------------------


def test_a_directory_below_hers_is_refused_before_anything_is_made(tmp_path: Path, mallory: int) -> None:
    hers = her_dir(tmp_path / "hers", mallory)
    with pytest.raises(InputError) as info:
        trust.ensure_dir(hers / "state" / "runs", "state directory")
    assert info.value.exit_code == EXIT_CONFIG
    assert f"{hers / 'state' / 'runs'}: refusing the state directory: {hers} on its way is owned by uid {mallory}" \
        in str(info.value)
    assert list(hers.iterdir()) == []


def test_a_name_she_makes_first_in_a_sticky_directory_is_refused_and_nothing_is_made_below_it(
        tmp_path: Path, mallory: int, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = sticky_dir(tmp_path)
    chosen = tmp_path / "root-dir"  # root's own, where she would have root make the rest
    chosen.mkdir()
    real_mkdir = os.mkdir

    def she_wins_the_race(path: str | Path, mode: int = 0o777) -> None:
        if Path(path) == shared / "state":
            her_link(shared / "state", chosen, mallory)
        real_mkdir(path, mode)

    monkeypatch.setattr(trust.os, "mkdir", she_wins_the_race)
    with pytest.raises(InputError) as info:
        trust.ensure_dir(shared / "state" / "runs", "state directory")
    monkeypatch.undo()
    assert f"{shared / 'state'} on its way appeared while it was being created, a symlink (owner uid {mallory})" \
        in str(info.value)
    assert list(chosen.iterdir()) == []


def test_a_user_running_nccltune_trusts_her_own_directories(tmp_path: Path, mallory: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # As she would see it running nccltune herself: root and her own uid are trusted.
    hers = her_dir(tmp_path / "hers", mallory)
    monkeypatch.setattr(trust, "trusted_uids", lambda: (0, mallory))
    assert trust.ensure_dir(hers / "state" / "runs", "state directory") == hers / "state" / "runs"
    assert trust.trusted_target(hers / "nccl.conf", "NCCL conf file") == hers / "nccl.conf"


def test_a_file_to_write_through_her_link_is_refused_and_a_rename_target_only_counts_its_directory(
        tmp_path: Path, mallory: int) -> None:
    shared = sticky_dir(tmp_path)
    link = her_link(shared / "out.json", tmp_path / "elsewhere.json", mallory)
    with pytest.raises(InputError, match=f"{link}: refusing the export file: it is a symlink owned by uid {mallory}"):
        trust.trusted_target(link, "export file")
    # Replaced by a rename, her link at the name is replaced, never followed: the sticky directory passes.
    assert trust.trusted_target(link, "export file", follow_last=False) == link
    hers = her_dir(tmp_path / "hers", mallory)
    with pytest.raises(InputError, match=f"{hers} on its way is owned by uid {mallory}"):
        trust.trusted_target(hers / "out.json", "export file", follow_last=False)


# -- the state directory, from every source ------------------------------------------------------------


@pytest.mark.parametrize("command", ["sweep", "verify", "daemon"])
def test_a_state_dir_flag_through_her_link_is_refused(demo_sweep: DemoSweep, tmp_path: Path, mallory: int,
                                                      command: str) -> None:
    state = state_copy(demo_sweep, tmp_path)
    before = published_digests(state)
    link = her_link(sticky_dir(tmp_path) / "state", state, mallory)
    extra = ["--max-polls", "1"] if command == "daemon" else []
    got = nccltune(command, "--demo", SNAPSHOT, *demo_sweep.args(link), *extra, cwd=tmp_path)
    refused(got, f"{link}: refusing the ", f"it is a symlink owned by uid {mallory}")
    assert published_digests(state) == before
    assert sorted(p.name for p in (state / "runs").iterdir()) == sorted(
        p.name for p in (demo_sweep.state / "runs").iterdir())


@pytest.mark.parametrize("command", ["sweep", "daemon", "history"])
def test_the_demo_state_through_her_link_in_the_working_directory_is_refused(
        demo_sweep: DemoSweep, tmp_path: Path, mallory: int, command: str) -> None:
    state = state_copy(demo_sweep, tmp_path)
    before = published_digests(state)
    shared = sticky_dir(tmp_path)
    link = her_link(shared / "nccltune-demo", state, mallory)
    args = {"sweep": ["sweep", "--demo", SNAPSHOT], "daemon": ["daemon", "--demo", SNAPSHOT, "--max-polls", "1"],
            "history": ["history", "--demo"]}[command]
    got = nccltune(*args, "--config", demo_sweep.config, cwd=shared)
    refused(got, f"{link}: refusing the ", f"it is a symlink owned by uid {mallory}")
    assert published_digests(state) == before


def test_a_demo_state_directory_of_hers_in_the_working_directory_is_refused(
        demo_sweep: DemoSweep, tmp_path: Path, mallory: int) -> None:
    shared = sticky_dir(tmp_path)
    hers = her_dir(shared / "nccltune-demo", mallory)
    got = nccltune("sweep", "--demo", SNAPSHOT, "--config", demo_sweep.config, cwd=shared)
    refused(got, f"{hers}: refusing the state directory: it is owned by uid {mallory}")
    assert list(hers.iterdir()) == []


@pytest.mark.parametrize("command", ["sweep", "daemon", "history"])
def test_a_state_dir_in_the_config_through_her_link_is_refused(demo_sweep: DemoSweep, tmp_path: Path,
                                                               mallory: int, command: str) -> None:
    state = state_copy(demo_sweep, tmp_path)
    before = published_digests(state)
    link = her_link(sticky_dir(tmp_path) / "state", state, mallory)
    cfg = config_with(demo_sweep, tmp_path, state_dir=str(link))
    doc = yaml.safe_load(cfg.read_text())
    doc["topology"] = {"snapshot": str(SNAPSHOT)}  # the demo's node without --demo, which names its own state
    cfg.write_text(yaml.safe_dump(doc))
    got = nccltune(command, "--config", cfg, *(["--max-polls", "1"] if command == "daemon" else []), cwd=tmp_path)
    refused(got, f"{link}: refusing the ", f"it is a symlink owned by uid {mallory}")
    assert published_digests(state) == before


@pytest.mark.parametrize("parent", ["hers", "world-writable"])
def test_a_state_dir_below_a_directory_she_can_write_is_refused_and_not_created(
        demo_sweep: DemoSweep, tmp_path: Path, mallory: int, parent: str) -> None:
    if parent == "hers":
        where, why = her_dir(tmp_path / "hers", mallory), f"owned by uid {mallory}"
    else:
        where, why = tmp_path / "open", "world-writable (mode 0777"
        where.mkdir()
        where.chmod(0o777)
    got = nccltune("sweep", "--demo", SNAPSHOT, "--config", demo_sweep.config, "--state-dir", where / "state",
                   cwd=tmp_path)
    refused(got, f"{where / 'state'}: refusing the state directory: {where} on its way is {why}")
    assert list(where.iterdir()) == []


# -- what publishing writes besides the set: nccl.conf, the CDI spec, the topology copy ---------------


def test_nccl_conf_through_her_link_appends_to_no_file_of_roots(tmp_path: Path, mallory: int) -> None:
    roots = tmp_path / "etc"
    roots.mkdir()
    (roots / "profile").write_text("umask 022\n")
    link = her_link(sticky_dir(tmp_path) / "nccl.conf", roots / "profile", mallory)
    with pytest.raises(InputError, match=f"{link}: refusing the NCCL conf file: it is a symlink owned by uid "):
        update_nccl_conf(link, {"NCCL_ALGO": "Ring"}, prov())
    assert (roots / "profile").read_text() == "umask 022\n"
    assert sorted(p.name for p in roots.iterdir()) == ["profile"]


def test_nccl_conf_through_her_link_creates_no_file_where_she_chose(tmp_path: Path, mallory: int) -> None:
    roots = tmp_path / "etc" / "profile.d"
    roots.mkdir(parents=True)
    link = her_link(sticky_dir(tmp_path) / "nccl.conf", roots / "nccl.sh", mallory)
    with pytest.raises(InputError, match=f"it is a symlink owned by uid {mallory}"):
        update_nccl_conf(link, {"NCCL_ALGO": "Ring"}, prov())
    assert list(roots.iterdir()) == []
    # Root's own link to a file not made yet, in root's directories: created there, as before.
    (tmp_path / "nccl.conf").symlink_to(roots / "nccl.conf")
    update_nccl_conf(tmp_path / "nccl.conf", {"NCCL_ALGO": "Ring"}, prov())
    assert "NCCL_ALGO=Ring" in (roots / "nccl.conf").read_text()
    assert (tmp_path / "nccl.conf").is_symlink()


@pytest.fixture(scope="module")
def profile(demo_sweep: DemoSweep, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A class profile of the demo node as `fleet decide` writes it."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    demo_profile(demo_sweep.state, SNAPSHOT, out)
    return out


def _conf_to_roots_file(tmp_path: Path, mallory: int) -> tuple[str, Path, Path]:
    roots = tmp_path / "etc"
    roots.mkdir()
    (roots / "nccl.conf").write_text("NCCL_DEBUG=WARN\n")
    return "nccl_conf", her_link(sticky_dir(tmp_path) / "nccl.conf", roots / "nccl.conf", mallory), roots


def _dir_through_her_link(key: str) -> Callable[[Path, int], tuple[str, Path, Path]]:
    def build(tmp_path: Path, mallory: int) -> tuple[str, Path, Path]:
        roots = tmp_path / "roots"
        roots.mkdir()
        return key, her_link(sticky_dir(tmp_path) / key, roots, mallory), roots
    return build


@pytest.mark.parametrize("build", [_conf_to_roots_file, _dir_through_her_link("cdi_dir"),
                                   _dir_through_her_link("dir")], ids=["nccl_conf", "cdi_dir", "publish_dir"])
def test_apply_with_a_publish_path_through_her_link_writes_nothing(
        demo_sweep: DemoSweep, profile: Path, tmp_path: Path, mallory: int,
        build: Callable[[Path, int], tuple[str, Path, Path]]) -> None:
    state = state_copy(demo_sweep, tmp_path)
    before = published_digests(state)
    key, link, roots = build(tmp_path, mallory)
    listing = {p.name: p.read_bytes() for p in roots.iterdir()}
    cfg = config_with(demo_sweep, tmp_path, **{key: str(link)})
    got = nccltune("apply", profile, "--demo", SNAPSHOT, "--config", cfg, "--state-dir", state, cwd=tmp_path)
    refused(got, f"{link}: refusing the ", f"it is a symlink owned by uid {mallory}")
    assert published_digests(state) == before
    assert {p.name: p.read_bytes() for p in roots.iterdir()} == listing


def test_a_topology_copy_in_her_directory_is_refused_before_the_set_is_published(tmp_path: Path,
                                                                                mallory: int) -> None:
    from nccltune.config import Config, with_overrides
    from nccltune.publish import Setting, publish_setting

    state = tmp_path / "state"
    xml = '<system version="1"></system>\n'
    publish_setting(with_overrides(Config(), state_dir=str(state)), Setting({"NCCL_ALGO": "Ring"}, prov(),
                                                                             topology_xml=xml))
    before = published_digests(state)
    hers = her_dir(tmp_path / "hers", mallory)
    cfg = with_overrides(Config(), **{"state_dir": str(state), "publish.topology_file": str(hers / "topo.xml")})
    with pytest.raises(InputError) as info:
        publish_setting(cfg, Setting({"NCCL_ALGO": "Tree"}, prov(), topology_xml=xml))
    assert f"{hers / 'topo.xml'}: refusing the topology file copy: {hers} on its way is owned by uid {mallory}" \
        in str(info.value)
    assert published_digests(state) == before
    assert list(hers.iterdir()) == []


def test_the_metrics_directory_through_her_link_is_refused_and_not_created(tmp_path: Path, mallory: int) -> None:
    from nccltune.metrics import write_metrics_from_store
    from nccltune.store import Store

    roots = tmp_path / "roots"
    roots.mkdir()
    link = her_link(sticky_dir(tmp_path) / "metrics", roots, mallory)
    with Store(tmp_path / "history.db") as store, pytest.raises(InputError) as info:
        write_metrics_from_store(link / "textfile", store, fingerprint="f")
    assert f"refusing the metrics directory: {link} on its way is a symlink owned by uid {mallory}" \
        in str(info.value)
    assert list(roots.iterdir()) == []


# -- files a command writes at a path it is given --------------------------------------------------------


@pytest.mark.parametrize("command", ["export", "decide"])
def test_an_output_file_through_her_link_is_refused_before_any_work(demo_sweep: DemoSweep, tmp_path: Path,
                                                                    mallory: int, command: str) -> None:
    roots = tmp_path / "roots"
    roots.mkdir()
    link = her_link(sticky_dir(tmp_path) / "out", roots, mallory)
    args = (["export", *demo_sweep.args(), "--out", link / "node.json"] if command == "export" else
            ["fleet", "decide", tmp_path / "no-such-export.json", "--out", link / "class.json"])
    got = nccltune(*args, cwd=tmp_path)
    refused(got, f"{link} on its way is a symlink owned by uid {mallory}")
    assert list(roots.iterdir()) == []


# -- install: ExecStart's executable and the prefix ---------------------------------------------------


def _binary(tmp_path: Path, mallory: int, how: str) -> tuple[Path, str]:
    """An executable ExecStart would run as root, and the words its refusal names."""
    if how == "hers":
        exe = tmp_path / "nccltune"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        return give(exe, mallory), f"it is owned by uid {mallory}"
    if how == "world-writable":
        exe = tmp_path / "nccltune"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o777)
        return exe, "it is world-writable (mode 0777"
    hers = her_dir(tmp_path / "hers", mallory)
    if how == "in her directory":
        exe = hers / "nccltune"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        return exe, f"{hers} on its way is owned by uid {mallory}"
    # Root's own script, run by an interpreter in her directory.
    (hers / "python3").symlink_to(os.path.realpath(sys.executable))
    exe = tmp_path / "nccltune"
    exe.write_text(f"#!{hers / 'python3'} -I\nimport nccltune\n")
    exe.chmod(0o755)
    return exe, f"{hers} on its way is owned by uid {mallory}"


@pytest.mark.parametrize("how", ["hers", "world-writable", "in her directory", "interpreter in her directory"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_install_refuses_an_executable_she_could_change(tmp_path: Path, mallory: int, how: str,
                                                        dry_run: bool) -> None:
    exe, why = _binary(tmp_path, mallory, how)
    prefix = tmp_path / "root"
    rc, err = in_process("install", "--prefix", prefix, "--no-enable", "--binary", exe,
                         *(["--dry-run"] if dry_run else []))
    assert rc == EXIT_CONFIG, err
    assert why in err and "Traceback" not in err
    assert not prefix.exists()


@pytest.mark.parametrize("how", ["below her directory", "through her link"])
def test_install_refuses_a_prefix_she_controls_and_writes_nothing(tmp_path: Path, mallory: int, how: str) -> None:
    hers = her_dir(tmp_path / "hers", mallory)
    if how == "below her directory":
        prefix, named = hers / "image", f"{hers} on its way is owned by uid {mallory}"
    else:
        prefix = her_link(sticky_dir(tmp_path) / "image", hers, mallory)
        named = f"{prefix}: refusing the install prefix: it is a symlink owned by uid {mallory}"
    rc, err = in_process("install", "--prefix", prefix, "--no-enable", "--binary", "/opt/x/bin/nccltune")
    assert rc == EXIT_CONFIG, err
    assert named in err
    assert list(hers.iterdir()) == []
    rc, err = in_process("uninstall", "--prefix", prefix)
    assert rc == EXIT_CONFIG, err
    assert named in err
