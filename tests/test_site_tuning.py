"""Other vendors' tuning is respected: a tuner the network plugin offers (the aws-ofi-nccl case), one
NCCL_TUNER_PLUGIN names, and values in NCCL's conf files (the Azure case: a curated NCCL_TOPO_FILE
in /etc/nccl.conf) are kept, and the plan, doctor and env say so.

The network plugins are real shared libraries built here with cc; their tuner symbols are read
from the ELF file and checked against what dlopen+dlsym (NCCL's own way) finds in them.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from demo_state import SHORT_CONFIG, SNAPSHOT, SWEEP_S, clean_env

from nccltune.checks.doctor import diagnose
from nccltune.config import Config, TunerConfig
from nccltune.nccl.site import (
    ConfSetting,
    SiteTuner,
    conf_settings,
    find_library,
    net_plugin_library,
    read_conf,
    site_tuner,
    tuner_symbols,
)
from nccltune.nccl.sitetuner import existing_tuner
from nccltune.node import load_node
from nccltune.pipeline import SweepPipeline
from nccltune.pipeline.choice import split_scopes
from nccltune.publish import OWN_TOPOLOGY
from nccltune.topology.paths import compute_paths
from nccltune.trials.trialenv import carried

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler to build the fake network plugins")
# No NCCL conf file of whoever runs the tests, no loader path: only what a test gives.
BARE = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "NCCL_CONF_FILE": "/nonexistent/nccl.conf"}
CURATED_TOPOLOGY = "/opt/microsoft/ndv5-topo.xml"

NET_PLUGIN_WITH_TUNER = """
struct fake { int version; };
const struct fake ncclNetPlugin_v8 = {8};
const struct fake ncclTunerPlugin_v3 = {3};
const struct fake ncclTunerPlugin_v4 = {4};
"""
# Refers to a tuner symbol without defining it: NCCL's dlsym would not find one.
NET_PLUGIN_WITHOUT_TUNER = """
struct fake { int version; };
extern const struct fake ncclTunerPlugin_v4 __attribute__((weak));
const struct fake ncclNetPlugin_v8 = {8};
int uses(void) { return &ncclTunerPlugin_v4 != 0; }
"""


def build_library(directory: Path, name: str, source: str) -> Path:
    assert CC is not None
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / f"{name}.c"
    src.write_text(source)
    out = directory / name
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True, timeout=120)
    return out


def dlsym_finds(path: Path, symbol: str) -> bool:
    """NCCL's way: dlopen the library and ask for the symbol."""
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    try:
        getattr(lib, symbol)
    except AttributeError:
        return False
    return True


# A tuner without a network plugin: NCCL closes a net library without ncclNetPlugin_v*, so never
# asks it for a tuner.
TUNER_ONLY = """
struct fake { int version; };
const struct fake ncclTunerPlugin_v4 = {4};
"""


@pytest.fixture
def net_plugins(tmp_path: Path) -> dict[str, Path]:
    if CC is None:
        pytest.skip("no C compiler")
    return {
        "default": build_library(tmp_path / "aws", "libnccl-net.so", NET_PLUGIN_WITH_TUNER),
        "named": build_library(tmp_path / "named", "libnccl-net-ofi.so", NET_PLUGIN_WITH_TUNER),
        "plain": build_library(tmp_path / "plain", "libnccl-net.so", NET_PLUGIN_WITHOUT_TUNER),
        "tuner-only": build_library(tmp_path / "tuner-only", "libnccl-net.so", TUNER_ONLY),
    }


# -- the network plugin's tuner ----------------------------------------------------------------


@needs_cc
def test_the_tuner_symbols_read_from_the_elf_file_are_the_ones_dlsym_finds(net_plugins: dict[str, Path]) -> None:
    assert tuner_symbols(net_plugins["default"]) == ("ncclTunerPlugin_v4", "ncclTunerPlugin_v3")
    for version in (2, 3, 4, 5, 6):
        symbol = f"ncclTunerPlugin_v{version}"
        assert (symbol in tuner_symbols(net_plugins["default"])) == dlsym_finds(net_plugins["default"], symbol)
        assert dlsym_finds(net_plugins["plain"], symbol) is False
    # An undefined reference is not a tuner.
    assert tuner_symbols(net_plugins["plain"]) == ()


def test_what_is_not_an_elf_library_has_no_tuner(tmp_path: Path) -> None:
    (tmp_path / "text.so").write_text("not ELF\n")
    (tmp_path / "short.so").write_bytes(b"\x7fELF\x02\x01")
    assert tuner_symbols(tmp_path / "text.so") == ()
    assert tuner_symbols(tmp_path / "short.so") == ()
    assert tuner_symbols(tmp_path / "missing.so") == ()


