"""One trust rule over the whole chain to everything root reads as configuration or runs: the
config file, the worker interpreter, the topology snapshot, class profiles (a file or a
directory of them), the state directory of `sweep` and of `sweep --join`.

Every directory and link from / to the target, links resolved one at a time as the kernel does,
is owned by root (or the user running nccltune) and writable by nobody else. The attacks are
built as root with files chowned to a second local user; each refusal is exit 78, names the path
and the offending component, prints no traceback, and leaves the published set byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from demo_state import SNAPSHOT, DemoSweep, clean_env, copy_state
from fleet_fixtures import demo_profile
from second_user import give, mallory_uid, published_digests

from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.files import trust
from nccltune.fleet.decide import PROFILE_KIND

CLI_S = 240.0


@pytest.fixture(scope="module")
def mallory() -> int:
    return mallory_uid()


def nccltune(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *map(str, args)], capture_output=True, text=True,
                          env=env or clean_env(), timeout=CLI_S, cwd=cwd, check=False)


def refused(got: subprocess.CompletedProcess[str], *named: str) -> None:
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert "Traceback" not in got.stderr
    for name in named:
        assert name in got.stderr, got.stderr


def state_copy(demo_sweep: DemoSweep, tmp_path: Path) -> Path:
    state = tmp_path / "state"
    copy_state(demo_sweep.state, state)
    return state


# -- the rule ----------------------------------------------------------------------------------------


def test_a_venv_python_linked_to_a_root_owned_interpreter_is_trusted(tmp_path: Path) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python3").symlink_to(os.path.realpath(sys.executable))
    (venv_bin / "python").symlink_to("python3")
    assert trust.trusted_file(venv_bin / "python", "interpreter") == Path(os.path.realpath(sys.executable))


def test_a_directory_of_another_user_on_the_way_is_refused(tmp_path: Path, mallory: int) -> None:
    hers = tmp_path / "hers"
    (hers / "inner").mkdir(parents=True)
    give(hers, mallory)
    target = hers / "inner" / "config.yaml"
    target.write_text("{}\n")
    with pytest.raises(InputError) as info:
        trust.trusted_file(target, "config file")
    assert info.value.exit_code == EXIT_CONFIG
    assert f"{hers} on its way is owned by uid {mallory}" in str(info.value)
    assert str(target) in str(info.value)


def test_a_link_she_owns_in_a_sticky_directory_is_refused_though_root_wrote_its_target(
        tmp_path: Path, mallory: int) -> None:
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    root_file = tmp_path / "root.yaml"
    root_file.write_text("{}\n")
    link = sticky / "config.yaml"
    link.symlink_to(root_file)
    give(link, mallory)
    with pytest.raises(InputError) as info:
        trust.trusted_file(link, "config file")
    assert f"{link}: refusing the config file: it is a symlink owned by uid {mallory}" in str(info.value)
    # Root's own file in the sticky directory is trusted: others can neither rename nor remove it.
    mine = sticky / "mine.yaml"
    mine.write_text("{}\n")
    assert trust.trusted_file(mine, "config file") == mine
    # A sticky directory does not make a file of hers trusted, nor is it a state directory.
    give(mine, mallory)
    with pytest.raises(InputError, match=f"owned by uid {mallory}"):
        trust.trusted_file(mine, "config file")
    with pytest.raises(InputError, match="world-writable"):
        trust.check_dir(sticky, "state directory")


def test_the_directories_a_link_points_into_are_checked(tmp_path: Path, mallory: int) -> None:
    hers = tmp_path / "hers"
    hers.mkdir()
    give(hers, mallory)
    (hers / "snapshot.json").write_text("{}")
    link = tmp_path / "snapshot.json"
    link.symlink_to(hers / "snapshot.json")  # root's link, into her directory
    with pytest.raises(InputError) as info:
        trust.trusted_file(link, "snapshot")
    assert f"{hers} on its way is owned by uid {mallory}" in str(info.value)


def test_group_or_world_writable_files_and_directories_on_the_way_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("{}\n")
    cfg.chmod(0o666)
    with pytest.raises(InputError, match=r"world-writable \(mode 0666"):
        trust.trusted_file(cfg, "config file")
    cfg.chmod(0o644)
    tmp_path.chmod(0o775)
    try:
        with pytest.raises(InputError, match=f"{tmp_path} on its way is group-writable"):
            trust.trusted_file(cfg, "config file")
    finally:
        tmp_path.chmod(0o700)


def test_a_loop_of_links_is_refused_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(InputError, match=f"more than {trust.MAX_LINKS} symlinks"):
        trust.trusted_file(tmp_path / "a", "config file")


# -- the config file, the worker interpreter, the snapshot -----------------------------------------


def test_a_config_file_of_another_user_is_refused(tmp_path: Path, mallory: int) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("sweep:\n  baseline_repeats: 2\n")
    give(cfg, mallory)
    got = nccltune("sweep", "--demo", "--plan", "--config", cfg, "--state-dir", tmp_path / "state", cwd=tmp_path)
    refused(got, str(cfg), f"owned by uid {mallory}")


def test_a_world_writable_config_file_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("sweep:\n  baseline_repeats: 2\n")
    cfg.chmod(0o666)
    got = nccltune("sweep", "--demo", "--plan", "--config", cfg, "--state-dir", tmp_path / "state", cwd=tmp_path)
    refused(got, str(cfg), "world-writable (mode 0666")


def test_an_interpreter_in_a_directory_of_another_user_is_refused(demo_sweep: DemoSweep, tmp_path: Path,
                                                                 mallory: int) -> None:
    state = state_copy(demo_sweep, tmp_path)
    before = published_digests(state)
    hers = tmp_path / "hers"
    hers.mkdir()
    (hers / "python3").symlink_to(os.path.realpath(sys.executable))
    give(hers, mallory)
    got = nccltune("sweep", "--demo", SNAPSHOT, *demo_sweep.args(state), "--python", hers / "python3", cwd=tmp_path)
    refused(got, str(hers / "python3"), f"{hers} on its way is owned by uid {mallory}")
    assert published_digests(state) == before


def test_a_snapshot_of_another_user_is_refused(demo_sweep: DemoSweep, tmp_path: Path, mallory: int) -> None:
    state = state_copy(demo_sweep, tmp_path)
    before = published_digests(state)
    snap = tmp_path / "snapshot.json"
    shutil.copyfile(SNAPSHOT, snap)
    give(snap, mallory)
    cfg = yaml.safe_load(demo_sweep.config.read_text())
    cfg["topology"] = {"snapshot": str(snap)}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    got = nccltune("sweep", "--demo", "--config", tmp_path / "config.yaml", "--state-dir", state, cwd=tmp_path)
    refused(got, str(snap), f"owned by uid {mallory}")
    assert published_digests(state) == before


def test_nccl_tests_binaries_of_another_user_are_never_run(tmp_path: Path, mallory: int) -> None:
    import dataclasses

    from nccltune.config import Config, with_overrides
    from nccltune.node import load_node
    from nccltune.trials.session import resolve_engine

    suite = tmp_path / "nccl-tests"
    suite.mkdir()
    ran = tmp_path / "ran"
    for name in ("all_reduce_perf", "all_gather_perf"):
        (suite / name).write_text(f"#!/bin/sh\ntouch {ran}\n")
        (suite / name).chmod(0o755)
    cfg = with_overrides(Config(), **{"bench.engine": "nccl-tests", "bench.nccl_tests_dir": str(suite)})
    node = dataclasses.replace(load_node(cfg, True), demo=False, backend="nccl")
    assert resolve_engine(cfg, node, ["all_reduce", "all_gather"]).nccl_tests == str(suite / "all_reduce_perf")
    give(suite / "all_gather_perf", mallory)
    with pytest.raises(InputError, match=f"all_gather_perf: refusing the nccl-tests binary .*uid {mallory}"):
        resolve_engine(cfg, node, ["all_reduce", "all_gather"])
    assert not ran.exists()


# -- class profiles ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profile(demo_sweep: DemoSweep, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A class profile of the demo node as `fleet decide` writes it, and its class id."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    doc = demo_profile(demo_sweep.state, SNAPSHOT, out)
    assert doc["kind"] == PROFILE_KIND
    return out, str(doc["node_class"]["id"])


def apply(demo_sweep: DemoSweep, state: Path, path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return nccltune("apply", path, "--demo", SNAPSHOT, *demo_sweep.args(state), cwd=cwd)


def test_a_profile_directory_of_another_user_linking_to_a_file_root_wrote_is_refused(
        demo_sweep: DemoSweep, profile: tuple[Path, str], tmp_path: Path, mallory: int) -> None:
    written, class_id = profile
    state = state_copy(demo_sweep, tmp_path)
    before = published_digests(state)
    hers = tmp_path / "profiles"
    hers.mkdir()
    (hers / f"{class_id}.json").symlink_to(written)  # the target is root's, only the name is hers
    give(hers, mallory)
    got = apply(demo_sweep, state, hers, tmp_path)
    refused(got, f"{hers} on its way is owned by uid {mallory}")
    assert published_digests(state) == before
    # Her link to the same file, as the file given: refused for the link's owner.
    give(hers, 0)
    give(hers / f"{class_id}.json", mallory)
    refused(apply(demo_sweep, state, hers / f"{class_id}.json", tmp_path), f"a symlink owned by uid {mallory}")
    assert published_digests(state) == before


def test_a_configmap_of_root_owned_links_is_applied(demo_sweep: DemoSweep, profile: tuple[Path, str],
                                                    tmp_path: Path) -> None:
    written, class_id = profile
    state = state_copy(demo_sweep, tmp_path)
    mount = tmp_path / "profiles"
    data = mount / "..2026_01_01_00_00_00.1"
    data.mkdir(parents=True)
    shutil.copyfile(written, data / f"{class_id}.json")
    (mount / "..data").symlink_to(data.name)
    (mount / f"{class_id}.json").symlink_to(f"..data/{class_id}.json")
    got = apply(demo_sweep, state, mount, tmp_path)
    assert got.returncode == 0, got.stderr
    doc = json.loads((state / "nccl.json").read_text())
    assert doc["provenance"]["class_profile"]["class_id"] == class_id


# -- sweep --join: the state directory rule of sweep --------------------------------------------------


def test_join_refuses_a_state_directory_linked_to_one_of_another_user(tmp_path: Path, mallory: int) -> None:
    # Her directory, already holding the joiner's first trial directory with a link at agent.out
    # to a root-only file: root must not truncate it through her link.
    hers = tmp_path / "hers"
    (hers / "join" / "trial-001").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("root's own\n")
    secret.chmod(0o600)
    (hers / "join" / "trial-001" / "agent.out").symlink_to(secret)
    for path in (hers, hers / "join", hers / "join" / "trial-001", hers / "join" / "trial-001" / "agent.out"):
        give(path, mallory)
    state = tmp_path / "state"
    state.symlink_to(hers)
    give(state, mallory)
    got = nccltune("sweep", "--join", "127.0.0.1:9", "--state-dir", state, cwd=tmp_path)
    # The state directory is walked as given: her link is named.
    refused(got, f"{state}: refusing the state directory: it is a symlink owned by uid {mallory}")
    assert secret.read_text() == "root's own\n"
