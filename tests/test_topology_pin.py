"""Whose topology file is published: one rule (publish.topology_pin, publish.topology_env) for the
sweep, the one-GPU publish, `apply` and the daemon's safe republish. A config pin of NCCL_TOPO_FILE
is published as its path and no XML of nccltune's is written; a topology file the site's NCCL conf
file names is left to NCCL (nothing published over it); only where nothing pins one is
nccltune's own published, as the generation's copy with the stable copy beside it."""

from __future__ import annotations

import datetime as dt
import json
import os
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from demo_state import SNAPSHOT, DemoSweep
from fleet_fixtures import demo_profile

from nccltune.config import Config, load_config
from nccltune.daemon import actions
from nccltune.daemon.actions import NcclInfo
from nccltune.fleet.apply import apply_profile
from nccltune.pipeline import SweepPipeline
from nccltune.pipeline.choice import choose
from nccltune.pipeline.planning import make_plan
from nccltune.pipeline.stages import _Sweep
from nccltune.publish import (
    OWN_TOPOLOGY,
    TOPOLOGY_NAME,
    PublishedSet,
    TopologyPin,
    read_set,
    topology_env,
    topology_pin,
)
from nccltune.sweep.plan import build_plan
from nccltune.sweep.strategy import Finalist, SearchResult
from nccltune.trials.trialenv import carried, fixed_part

TOPO = "NCCL_TOPO_FILE"
H200X1 = Path(__file__).parent / "fixtures" / "h200x1-vm.json"
DECIDERS = ("sweep", "one-GPU", "apply", "republish")


def node_cfg(tmp_path: Path, pin: Path | None, **extra: Any) -> Config:
    """A node's config over its own state directory, pinning `pin` as NCCL_TOPO_FILE when given."""
    state = tmp_path / "state"
    doc: dict[str, Any] = {"state_dir": str(state), **extra}
    if pin is not None:
        doc["sweep"] = {"pin": {TOPO: str(pin)}}
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_config(path, required=True)