@needs_cc
def test_the_network_plugin_is_found_as_nccl_and_the_loader_find_it(net_plugins: dict[str, Path]) -> None:
    aws, named = net_plugins["default"].parent, net_plugins["named"].parent
    no_cache: dict[str, Path] = {}
    # Unset: libnccl-net.so on the loader's path.
    assert net_plugin_library({"LD_LIBRARY_PATH": f"/nonexistent:{aws}"}, {}, no_cache) == net_plugins["default"]
    # A name X is also tried as libnccl-net-X.so; a path as given.
    assert net_plugin_library({"LD_LIBRARY_PATH": str(named), "NCCL_NET_PLUGIN": "ofi"}, {}, no_cache) \
        == net_plugins["named"]
    assert net_plugin_library({"NCCL_NET_PLUGIN": str(net_plugins["default"])}, {}, no_cache) == net_plugins["default"]
    # none turns the plugin off; from a conf file as from the environment (which wins).
    assert net_plugin_library({"LD_LIBRARY_PATH": str(aws), "NCCL_NET_PLUGIN": "none"}, {}, no_cache) is None
    conf = {"NCCL_NET_PLUGIN": ConfSetting("none", Path("/etc/nccl.conf"))}
    assert net_plugin_library({"LD_LIBRARY_PATH": str(aws)}, conf, no_cache) is None
    assert find_library("libnccl-net.so", {}, {"libnccl-net.so": net_plugins["plain"]}) == net_plugins["plain"]


@needs_cc
def test_a_network_plugins_tuner_is_the_sites_tuner(net_plugins: dict[str, Path]) -> None:
    env = {**BARE, "LD_LIBRARY_PATH": str(net_plugins["default"].parent)}
    got = site_tuner(env, {}, cache={})
    assert got == SiteTuner(str(net_plugins["default"]), got.source if got else "",
                            ("ncclTunerPlugin_v4", "ncclTunerPlugin_v3"))
    assert got is not None and "network plugin" in got.source and not got.named
    # NCCL_TUNER_PLUGIN decides first (none included: a site decision too).
    assert site_tuner({**env, "NCCL_TUNER_PLUGIN": "none"}, {}, cache={}) == SiteTuner("none", "the environment")
    # A network plugin without a tuner symbol offers none.
    assert site_tuner({**BARE, "LD_LIBRARY_PATH": str(net_plugins["plain"].parent)}, {}, cache={}) is None
    # Nor does a library NCCL would not keep as a network plugin; a later one in the list is taken.
    only = net_plugins["tuner-only"]
    assert site_tuner({**BARE, "NCCL_NET_PLUGIN": str(only)}, {}, cache={}) is None
    listed = site_tuner({**BARE, "NCCL_NET_PLUGIN": f"{only},{net_plugins['named']}"}, {}, cache={})
    assert listed is not None and listed.value == str(net_plugins["named"])


@needs_cc
@pytest.mark.parametrize(("mode", "active"), [("auto", False), ("nccltune", True)])
def test_the_plan_keeps_a_network_plugins_tuner_unless_config_says_so(net_plugins: dict[str, Path], mode: str,
                                                                      active: bool) -> None:
    cfg = Config(tuner=TunerConfig(mode))  # type: ignore[arg-type]
    env = {**BARE, "LD_LIBRARY_PATH": str(net_plugins["default"].parent)}
    pipe = SweepPipeline(cfg, env=env, node=load_node(cfg, str(SNAPSHOT)))
    plan = pipe.plan()[0]
    assert plan.per_size is not None and plan.per_size.active is active
    notes = " ".join(plan.notes)
    lib = str(net_plugins["default"])
    if mode == "auto":
        assert f"the tuner in {lib} (ncclTunerPlugin_v4, ncclTunerPlugin_v3; the network plugin" in notes
        assert "is already set and kept" in notes
    else:
        assert f"WARNING: the tuner in {lib}" in notes and "REPLACED" in notes


@needs_cc
def test_doctor_names_a_network_plugins_tuner(net_plugins: dict[str, Path], tmp_path: Path) -> None:
    cfg = Config()
    topo = load_node(cfg, str(SNAPSHOT)).topo
    env = {**BARE, "LD_LIBRARY_PATH": str(net_plugins["default"].parent)}
    assert existing_tuner(env, []) is not None
    findings = diagnose(topo, compute_paths(topo), env=env, publish_dir=tmp_path / "none", conf_files=[])
    kept = [f for f in findings if f.code == "tuner-plugin-kept"]
    assert len(kept) == 1
    assert f"NCCL loads the tuner in {net_plugins['default']}" in kept[0].message


# -- values in NCCL's conf files -------------------------------------------------------------


