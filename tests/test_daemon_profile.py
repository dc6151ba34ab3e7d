"""The daemon's profile.path: a class profile applied at start, on reload and when its file
changes (a Kubernetes ConfigMap's `..data` link swapped), refused when it is for another class,
stale or malformed (the published files stay byte for byte), and never replaced by a node-local
sweep while it is in force. In-process daemons over the demo snapshot (daemon_harness)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import RETUNE, Harness, config_text, published_bytes
from demo_state import SNAPSHOT, clean_env, seeded_state
from fleet_fixtures import demo_profile, load, sibling, write
from prometheus_client.parser import text_string_to_metric_families

from nccltune.config import Config
from nccltune.daemon import Daemon, actions, scheduler
from nccltune.daemon import profile as safe
from nccltune.daemon.actions import Node
from nccltune.daemon.scheduler import Action
from nccltune.errors import BusyError
from nccltune.fleet.apply import PROFILE_IN_FORCE
from nccltune.fleet.upgrade import SAFE_AFTER_UPGRADE, SAFE_PART
from nccltune.store import Store
from nccltune.topology.nodeclass import class_id_of

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return seeded_state(tmp_path_factory)


@pytest.fixture(scope="module")
def profile(seeded: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A class profile of two demo nodes of the snapshot's class (the seeded node and a twin)."""
    return demo_profile(seeded, SNAPSHOT, tmp_path_factory.mktemp("profile") / "profile.json")


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.close()