@pytest.fixture(scope="module")
def profile_path(demo_sweep: DemoSweep, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A class profile of the demo snapshot's class that names the node's own topology file."""
    out = tmp_path_factory.mktemp("pin-profile") / "decided.json"
    doc = {**demo_profile(demo_sweep.state, SNAPSHOT, out), "topology_file": True}
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return out


def site_env() -> dict[str, str]:
    """The calling environment a sweep reads the site's conf files through (NCCL_CONF_FILE)."""
    return {name: os.environ[name] for name in ("NCCL_CONF_FILE",) if name in os.environ}


def sweep_publish(cfg: Config) -> None:
    """What a measured sweep publishes (_Sweep._publish) for a winner that carried nccltune's
    topology file (the marker, as every candidate but the defaults does)."""
    node = actions.read_node(cfg, str(SNAPSHOT))
    plan = make_plan(cfg, node, site_env())
    chosen = Finalist({TOPO: OWN_TOPOLOGY, "NCCL_ALGO": "Ring"}, "NCCL_ALGO=Ring")
    result = SearchResult(baseline_runs=[], baseline={}, screened=[], finalists=[chosen], chosen=chosen,
                          topo_only=None, weights={}, notes=[])
    choice = choose(result, plan, cfg.topology_file, [], demo=True)
    sweep = SimpleNamespace(cfg=cfg, node=node, tuning_fp=lambda: "f" * 16, run_id=1, table=None,
                            store=SimpleNamespace(path=Path(cfg.state_dir) / "history.db"),
                            pipe=SimpleNamespace(container=lambda: None), xml_text="<system version=\"1\"/>\n",
                            published_table={})
    _Sweep._publish(typing.cast(Any, sweep), choice, typing.cast(Any, SimpleNamespace(nccl_version=None)))


def publish_by(decider: str, cfg: Config, profile: Path) -> PublishedSet:
    """`decider` publishes on the node of `cfg`; the set it published."""
    if decider == "sweep":
        sweep_publish(cfg)
    elif decider == "one-GPU":
        pipe = SweepPipeline(cfg, env=site_env())
        pipe.nccl_version = lambda python=None: None  # type: ignore[method-assign]  # no worker probe: seconds
        pipe.run()
    elif decider == "apply":
        apply_profile(cfg, profile, demo=str(SNAPSHOT))
    else:
        node = actions.read_node(cfg, str(SNAPSHOT))
        actions.republish_safe(cfg, node, NcclInfo(), "topology changed", dt.datetime.now(dt.timezone.utc))
    got = read_set(Path(cfg.state_dir))
    assert got is not None
    return got


def test_the_rule_a_config_pin_then_the_sites_file_then_nccltunes_own() -> None:
    site = {TOPO: ("/etc/site/topo.xml", "/etc/nccl.conf")}
    config = {TOPO: "/etc/mine/topo.xml"}
    assert topology_pin(config, (), site) == TopologyPin("/etc/mine/topo.xml", "config")
    assert topology_pin({}, (), site) == TopologyPin("/etc/site/topo.xml", "conf file /etc/nccl.conf")
    assert topology_pin(config, [TOPO], site) is None  # sweep.unpin frees either
    assert topology_pin({"NCCL_ALGO": "Ring"}, (), {}) is None
    assert topology_env(TopologyPin("/etc/mine/topo.xml", "config")) == {TOPO: "/etc/mine/topo.xml"}
    assert topology_env(TopologyPin("/etc/site/topo.xml", "conf file /etc/nccl.conf")) == {}
    assert topology_env(None) == {TOPO: OWN_TOPOLOGY}
    assert topology_env(None, own=False) == {}


@pytest.mark.parametrize(("config", "site", "unpin"), [
    ({}, {}, []), ({TOPO: "/etc/mine/topo.xml"}, {}, []), ({}, {TOPO: ("/etc/site/topo.xml", "/etc/nccl.conf")}, []),
    ({TOPO: "/etc/mine/topo.xml"}, {TOPO: ("/etc/site/topo.xml", "/etc/nccl.conf")}, []),
    ({TOPO: "/etc/mine/topo.xml"}, {TOPO: ("/etc/site/topo.xml", "/etc/nccl.conf")}, [TOPO]),
])
def test_the_sweeps_plan_finds_the_pin_the_rule_finds(config: dict[str, str], site: dict[str, tuple[str, str]],
                                                      unpin: list[str]) -> None:
    from nccltune.topology.model import from_snapshot
    from nccltune.topology.paths import compute_paths
    from nccltune.topology.snapshot import load_snapshot

    topo = from_snapshot(load_snapshot(SNAPSHOT))
    # The job's own NCCL_TOPO_FILE is never a pin (an earlier publish's, say).
    plan = build_plan(topo, compute_paths(topo), env={TOPO: "/var/lib/nccltune/generations/3/ncclTopology.xml"},
                      config_pins=config, unpin=unpin, variables={}, exclude=[], policy={}, sizes=[1024],
                      backend="nccl", nranks=2, site_pins=site)
    pinned = plan.pinned.get(TOPO)
    assert (TopologyPin(pinned.value, pinned.source) if pinned else None) == topology_pin(config, unpin, site)
    # The trials: nccltune's own only where nothing pins one; a config pin reaches every trial.
    assert (TOPO in carried(plan)) == (pinned is None)
    fixed = fixed_part({TOPO: "/var/lib/nccltune/generations/3/ncclTopology.xml"}, config, unpin)
    assert fixed.get(TOPO) == (pinned.value if pinned is not None and pinned.source == "config" else None)


@pytest.mark.parametrize("decider", DECIDERS)
def test_a_config_pin_is_the_published_topology_file_under_every_decider(decider: str, profile_path: Path,
                                                                         tmp_path: Path) -> None:
    mine = tmp_path / "site-topology.xml"
    mine.write_text("<system version=\"1\"/>\n")
    cfg = node_cfg(tmp_path, mine, topology={"snapshot": str(H200X1)} if decider == "one-GPU" else {})
    got = publish_by(decider, cfg, profile_path)
    assert got.env[TOPO] == str(mine)
    assert not (got.directory / TOPOLOGY_NAME).exists()  # no XML of nccltune's in the pin's place
    assert not cfg.topology_file.exists()  # nor its stable copy
    assert mine.read_text() == "<system version=\"1\"/>\n"


@pytest.mark.parametrize("decider", DECIDERS)
def test_without_a_pin_the_published_topology_file_is_nccltunes_own(decider: str, profile_path: Path,
                                                                    tmp_path: Path) -> None:
    cfg = node_cfg(tmp_path, None, topology={"snapshot": str(H200X1)} if decider == "one-GPU" else {})
    got = publish_by(decider, cfg, profile_path)
    own = got.directory / TOPOLOGY_NAME
    assert got.env[TOPO] == str(own)
    assert cfg.topology_file.read_bytes() == own.read_bytes()  # the stable copy beside it


@pytest.mark.parametrize("decider", DECIDERS)
def test_a_topology_file_the_sites_conf_file_names_is_left_to_nccl(decider: str, profile_path: Path,
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "site-nccl.conf"
    conf.write_text("NCCL_TOPO_FILE=/etc/site/topo.xml\n")
    monkeypatch.setenv("NCCL_CONF_FILE", str(conf))
    monkeypatch.delenv(TOPO, raising=False)
    cfg = node_cfg(tmp_path, None, topology={"snapshot": str(H200X1)} if decider == "one-GPU" else {})
    got = publish_by(decider, cfg, profile_path)
    assert TOPO not in got.env and TOPO not in got.single_node_env
    assert not (got.directory / TOPOLOGY_NAME).exists() and not cfg.topology_file.exists()
