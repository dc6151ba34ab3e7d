"""Every decider publishes one Setting through publish_setting: the sweep, the one-GPU node, a
class profile (`nccltune apply`, the daemon's profile.path) and the daemon's safe republish write
the same files, name the generation's own topology file, update the nccl.conf block, create a
missing state directory under the trust rule, and keep the profile in force only once its set is.
A refused or failed apply leaves the published set and the profile in force byte for byte."""

from __future__ import annotations

import copy
import datetime as dt
import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from demo_state import SNAPSHOT, DemoSweep, clean_env
from fleet_fixtures import demo_profile

from nccltune.config import Config, load_config
from nccltune.daemon import actions
from nccltune.daemon.actions import NcclInfo
from nccltune.errors import InputError
from nccltune.fleet.apply import MAX_CHOSEN_CHARS, ProfileRefused, apply_profile, profile_in_force
from nccltune.publish import (
    CONF_BEGIN,
    CONF_END,
    CURRENT_NAME,
    PROFILE_IN_FORCE,
    PUBLISHED_NAMES,
    TOPOLOGY_NAME,
    Provenance,
    PublishedSet,
    PublishError,
    Setting,
    publish_setting,
    read_set,
)

H200X1 = Path(__file__).parent / "fixtures" / "h200x1-vm.json"
# What every published provenance carries, whoever decided (a class profile adds class_profile, a
# sweep the run that published it: run_id and history).
PROVENANCE_FIELDS = {"nccltune_version", "created_at", "topology_fingerprint", "nccl_version", "backend", "demo",
                     "profile", "gains", "note", "tuning_fingerprint", "state", "generation"}
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)


def node_config(tmp_path: Path, state: Path, **extra: Any) -> Path:
    """A config for `state` with an nccl.conf block of its own."""
    path = tmp_path / f"{state.name}.yaml"
    doc = {"state_dir": str(state), "publish": {"nccl_conf": str(tmp_path / f"{state.name}-nccl.conf")}, **extra}
    path.write_text(yaml.safe_dump(doc))
    return path


def conf_block(cfg: Config) -> dict[str, str]:
    """The variables of the managed block in cfg's nccl.conf."""
    assert cfg.nccl_conf is not None
    lines = cfg.nccl_conf.read_text().splitlines()
    block = lines[lines.index(CONF_BEGIN) + 1:lines.index(CONF_END)]
    return dict(line.split("=", 1) for line in block if not line.startswith("#"))


def tree_bytes(root: Path) -> dict[str, bytes | str]:
    """Every file (its bytes) and link (its target) under root."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def check_set(got: PublishedSet | None) -> tuple[PublishedSet, dict[str, Any]]:
    """The rules every published set keeps, and its nccl.json document."""
    assert got is not None
    doc = json.loads(got.texts["nccl.json"])
    assert set(os.listdir(got.directory)) >= set(PUBLISHED_NAMES)
    assert set(got.provenance) >= PROVENANCE_FIELDS
    if "NCCL_TOPO_FILE" in got.env:
        # The generation's own copy, never the stable <state>/ncclTopology.xml.
        assert got.env["NCCL_TOPO_FILE"] == str(got.directory / TOPOLOGY_NAME)
        assert (got.directory / TOPOLOGY_NAME).is_file()
    return got, doc


@pytest.fixture(scope="module")
def profile_doc(demo_sweep: DemoSweep, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A class profile of the demo snapshot's class that names the node's topology file."""
    doc = demo_profile(demo_sweep.state, SNAPSHOT, tmp_path_factory.mktemp("profile") / "decided.json")
    return {**doc, "topology_file": True}