def test_conf_settings_follow_nccls_order_and_leave_nccltunes_block_out(tmp_path: Path) -> None:
    user, system = tmp_path / "user.conf", tmp_path / "nccl.conf"
    user.write_text("NCCL_IB_HCA=mlx5_0\n# NCCL_ALGO=Tree\n")
    system.write_text(f"NCCL_TOPO_FILE={CURATED_TOPOLOGY}\nNCCL_TOPO_FILE=/second/wins/not.xml\n"
                      "NCCL_IB_HCA=mlx5_9\n"
                      "# BEGIN nccltune managed block (do not edit)\nNCCL_MIN_NCHANNELS=32\n"
                      "# END nccltune managed block\n")
    got = conf_settings({"NCCL_SOCKET_IFNAME": "eth0"}, [user, system])
    assert got == {"NCCL_IB_HCA": ConfSetting("mlx5_0", user),
                   "NCCL_TOPO_FILE": ConfSetting(CURATED_TOPOLOGY, system)}
    # The environment wins over every file, as in NCCL.
    assert "NCCL_TOPO_FILE" not in conf_settings({"NCCL_TOPO_FILE": "/mine.xml"}, [user, system])
    assert read_conf(tmp_path / "missing.conf") == {}


def site_conf(tmp_path: Path) -> Path:
    conf = tmp_path / "site-nccl.conf"
    conf.write_text(f"NCCL_TOPO_FILE={CURATED_TOPOLOGY}\nNCCL_IB_PCI_RELAXED_ORDERING=1\n")
    return conf


def test_a_conf_files_values_are_pins_and_its_topology_file_is_never_published_over(tmp_path: Path) -> None:
    conf = site_conf(tmp_path)
    cfg = Config()
    pipe = SweepPipeline(cfg, env={**BARE, "NCCL_CONF_FILE": str(conf)}, node=load_node(cfg, str(SNAPSHOT)))
    plan = pipe.plan()[0]
    assert plan.pinned["NCCL_TOPO_FILE"].value == CURATED_TOPOLOGY
    assert plan.pinned["NCCL_TOPO_FILE"].source == f"conf file {conf}"
    assert plan.pinned["NCCL_IB_PCI_RELAXED_ORDERING"].value == "1"
    # The trials carry no topology file of nccltune's, and none is published over the site's.
    assert "NCCL_TOPO_FILE" not in carried(plan)
    every_job, _single = split_scopes({"NCCL_TOPO_FILE": "/run/trial.xml", "NCCL_ALGO": "Ring"}, plan)
    assert "NCCL_TOPO_FILE" not in every_job and "NCCL_IB_PCI_RELAXED_ORDERING" not in every_job
    # Without the conf file nccltune's own topology file is published (the marker the publisher resolves).
    plain = SweepPipeline(cfg, env=BARE, node=load_node(cfg, str(SNAPSHOT))).plan()[0]
    assert carried(plain)["NCCL_TOPO_FILE"] == OWN_TOPOLOGY
    own, _ = split_scopes(carried(plain), plain)
    assert own["NCCL_TOPO_FILE"] == OWN_TOPOLOGY


def test_doctor_says_what_the_sites_conf_files_set(tmp_path: Path) -> None:
    conf = site_conf(tmp_path)
    topo = load_node(Config(), str(SNAPSHOT)).topo
    findings = diagnose(topo, compute_paths(topo), env=BARE, publish_dir=tmp_path / "none", conf_files=[conf])
    site = [f for f in findings if f.code == "site-settings"]
    assert len(site) == 1 and site[0].severity == "info"
    assert f"NCCL_TOPO_FILE ({conf})" in site[0].message and "NCCL_IB_PCI_RELAXED_ORDERING" in site[0].message


def nccltune(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True,
                          env=env, timeout=SWEEP_S, cwd=cwd)


def test_a_sweep_under_a_curated_topology_file_keeps_it_and_env_says_so(tmp_path: Path) -> None:
    """The Azure case end to end: a demo sweep with NCCL_CONF_FILE naming a conf file with a
    curated NCCL_TOPO_FILE publishes no NCCL_TOPO_FILE of its own (which would beat the file)."""
    conf = site_conf(tmp_path)
    config = tmp_path / "config.yaml"
    # The shortest sweep still has the candidate that would publish nccltune's own topology file.
    config.write_text(yaml.safe_dump(SHORT_CONFIG, sort_keys=False))
    env = clean_env(NCCL_CONF_FILE=str(conf))
    proc = nccltune("sweep", "--demo", str(SNAPSHOT), "--json", "--config", str(config),
                    "--state-dir", str(tmp_path / "state"), env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "NCCL_TOPO_FILE" not in doc["published_env"]
    assert not (tmp_path / "state" / "current" / "ncclTopology.xml").exists()
    printed = nccltune("env", "--state-dir", str(tmp_path / "state"), env=env)
    assert printed.returncode == 0, printed.stderr
    assert f"# kept from the site: NCCL_TOPO_FILE ({conf})\n" in printed.stdout
    assert "NCCL_TOPO_FILE=" not in printed.stdout
    plan = nccltune("sweep", "--demo", str(SNAPSHOT), "--plan", "--config", str(config),
                    "--state-dir", str(tmp_path / "state"), env=env, cwd=tmp_path)
    assert f"NCCL_TOPO_FILE={CURATED_TOPOLOGY} (from the conf file {conf})" in plan.stdout
    assert "nccltune's topology file for this node" not in plan.stdout