class ConfigMap:
    """A directory laid out as the kubelet mounts a ConfigMap: `profile.json -> ..data/profile.json`,
    `..data -> ..<version>/`; an update writes a new version directory and swaps `..data`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = 0
        root.mkdir()
        (root / "profile.json").symlink_to("..data/profile.json")

    @property
    def path(self) -> Path:
        return self.root / "profile.json"

    def update(self, text: str) -> None:
        self.versions += 1
        version = self.root / f"..2026_12_01_00_00_{self.versions:02d}"
        version.mkdir()
        (version / "profile.json").write_text(text)
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.root / "..data")


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def provenance(state: Path) -> dict[str, Any]:
    prov = json.loads((state / "nccl.json").read_text())["provenance"]
    assert isinstance(prov, dict)
    return prov


def metric_samples(state: Path) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    # The history's file and the daemon's own: disjoint series.
    text = "".join((state / "metrics" / name).read_text() for name in ("nccltune.prom", "nccltune-daemon.prom"))
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def start_with_profile(harness: Harness, seeded: Path | None, tmp_path: Path, text: str,
                       **kwargs: Any) -> tuple[Daemon, ConfigMap]:
    cm = ConfigMap(tmp_path / "configmap")
    cm.update(text)
    return harness.daemon(seeded=seeded, **{"profile.path": str(cm.path)}, **kwargs), cm


def never_sweeps(d: Daemon) -> None:
    """Whatever asks for a sweep, the scheduler does not start one while the profile is in force."""
    assert d.state.profile is not None and d.state.sweep_pending is None
    assert scheduler.sweep_needed(d.state, "verify found drift") == d.state
    assert d.decide().action is not Action.SWEEP


def test_a_profile_is_applied_at_start_and_env_names_it(harness: Harness, seeded: Path, tmp_path: Path,
                                                        profile: dict[str, Any]) -> None:
    text = dumps(profile)
    d, _cm = start_with_profile(harness, seeded, tmp_path, text)
    state = tmp_path / "state"
    prov = provenance(state)
    assert prov["class_profile"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert prov["class_profile"]["class_id"] == profile["node_class"]["id"]
    assert prov["note"].startswith(f"class profile profile.json (class {profile['node_class']['id']}")
    assert (state / PROFILE_IN_FORCE).read_text() == text  # what verify compares the node with
    assert d.profile.state == "in_force" and d.state.profile == "profile.json"
    assert d.status_text == "idle, class profile profile.json in force"
    never_sweeps(d)
    # `nccltune env` names the profile in force.
    shown = subprocess.run([sys.executable, "-m", "nccltune", "env", "--state-dir", str(state)], capture_output=True,
                           text=True, env=clean_env(), timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"# note: class profile profile.json (class {profile['node_class']['id']}" in shown.stdout
    d.write_metrics()
    s = metric_samples(state)
    assert {x.labels["state"]: x.value for x in s["nccltune_profile_state"]}["in_force"] == 1.0
    info = s["nccltune_published_info"][0].labels
    assert info["decision"] == "class" and info["profile_generation"] == prov["class_profile"]["sha256"][:16]
    assert info["class"] == profile["node_class"]["id"]  # the metrics' class is the profile's class id


def test_an_update_of_the_configmap_is_applied_at_the_next_poll(harness: Harness, seeded: Path, tmp_path: Path,
                                                                profile: dict[str, Any]) -> None:
    d, cm = start_with_profile(harness, seeded, tmp_path, dumps(profile))
    state = tmp_path / "state"
    first = provenance(state)
    d.poll()  # nothing changed: nothing is published again
    assert provenance(state)["generation"] == first["generation"]
    newer = copy.deepcopy(profile)
    newer["provenance"]["created_at"] = "2026-12-02T00:00:00+00:00"  # re-decided: same values, a new document
    cm.update(dumps(newer))
    d.poll()
    now = provenance(state)
    assert now["generation"] == first["generation"] + 1
    assert now["class_profile"]["sha256"] == hashlib.sha256(dumps(newer).encode()).hexdigest()
    assert now["class_profile"]["decided_at"] == "2026-12-02T00:00:00+00:00"
    # The same bytes again under a new ..data target: a new stamp, the same content, no new generation.
    cm.update(dumps(newer))
    d.poll()
    assert provenance(state)["generation"] == now["generation"]


def _other_class(p: dict[str, Any]) -> None:
    p["node_class"]["facts"]["gpu_count"] = 8
    p["node_class"]["id"] = class_id_of(p["node_class"]["facts"])


def _stale(p: dict[str, Any]) -> None:
    p["versions"]["driver"] = p["node_class"]["facts"]["driver_version"] = "570.86.15"
    p["node_class"]["id"] = class_id_of(p["node_class"]["facts"])


@pytest.mark.parametrize(("change", "code", "message"), [
    (_other_class, "other_class", "profile is for node class"),
    (lambda p: None, "malformed", "not valid JSON"),
])
def test_a_bad_profile_is_refused_and_the_node_keeps_what_it_had(
        harness: Harness, seeded: Path, tmp_path: Path, profile: dict[str, Any], caplog: pytest.LogCaptureFixture,
        change: Callable[[dict[str, Any]], None], code: str, message: str) -> None:
    d, cm = start_with_profile(harness, seeded, tmp_path, dumps(profile))
    state = tmp_path / "state"
    before = published_bytes(state)
    kept = (state / PROFILE_IN_FORCE).read_bytes()
    bad = copy.deepcopy(profile)
    change(bad)
    with caplog.at_level(logging.INFO, logger="nccltune.daemon"):
        cm.update(dumps(bad) if code != "malformed" else dumps(bad)[:200])
        d.poll()
        d.poll()  # refused once, logged once
    assert published_bytes(state) == before and (state / PROFILE_IN_FORCE).read_bytes() == kept
    assert d.profile.state == "refused" and d.profile.code == code
    refusals = [r for r in caplog.records if "class profile refused" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR
    assert message in refusals[0].getMessage() and str(cm.path) in refusals[0].getMessage()
    # The profile applied before still fits the node: it stays in force.
    never_sweeps(d)
    d.write_metrics()
    s = metric_samples(state)
    assert {x.labels["state"]: x.value for x in s["nccltune_profile_state"]}["refused"] == 1.0
    assert [x.labels["reason"] for x in s["nccltune_profile_refused_info"]] == [code]


def _busy(*args: Any, **kwargs: Any) -> None:
    raise BusyError("another publisher holds the publish lock")


@pytest.mark.parametrize(("what", "change", "publisher", "served"), [
    ("the class profile", lambda p: p["provenance"].update(created_at="2026-12-02T00:00:00+00:00"),
     (actions, "publish_class_profile"), "in_force"),
    ("the safe part of", _stale, (safe, "publish_safe_part"), "safe_part"),
])
def test_a_publish_that_cannot_happen_now_keeps_what_is_published_and_the_next_poll_tries_again(
        harness: Harness, seeded: Path, tmp_path: Path, profile: dict[str, Any], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, what: str, change: Callable[[dict[str, Any]], None],
        publisher: tuple[Any, str], served: str) -> None:
    """A busy publish of a new profile (or of a stale one's safe part) changes nothing and is not a
    refusal; the file is read again at the next poll although it did not change again."""
    d, cm = start_with_profile(harness, seeded, tmp_path, dumps(profile))
    state = tmp_path / "state"
    before, kept = published_bytes(state), d.profile_in_force
    changed = copy.deepcopy(profile)
    change(changed)
    monkeypatch.setattr(*publisher, _busy)
    with caplog.at_level(logging.INFO, logger="nccltune.daemon"):
        cm.update(dumps(changed))
        d.poll()
    assert published_bytes(state) == before and d.profile_in_force is kept and d.profile.state == "in_force"
    busy = [r for r in caplog.records if "cannot publish" in r.getMessage()]
    assert len(busy) == 1 and busy[0].levelno == logging.ERROR
    assert busy[0].getMessage().startswith(f"cannot publish {what} ")
    assert busy[0].getMessage().endswith("now: another publisher holds the publish lock; keeping what is published")
    assert not [r for r in caplog.records if "class profile refused" in r.getMessage()]
    monkeypatch.undo()
    d.poll()
    assert d.profile.state == served
    assert provenance(state)["class_profile"]["sha256"] == hashlib.sha256(dumps(changed).encode()).hexdigest()


def _upgrade_series(state: Path) -> dict[str, dict[str, float]]:
    """The daemon's profile and upgrade series, each by its one label besides the class."""
    s = metric_samples(state)
    labels = {"nccltune_profile_state": "state", "nccltune_upgrade_safe_part_info": "role",
              "nccltune_upgrade_canary_outcome": "outcome"}
    return {name: {x.labels[label]: x.value for x in s.get(name, [])} for name, label in labels.items()}


def test_a_profile_of_other_versions_serves_its_safe_part_and_never_a_choice_of_its_own(
        harness: Harness, seeded: Path, tmp_path: Path, profile: dict[str, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """The node's driver is not the profile's (an upgrade): its safe part is published, with the
    profile named and its copy in force; nothing is swept or verified on a node that is not the
    canary, whatever asks for it."""
    d, cm = start_with_profile(harness, seeded, tmp_path, dumps(profile))
    state = tmp_path / "state"
    stale = copy.deepcopy(profile)
    _stale(stale)
    stale["evidence"]["nodes"][1]["hostname"] = "0-canary"  # another node is the class's canary
    stale["env"] = {**stale["env"], "NCCL_IB_HCA": "mlx5_0", "NCCL_BUFFSIZE": "8388608"}
    with caplog.at_level(logging.INFO, logger="nccltune.daemon"):
        cm.update(dumps(stale))
        d.poll()
        d.poll()  # served once, logged once
    prov = provenance(state)
    assert prov["state"] == "safe" and prov["class_profile"]["part"] == SAFE_PART
    assert prov["class_profile"]["sha256"] == hashlib.sha256(dumps(stale).encode()).hexdigest()
    assert "driver 570.86.15 (profile) vs 580.159.04 (this node)" in prov["note"]
    env = json.loads((state / "nccl.json").read_text())["env"]
    assert env["NCCL_IB_HCA"] == "mlx5_0" and "NCCL_BUFFSIZE" not in env
    assert set(env) <= SAFE_AFTER_UPGRADE | {"NCCL_TOPO_FILE"}
    assert (state / PROFILE_IN_FORCE).read_text() == dumps(stale)
    assert d.profile.state == "safe_part" and d.state.safe_part and d.safe_part is not None
    assert not d.safe_part.canary and d.state.sweep_pending is None
    assert d.status_text == "idle, safe part of class profile profile.json after an upgrade"
    served = [r for r in caplog.records if "serving its safe part" in r.getMessage()]
    assert len(served) == 1 and "the class's canary 0-canary re-measures" in served[0].getMessage()
    assert not [r for r in caplog.records if "class profile refused" in r.getMessage()]
    # No per-node choice: no sweep for any reason, and no verify against numbers of the old versions.
    assert scheduler.sweep_needed(d.state, "verify found drift") == d.state
    d.state = scheduler.replace(d.state, last_verify_s=-1e9)
    assert d.decide().action is Action.WAIT and d.decide().reason == scheduler.SAFE_PART_WAIT
    d.write_metrics()
    got = _upgrade_series(state)
    assert got["nccltune_profile_state"]["safe_part"] == 1.0 and got["nccltune_profile_state"]["refused"] == 0.0
    assert got["nccltune_upgrade_safe_part_info"] == {"member": 1.0} and not got["nccltune_upgrade_canary_outcome"]
    # A profile for another kind of node: refused, and the node decides for itself again.
    other = copy.deepcopy(profile)
    _other_class(other)
    cm.update(dumps(other))
    d.poll()
    assert d.profile.state == "refused" and d.safe_part is None and not d.state.safe_part
    assert d.state.profile is None and d.state.sweep_pending is not None
    # The profile of the node's versions comes back: in force, every part.
    cm.update(dumps(profile))
    d.poll()
    assert d.profile.state == "in_force" and not d.state.safe_part and d.safe_part is None
    assert "part" not in provenance(state)["class_profile"]


def test_on_the_canary_the_safe_part_comes_with_one_narrowed_sweep(harness: Harness, tmp_path: Path,
                                                                   profile: dict[str, Any]) -> None:
    """The profile's node of lowest hostname (this one) re-measures the profile's values under the
    new versions: a sweep is pending until the history holds one of these versions."""
    stale = copy.deepcopy(profile)
    _stale(stale)
    stale["env"] = {**stale["env"], "NCCL_BUFFSIZE": "8388608"}
    d, _cm = start_with_profile(harness, None, tmp_path, dumps(stale))
    assert d.profile.state == "safe_part" and d.safe_part is not None and d.safe_part.canary
    assert d.state.sweep_pending == "canary: re-measure class profile profile.json under the new versions"
    assert d.decide().action is Action.SWEEP
    narrowed = safe.canary_config(d.cfg, d.safe_part)
    assert narrowed.sweep.variables == {"NCCL_BUFFSIZE": ["8388608"]}
    d.write_metrics()
    assert _upgrade_series(tmp_path / "state")["nccltune_upgrade_safe_part_info"] == {"canary": 1.0}


def test_a_refused_profile_on_a_fresh_node_leaves_the_daemon_to_decide(harness: Harness, tmp_path: Path,
                                                                       profile: dict[str, Any]) -> None:
    bad = copy.deepcopy(profile)
    _other_class(bad)
    d, _cm = start_with_profile(harness, None, tmp_path, dumps(bad))
    assert not (tmp_path / "state" / "nccl.json").exists()  # nothing published from it
    assert d.profile.code == "other_class" and d.state.profile is None
    assert d.state.sweep_pending == "nothing is published yet"


def test_no_node_local_sweep_replaces_a_profile(harness: Harness, seeded: Path, tmp_path: Path,
                                                 profile: dict[str, Any]) -> None:
    """New sweep settings (a reload), a verify that fails and a topology change of a node still of
    the class all leave the class profile published: re-applied, never swept over."""
    sibling_snapshot = write(sibling(load("h200x2-nvswitch-vm"), seed=7), tmp_path / "renumbered.json")
    renumbered = False

    def loader(cfg: Config, demo: str | bool | None) -> Node:
        return actions.read_node(cfg, str(sibling_snapshot) if renumbered else demo)

    d, _cm = start_with_profile(harness, seeded, tmp_path, dumps(profile), node_loader=loader)
    state = tmp_path / "state"
    first = provenance(state)
    (tmp_path / "config.yaml").write_text(config_text(**RETUNE))
    d.reload()
    after_reload = provenance(state)
    # The sweep settings are part of the tuning fingerprint: the profile is re-applied for them.
    assert after_reload["generation"] == first["generation"] + 1
    assert after_reload["tuning_fingerprint"] == d.tuning_fp != first["tuning_fingerprint"]
    assert after_reload["class_profile"] == first["class_profile"]
    never_sweeps(d)
    renumbered = True  # same class (only bus numbers and serials differ), another fingerprint
    d.poll()
    moved = provenance(state)
    assert moved["topology_fingerprint"] == d.watcher.node.fingerprint != first["topology_fingerprint"]
    assert moved["class_profile"] == first["class_profile"] and moved["state"] == first["state"] != "safe"
    never_sweeps(d)
    # Its verify compares the node with the class's numbers; a failure asks for no sweep.
    d.state = scheduler.verify_started(d.state, d.clock())
    d.verify()
    never_sweeps(d)
    with Store(state / "history.db") as store:
        (run,) = store.runs(limit=1, kind="verify")
        sweeps = store.runs(limit=None, kind="sweep")
    assert run.summary is not None and run.summary["reference"] == "class"
    assert run.summary["class_profile"]["sha256"] == first["class_profile"]["sha256"]
    assert run.summary["expectation"].startswith("class profile profile.json")
    assert len(sweeps) == 1  # the seeded one: the daemon ran none


def test_a_node_that_leaves_the_class_falls_back_to_its_own_decision(harness: Harness, seeded: Path, tmp_path: Path,
                                                                      profile: dict[str, Any]) -> None:
    lost = load("h200x2-nvswitch-vm")
    lost["nvml"]["gpus"][0]["nvlinks"][3]["active"] = False
    lost_snapshot = write(lost, tmp_path / "lost.json")
    broken = False

    def loader(cfg: Config, demo: str | bool | None) -> Node:
        return actions.read_node(cfg, str(lost_snapshot) if broken else demo)

    d, _cm = start_with_profile(harness, seeded, tmp_path, dumps(profile), node_loader=loader)
    assert d.state.profile is not None
    broken = True
    d.poll()
    assert d.profile.code == "other_class" and d.state.profile is None and d.profile_in_force is None
    prov = provenance(tmp_path / "state")
    assert prov["state"] == "safe" and "class_profile" not in prov  # nothing of the old class is kept
    assert d.state.sweep_pending == "the published tuning is for another topology"


def test_without_profile_path_nothing_changes(harness: Harness, seeded: Path, tmp_path: Path) -> None:
    d = harness.daemon(seeded=seeded)
    assert d.state.profile is None and d.profile.state == "absent"
    d.write_metrics()
    assert "nccltune_profile_state" not in metric_samples(tmp_path / "state")


def test_a_missing_profile_file_is_absent_not_refused(harness: Harness, seeded: Path, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nccltune.daemon"):
        d = harness.daemon(seeded=seeded, **{"profile.path": str(tmp_path / "nowhere" / "profile.json")})
    assert d.profile.state == "absent" and d.profile.code == "missing"
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)
    assert d.state.profile is None and d.state.sweep_pending is None  # the seeded tuning stays current


def test_the_heartbeat_is_written_every_poll_and_the_probe_reads_it(harness: Harness, tmp_path: Path) -> None:
    d = harness.daemon()
    path = tmp_path / "state" / actions.HEARTBEAT_FILE
    doc = json.loads(path.read_text())
    assert doc["pid"] == os.getpid() and doc["state"] == "sweep_pending" and doc["time"] > 0
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    d.poll()
    assert time.time() - path.stat().st_mtime < 60
    assert not list(path.parent.glob(".daemon.heartbeat*"))  # replaced atomically: no temp file left
    # The DaemonSet's probes accept this file, and refuse it once it is old.
    manifest = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "nccltune-daemonset.yaml"
    (ds,) = [doc for doc in yaml.safe_load_all(manifest.read_text()) if doc and doc["kind"] == "DaemonSet"]
    (container,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "nccltune"]
    for name in ("livenessProbe", "startupProbe"):
        script = container[name]["exec"]["command"][2].replace("/var/lib/nccltune/daemon.heartbeat", str(path))
        assert subprocess.run(["/bin/sh", "-c", script], timeout=10).returncode == 0, name
        os.utime(path, (time.time() - 3600, time.time() - 3600))
        assert subprocess.run(["/bin/sh", "-c", script], timeout=10).returncode != 0, name
        d.poll()


def test_a_directory_of_profiles_gives_each_node_its_classes(harness: Harness, seeded: Path, tmp_path: Path,
                                                             profile: dict[str, Any]) -> None:
    """profile.path may be a directory of <class id>.json (one ConfigMap for every class): the
    daemon takes its own class's and leaves the others alone."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    other = copy.deepcopy(profile)
    _other_class(other)
    (profiles / f"{other['node_class']['id']}.json").write_text(dumps(other))
    d = harness.daemon(seeded=seeded, **{"profile.path": str(profiles)})
    assert d.profile.state == "absent" and d.profile.code == "missing" and d.state.profile is None
    own = profiles / f"{profile['node_class']['id']}.json"
    own.write_text(dumps(profile))
    d.poll()
    assert d.profile.state == "in_force" and d.profile.file == str(own)
    assert provenance(tmp_path / "state")["class_profile"]["file"] == own.name
    generation = provenance(tmp_path / "state")["generation"]
    own.unlink()  # gone from the directory: what was applied stays published and in force
    d.poll()
    assert d.profile.state == "absent" and d.state.profile == own.name
    assert provenance(tmp_path / "state")["generation"] == generation


def test_a_publish_by_hand_over_the_profile_is_undone_at_the_next_poll(harness: Harness, seeded: Path,
                                                                        tmp_path: Path,
                                                                        profile: dict[str, Any]) -> None:
    import datetime as dt

    d, _cm = start_with_profile(harness, seeded, tmp_path, dumps(profile))
    state = tmp_path / "state"
    applied = provenance(state)["class_profile"]
    # What a `nccltune sweep` run by hand publishes: a node-local set, no class profile.
    actions.republish_safe(d.cfg, d.watcher.node, d.watcher.nccl, "by hand", dt.datetime.now())
    assert "class_profile" not in provenance(state)
    d.poll()
    assert provenance(state)["class_profile"] == applied and provenance(state)["state"] in ("tuned", "defaults")


def test_in_a_directory_of_profiles_the_newest_of_the_nodes_kind_gives_the_safe_part(
        harness: Harness, tmp_path: Path, profile: dict[str, Any]) -> None:
    """No `<class id>.json` for the node's versions: of the directory's profiles, those of its kind
    under other versions are found (another kind's and a malformed file are passed over), and the
    one decided last gives the safe part."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    older, newer = copy.deepcopy(profile), copy.deepcopy(profile)
    _stale(older)
    _stale(newer)
    newer["versions"]["driver"] = newer["node_class"]["facts"]["driver_version"] = "575.1.1"
    newer["node_class"]["id"] = class_id_of(newer["node_class"]["facts"])
    older["provenance"]["created_at"] = "2026-01-01T00:00:00+00:00"
    newer["provenance"]["created_at"] = "2026-02-01T00:00:00+00:00"
    other = copy.deepcopy(profile)
    _other_class(other)
    for doc in (older, newer, other):
        (profiles / f"{doc['node_class']['id']}.json").write_text(dumps(doc))
    (profiles / "broken.json").write_text("{")
    d = harness.daemon(**{"profile.path": str(profiles)})
    assert d.profile.state == "safe_part" and d.safe_part is not None
    assert d.safe_part.name == f"{newer['node_class']['id']}.json"
    assert "driver 575.1.1 (profile) vs 580.159.04 (this node)" in provenance(tmp_path / "state")["note"]