def write_profile(doc: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def test_every_decider_publishes_the_same_set(demo_sweep: DemoSweep, profile_doc: dict[str, Any],
                                              tmp_path: Path) -> None:
    sets: dict[str, tuple[PublishedSet, dict[str, Any]]] = {"sweep": check_set(read_set(demo_sweep.state))}
    configs: dict[str, Config] = {}

    one_gpu = tmp_path / "one-gpu"
    path = node_config(tmp_path, one_gpu, topology={"snapshot": str(H200X1)})
    got = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--config", str(path)], capture_output=True,
                         text=True, env=clean_env(), timeout=300, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    configs["one-GPU"] = load_config(path, required=True)
    sets["one-GPU"] = check_set(read_set(one_gpu))

    # A fresh node applying its class profile: the state directory does not exist yet.
    applied = tmp_path / "fresh" / "state"
    configs["apply"] = load_config(node_config(tmp_path, applied), required=True)
    apply_profile(configs["apply"], write_profile(profile_doc, tmp_path / "profile.json"), demo=str(SNAPSHOT))
    assert stat.S_IMODE(applied.stat().st_mode) == 0o755
    sets["apply"] = check_set(read_set(applied))

    safe = tmp_path / "safe"
    configs["safe"] = load_config(node_config(tmp_path, safe), required=True)
    node = actions.read_node(configs["safe"], str(SNAPSHOT))
    assert actions.republish_safe(configs["safe"], node, NcclInfo(), "topology changed", NOW) == 1
    sets["safe"] = check_set(read_set(safe))

    own_keys = {"class_profile", "run_id", "history"}
    shapes = {name: (sorted(doc), sorted(doc["scopes"]), sorted(set(doc["provenance"]) - own_keys))
              for name, (_got, doc) in sets.items()}
    assert len(set(map(repr, shapes.values()))) == 1, shapes
    assert {name for name, (got, _doc) in sets.items() if "class_profile" in got.provenance} == {"apply"}
    assert {name for name, (got, _doc) in sets.items() if "run_id" in got.provenance} == {"sweep", "one-GPU"}
    for name, cfg in configs.items():
        published, _doc = sets[name]
        own = str(published.directory / TOPOLOGY_NAME)
        assert published.env["NCCL_TOPO_FILE"] == own, name
        # The stable copy, for site scripts that name one path, holds the same XML.
        assert cfg.topology_file.read_bytes() == Path(own).read_bytes(), name
        nccl = {k: v for k, v in published.env.items() if k.startswith("NCCL_")}
        assert conf_block(cfg) == nccl, name
    assert (applied / PROFILE_IN_FORCE).read_text() == (tmp_path / "profile.json").read_text()


@pytest.fixture
def applied(profile_doc: dict[str, Any], tmp_path: Path) -> tuple[Config, Path]:
    """A node with profile_doc applied (its config, its state directory)."""
    state = tmp_path / "state"
    cfg = load_config(node_config(tmp_path, state), required=True)
    apply_profile(cfg, write_profile(profile_doc, tmp_path / "in-force.json"), demo=str(SNAPSHOT))
    assert (state / PROFILE_IN_FORCE).read_bytes() == (tmp_path / "in-force.json").read_bytes()
    return cfg, state


def test_a_refused_profile_changes_nothing(applied: tuple[Config, Path], profile_doc: dict[str, Any],
                                           tmp_path: Path) -> None:
    cfg, state = applied
    before = tree_bytes(state)
    conf = cfg.nccl_conf.read_bytes() if cfg.nccl_conf else b""
    huge = write_profile({**profile_doc, "chosen": "x" * (2 << 20)}, tmp_path / "huge.json")
    with pytest.raises(ProfileRefused) as info:
        apply_profile(cfg, huge, demo=str(SNAPSHOT))
    assert info.value.code == "unsafe" and info.value.exit_code == 78
    assert f"$.chosen: {2 << 20} characters" in str(info.value) and str(MAX_CHOSEN_CHARS) in str(info.value)
    many = copy.deepcopy(profile_doc)
    many["env"] = {f"NCCL_X{i}": "1" for i in range(300)}
    with pytest.raises(ProfileRefused, match=r"\$\.env: 300 variables"):
        apply_profile(cfg, write_profile(many, tmp_path / "many.json"), demo=str(SNAPSHOT))
    assert tree_bytes(state) == before
    assert cfg.nccl_conf is not None and cfg.nccl_conf.read_bytes() == conf


def test_a_publish_that_fails_after_validation_keeps_the_profile_in_force(
        applied: tuple[Config, Path], profile_doc: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, state = applied
    before = tree_bytes(state)
    other = write_profile({**profile_doc, "chosen": f"{profile_doc['chosen']} (re-decided)"}, tmp_path / "b.json")
    real_rename = os.rename

    def full_disk(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if "generations" in str(dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", full_disk)
    with pytest.raises(PublishError):
        apply_profile(cfg, other, demo=str(SNAPSHOT))
    monkeypatch.undo()
    after = tree_bytes(state)
    # Only the number handed out moved on (never reused); the set and the profile in force did not.
    assert {k: v for k, v in after.items() if k != "generations/last"} == \
        {k: v for k, v in before.items() if k != "generations/last"}
    got = read_set(state)
    assert got is not None and got.generation == 1
    # The same profile applies once the disk has room, and is then the one in force.
    apply_profile(cfg, other, demo=str(SNAPSHOT))
    assert (state / PROFILE_IN_FORCE).read_bytes() == other.read_bytes()


def test_the_profile_in_force_switches_with_its_set(applied: tuple[Config, Path], profile_doc: dict[str, Any],
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after the switch but before the state directory's copy: the set's own copy is the
    profile in force, so a later sweep by hand or verify sees the profile that is published."""
    cfg, state = applied
    kept = (state / PROFILE_IN_FORCE).read_bytes()
    other = write_profile({**profile_doc, "chosen": f"{profile_doc['chosen']} (re-decided)"}, tmp_path / "b.json")

    def stopped(path: Path, data: str | bytes, mode: int = 0o644) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("nccltune.publish.publisher.atomic_write", stopped)
    with pytest.raises(KeyboardInterrupt):
        apply_profile(cfg, other, demo=str(SNAPSHOT))
    monkeypatch.undo()
    assert (state / PROFILE_IN_FORCE).read_bytes() == kept  # the stop came before this copy
    got = read_set(state)
    assert got is not None and got.generation == 2
    loaded = profile_in_force(cfg, got.provenance)
    assert loaded is not None and loaded.raw == other.read_bytes()
    assert (state / CURRENT_NAME / PROFILE_IN_FORCE).read_bytes() == other.read_bytes()


def test_a_setting_over_a_bound_is_refused_before_the_state_directory_exists(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = load_config(node_config(tmp_path, state), required=True)
    prov = Provenance("0.2.0", "2026-12-01T12:00:00+00:00", "f", None, "gloo", True, None, note="n" * (2 << 20))
    with pytest.raises(InputError, match=r"safe republish: provenance\.note: 2097152 characters"):
        publish_setting(cfg, Setting({"NCCL_ALGO": "Ring"}, prov, where="safe republish"))
    many = Provenance("0.2.0", "2026-12-01T12:00:00+00:00", "f", None, "gloo", True, None)
    with pytest.raises(InputError, match="300 variables"):
        publish_setting(cfg, Setting({f"NCCL_X{i}": "1" for i in range(300)}, many))
    assert not state.exists()
    assert cfg.nccl_conf is not None and not cfg.nccl_conf.exists()


def test_the_generation_writer_is_the_publishers_alone() -> None:
    """publish_setting is the one way into a published set: the generation writer under it is
    called from publisher.py alone, by no decider, tool or test."""
    from nccltune.publish import generations

    root = Path(__file__).resolve().parent.parent
    writer = "publish_" + "generation"  # spelled apart, so this file is not one of its callers
    sources = [*root.glob("nccltune/**/*.py"), *root.glob("bench/**/*.py"), *root.glob("tests/*.py")]
    callers = sorted(str(p.relative_to(root)) for p in sources if writer in p.read_text(encoding="utf-8"))
    assert callers == ["nccltune/publish/generations.py", "nccltune/publish/publisher.py"]
    assert not hasattr(generations, "publish")
