"""The sweep plan on every bundled topology: what is measured, what is pruned, and why.

The P2P level expectations are worked out by hand from each snapshot's raw path matrix with the
signature rule of paths.cc (two levels are equivalent iff no NVML-P2P-OK GPU pair has
a raw type strictly above the lower level and at or below the higher one), and written out per
topology, so that a change in either the path code or the pruning code shows up here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest

from nccltune.sweep.plan import (
    P2P_OFF_REASON,
    Plan,
    build_plan,
    default_p2p_level,
    prune_channels,
)
from nccltune.sweep.space import CATALOGUE, LEVELS, PORTABLE_LEVELS, level_of, validate_value
from nccltune.topology.model import Topology
from nccltune.topology.paths import RANK, PathMatrix, compute_paths
from nccltune.topology.source import bundled_topologies_dir, load_topology

SNAPSHOTS = sorted(p.name for p in bundled_topologies_dir().glob("*.json"))
NVSWITCH = ("dgx-a100-8gpu.json", "h200x2-nvswitch-vm.json", "hgx-h100-8gpu.json")
NVLINK = (*NVSWITCH, "pcie-2gpu-nvlink-bridge.json")
PCIE_ONLY = ("pcie-4gpu-2socket.json",)
NET_KNOBS = [n for n, t in CATALOGUE.items() if t.scope == "net"]
DEFAULT_REASON = "same GPU pairs use P2P as with NCCL's default on this topology"


def _load(name: str) -> tuple[Topology, PathMatrix]:
    topo = load_topology(name)
    return topo, compute_paths(topo)


def _plan(name: str, *, topo: Topology | None = None, env: Mapping[str, str] | None = None,
          config_pins: Mapping[str, str] | None = None, unpin: Sequence[str] = (),
          variables: Mapping[str, Sequence[str]] | None = None, exclude: Sequence[str] = (),
          backend: str = "nccl") -> Plan:
    loaded, paths = _load(name)
    topo = topo or loaded
    return build_plan(topo, paths, env=env or {}, config_pins=config_pins or {}, unpin=list(unpin),
                      variables=variables or {}, exclude=list(exclude),
                      policy={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
                      sizes=[4096, 1 << 20, 64 << 20], backend=backend, nranks=len(topo.gpus))


def _pruned(plan: Plan, name: str) -> dict[str, str]:
    return {p.value: p.reason for p in plan.pruned if p.name == name}


def test_the_bundled_snapshots_are_the_ones_these_expectations_cover() -> None:
    assert set(SNAPSHOTS) == {*NVLINK, *PCIE_ONLY}


# -- NCCL_P2P_LEVEL / NCCL_P2P_DISABLE: the signature rule ------------------------------------------


@pytest.mark.parametrize("name", NVLINK)
def test_nvlink_nodes_only_loc_differs_and_it_is_pruned_as_p2p_off(name: str) -> None:
    topo, paths = _load(name)
    # Every GPU pair is NVL (S = {NVL}); nothing refused by NVML.
    assert {p.type for (a, b), p in paths.gpu_gpu.items() if a < b} == {"NVL"}
    assert not topo.p2p_refused
    plan = _plan(name)
    # Every level from NVL up keeps every pair on P2P, exactly as the default (PXB, or SYS on
    # the AMD 2-GPU box) does: one class. LOC alone turns P2P off, over NVLink: pruned as harmful.
    assert "NCCL_P2P_LEVEL" not in plan.variables
    assert "NCCL_P2P_DISABLE" not in plan.variables
    levels = _pruned(plan, "NCCL_P2P_LEVEL")
    assert set(levels) == set(PORTABLE_LEVELS)
    assert levels["LOC"] == P2P_OFF_REASON
    for level in ("NVL", "NVB", "PIX", "PXB", "PHB", "SYS"):
        assert levels[level] == DEFAULT_REASON, level
    assert _pruned(plan, "NCCL_P2P_DISABLE") == {"1": P2P_OFF_REASON}
    assert "12x slower" in P2P_OFF_REASON and "NVLink" in P2P_OFF_REASON


def test_pcie_two_socket_box_levels_follow_its_path_matrix() -> None:
    name = "pcie-4gpu-2socket.json"
    topo, paths = _load(name)
    types = {(a, b): p.type for (a, b), p in paths.gpu_gpu.items() if a < b}
    # GPU0/1 share one PCIe switch and GPU2/3 another (PIX); every other pair crosses the
    # sockets (SYS). No pair goes through a CPU root complex without crossing sockets, so there
    # is no PHB and no PXB pair: S = {PIX, SYS}.
    assert types == {(0, 1): "PIX", (2, 3): "PIX", (0, 2): "SYS", (0, 3): "SYS", (1, 2): "SYS", (1, 3): "SYS"}
    assert default_p2p_level(topo) == "PXB"  # Intel CPUs: PXB whatever the GPU count
    plan = _plan(name)
    # Classes: {LOC, NVL, NVB} (no pair uses P2P; nothing is lost over NVLink, so it is a real
    # candidate: SHM everywhere), {PIX, PXB, PHB} (the two PIX pairs; the default, PXB, is in it:
    # PHB adds nothing because no pair is PHB), {SYS} (all six pairs). One value per class, the
    # lowest name first; the default's class is not measured again.
    assert plan.variables["NCCL_P2P_LEVEL"] == ["LOC", "SYS"]
    levels = _pruned(plan, "NCCL_P2P_LEVEL")
    assert levels == {
        "NVL": "same effect as NCCL_P2P_LEVEL=LOC on this topology",
        "NVB": "same effect as NCCL_P2P_LEVEL=LOC on this topology",
        "PIX": DEFAULT_REASON,
        "PXB": DEFAULT_REASON,
        "PHB": DEFAULT_REASON,
    }
    # P2P_DISABLE=1 is level LOC, already measured.
    assert _pruned(plan, "NCCL_P2P_DISABLE") == {"1": "same effect as NCCL_P2P_LEVEL=LOC on this topology"}
    assert "NCCL_P2P_DISABLE" not in plan.variables


def test_pcie_two_socket_box_with_nvml_refusing_cross_socket_p2p() -> None:
    # The other common NVML answer for cross-socket pairs (topologies/README.md): refused pairs
    # never use P2P, at any level, so SYS no longer differs from the default.
    topo, _paths = _load("pcie-4gpu-2socket.json")
    refused = {(0, 2), (0, 3), (1, 2), (1, 3)}
    plan = _plan("pcie-4gpu-2socket.json", topo=dataclasses.replace(topo, p2p_refused=refused))
    assert plan.variables["NCCL_P2P_LEVEL"] == ["LOC"]
    assert _pruned(plan, "NCCL_P2P_LEVEL")["SYS"] == DEFAULT_REASON


def test_amd_two_gpu_box_defaults_to_sys() -> None:
    topo, _ = _load("pcie-2gpu-nvlink-bridge.json")
    assert default_p2p_level(topo) == "SYS"
    assert "default P2P level here is SYS" in " ".join(_plan("pcie-2gpu-nvlink-bridge.json").notes)


def _signature(level: str, paths: PathMatrix, refused: set[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    return frozenset((a, b) for (a, b), p in paths.gpu_gpu.items()
                     if a < b and (a, b) not in refused and RANK[p.type] <= RANK[level])


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_kept_levels_have_distinct_signatures_and_pruned_ones_repeat_one(name: str) -> None:
    # Every spelling NCCL accepts, legacy integers included: what is kept differs pairwise and
    # from the default; what is pruned for equivalence has the signature of something kept or
    # of the default.
    topo, paths = _load(name)
    values = [*LEVELS, "0", "1", "2", "3", "4", "5", "9"]
    plan = _plan(name, variables={"NCCL_P2P_LEVEL": values})
    default_sig = _signature(default_p2p_level(topo), paths, topo.p2p_refused)

    def sig(v: str) -> frozenset[tuple[int, int]]:
        level = level_of(v)
        assert level is not None
        return _signature(level, paths, topo.p2p_refused)

    kept = plan.variables.get("NCCL_P2P_LEVEL", [])
    sigs = [sig(v) for v in kept]
    assert len(set(sigs)) == len(sigs)
    assert default_sig not in sigs
    for value, reason in _pruned(plan, "NCCL_P2P_LEVEL").items():
        if reason == P2P_OFF_REASON:
            assert sig(value) != default_sig
        elif reason == DEFAULT_REASON:
            assert sig(value) == default_sig, value
        else:
            other = reason.removeprefix("same effect as NCCL_P2P_LEVEL=").removesuffix(" on this topology")
            assert other in kept and sig(value) == sig(other), (value, reason)
    assert set(kept) | set(_pruned(plan, "NCCL_P2P_LEVEL")) == set(values)


@pytest.mark.parametrize(("values", "expected"), [
    # Equivalences on every topology.
    (["SYS", "4", "5", "9"], {"4": "SYS", "5": "SYS", "9": "SYS"}),
    (["LOC", "0"], {"0": "LOC"}),
])
def test_legacy_integers_are_equivalent_to_their_names(values: list[str], expected: dict[str, str]) -> None:
    plan = _plan("pcie-4gpu-2socket.json", variables={"NCCL_P2P_LEVEL": values})
    pruned = _pruned(plan, "NCCL_P2P_LEVEL")
    for value, same_as in expected.items():
        assert pruned[value] == f"same effect as NCCL_P2P_LEVEL={same_as} on this topology"
    assert plan.variables["NCCL_P2P_LEVEL"] == [values[0]]


def test_p2c_pxn_and_legacy_two_equal_the_default_pxb() -> None:
    plan = _plan("pcie-4gpu-2socket.json", variables={"NCCL_P2P_LEVEL": ["P2C", "PXN", "2", "1", "3", "C2C"]})
    pruned = _pruned(plan, "NCCL_P2P_LEVEL")
    for value in ("P2C", "PXN", "2", "1", "3"):
        assert pruned[value] == DEFAULT_REASON, value
    # C2C sits between NVB and PIX: no C2C pair here, so it is "P2P nowhere", a class of its own
    # on this box (LOC was not offered).
    assert plan.variables["NCCL_P2P_LEVEL"] == ["C2C"]


def test_p2p_disable_zero_is_the_default() -> None:
    # Without P2P_LEVEL in the sweep, P2P_DISABLE=1 (level LOC) is the one "P2P nowhere" candidate.
    plan = _plan("pcie-4gpu-2socket.json", variables={"NCCL_P2P_DISABLE": ["0", "1"]},
                 exclude=["NCCL_P2P_LEVEL"])
    assert _pruned(plan, "NCCL_P2P_DISABLE") == {"0": DEFAULT_REASON}
    assert plan.variables["NCCL_P2P_DISABLE"] == ["1"]


# -- the other knobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_network_knobs_are_pruned_on_one_node(name: str) -> None:
    # Even when the config asks for them explicitly.
    plan = _plan(name, variables={"NCCL_NET_GDR_LEVEL": ["PIX", "SYS"], "NCCL_CROSS_NIC": ["0"]})
    for knob in NET_KNOBS:
        assert knob not in plan.variables
        reason = _pruned(plan, knob)["*"]
        assert "single-node" in reason and "NIC" in reason
    assert {"NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_PXN_DISABLE", "NCCL_CROSS_NIC",
            "NCCL_IB_QPS_PER_CONNECTION"} <= set(NET_KNOBS)


@pytest.mark.parametrize(("name", "reason"), [
    ("pcie-4gpu-2socket.json", "no NVSwitch: NVLS cannot run here"),
    ("pcie-2gpu-nvlink-bridge.json", "no NVSwitch: NVLS cannot run here"),
    ("dgx-a100-8gpu.json", "NVLS needs sm90 or newer"),
    ("h200x2-nvswitch-vm.json", None),
    ("hgx-h100-8gpu.json", None),
])
def test_nvls_needs_an_nvswitch_and_sm90(name: str, reason: str | None) -> None:
    plan = _plan(name)
    if reason is None:
        assert plan.variables["NCCL_NVLS_ENABLE"] == ["0"]
    else:
        assert "NCCL_NVLS_ENABLE" not in plan.variables
        assert _pruned(plan, "NCCL_NVLS_ENABLE") == {"0": reason}


@pytest.mark.parametrize("name", NVLINK)
def test_ll128_is_offered_where_nccl_would_enable_it(name: str) -> None:
    assert _plan(name).variables["NCCL_PROTO"] == ["Simple", "LL", "LL128"]


def test_ll128_is_never_forced_on_a_pcie_only_node() -> None:
    forcing = ["LL128", "LL,LL128", "allreduce:LL128", "Simple;broadcast:LL128"]
    safe = ["^LL128", "allreduce:^LL128", "Simple", "LL"]
    plan = _plan("pcie-4gpu-2socket.json", variables={"NCCL_PROTO": forcing + safe})
    pruned = _pruned(plan, "NCCL_PROTO")
    assert set(pruned) == set(forcing)
    for value in forcing:
        assert "LL128" in pruned[value] and "data corruption" in pruned[value]
    # Leaving LL128 out (`^LL128`) is what NVIDIA's own workaround does: always safe.
    assert plan.variables["NCCL_PROTO"] == safe
    assert _pruned(_plan("pcie-4gpu-2socket.json"), "NCCL_PROTO") == {"LL128": pruned["LL128"]}


@pytest.mark.parametrize(("name", "value", "reason"), [
    ("pcie-4gpu-2socket.json", "Ring", None),
    ("pcie-4gpu-2socket.json", "Tree", None),
    ("pcie-4gpu-2socket.json", "^Tree", None),
    ("pcie-4gpu-2socket.json", "NVLS", "NVLS needs an NVSwitch and sm90"),
    ("dgx-a100-8gpu.json", "NVLS", "NVLS needs an NVSwitch and sm90"),
    ("hgx-h100-8gpu.json", "NVLS", None),
    ("hgx-h100-8gpu.json", "^NVLS", None),
    ("pcie-4gpu-2socket.json", "^NVLS", "excludes only algorithms that cannot run here"),
    ("hgx-h100-8gpu.json", "NVLSTree", "NVLSTree runs only across nodes"),
    ("hgx-h100-8gpu.json", "CollNetDirect", "CollNet needs"),
    ("hgx-h100-8gpu.json", "PAT", "PAT never applies to all-reduce"),
    ("pcie-4gpu-2socket.json", "^Ring,Tree", "leaves no algorithm"),
    ("pcie-4gpu-2socket.json", "allgather:ring", "does not restrict all-reduce"),
    ("pcie-4gpu-2socket.json", "ring;allreduce:^tree", None),
    ("pcie-4gpu-2socket.json", "tree;allreduce:pat", "PAT never applies"),
])
def test_algorithms_that_cannot_run_an_all_reduce_here_are_pruned(name: str, value: str,
                                                                    reason: str | None) -> None:
    assert validate_value("NCCL_ALGO", value) is None
    plan = _plan(name, variables={"NCCL_ALGO": [value]})
    if reason is None:
        assert plan.variables["NCCL_ALGO"] == [value]
    else:
        assert "NCCL_ALGO" not in plan.variables
        assert reason in _pruned(plan, "NCCL_ALGO")[value]


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_shm_disable_only_where_some_pair_falls_back_to_shm(name: str) -> None:
    plan = _plan(name)
    if name in PCIE_ONLY:
        # At the default level (PXB) the four cross-socket SYS pairs do not use P2P and go
        # through SHM, so disabling SHM changes their transport.
        assert plan.variables["NCCL_SHM_DISABLE"] == ["1"]
    else:
        assert "NCCL_SHM_DISABLE" not in plan.variables
        assert "every GPU pair already uses P2P" in _pruned(plan, "NCCL_SHM_DISABLE")["1"]


def test_values_equal_to_nccls_default_are_pruned() -> None:
    plan = _plan("hgx-h100-8gpu.json", variables={
        "NCCL_BUFFSIZE": ["4194304", "8388608"],
        "NCCL_NTHREADS": ["512", "256"],
        "NCCL_SHM_DISABLE": ["0"],
        "NCCL_NVLS_ENABLE": ["2", "0"],
        "NCCL_CROSS_NIC": ["2"],
    })
    assert _pruned(plan, "NCCL_BUFFSIZE") == {"4194304": "equal to NCCL's default (4194304)"}
    assert _pruned(plan, "NCCL_NTHREADS") == {"512": "equal to NCCL's default (512)"}
    assert _pruned(plan, "NCCL_SHM_DISABLE") == {"0": "equal to NCCL's default (0)"}
    assert _pruned(plan, "NCCL_NVLS_ENABLE") == {"2": "equal to NCCL's default (2)"}
    assert plan.variables["NCCL_BUFFSIZE"] == ["8388608"]
    assert plan.variables["NCCL_NTHREADS"] == ["256"]
    assert plan.variables["NCCL_NVLS_ENABLE"] == ["0"]
    assert "NCCL_SHM_DISABLE" not in plan.variables


def test_default_sweep_values_never_include_the_default() -> None:
    for tunable in CATALOGUE.values():
        assert tunable.default not in tunable.sweep, tunable.name
        for value in tunable.sweep:
            assert tunable.validate(value) is None, (tunable.name, value)
        if tunable.default is not None:
            assert tunable.validate(tunable.default) is None, tunable.name


# -- pinned, unpinned, excluded ---------------------------------------------------------------------


def test_environment_nccl_variables_are_pinned_and_listed() -> None:
    env = {
        "NCCL_ALGO": "Ring",
        "NCCL_P2P_LEVEL": "nvl",
        "NCCL_SOMETHING_NEW": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_DEBUG": "INFO",  # nccltune sets the logging variables itself in trials
        "NCCL_TOPO_FILE": "/old/ncclTopology.xml",
        "PATH": "/usr/bin",
    }
    plan = _plan("hgx-h100-8gpu.json", env=env)
    assert set(plan.pinned) == {"NCCL_ALGO", "NCCL_P2P_LEVEL", "NCCL_SOMETHING_NEW",
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert all(p.source == "environment" for p in plan.pinned.values())
    assert plan.pinned["NCCL_ALGO"].value == "Ring" and plan.pinned["NCCL_ALGO"].warning is None
    # An invalid value is passed on (it is the environment's), with NCCL's behaviour spelled out.
    warning = plan.pinned["NCCL_P2P_LEVEL"].warning or ""
    assert "case-sensitive" in warning and "silently ignores" in warning
    assert "not a setting nccltune knows" in (plan.pinned["NCCL_SOMETHING_NEW"].warning or "")
    # Pinned variables are neither swept nor listed as pruned.
    assert "NCCL_ALGO" not in plan.variables and "NCCL_P2P_LEVEL" not in plan.variables
    assert not _pruned(plan, "NCCL_ALGO") and not _pruned(plan, "NCCL_P2P_LEVEL")


def test_unpin_sweeps_an_environment_variable() -> None:
    plan = _plan("hgx-h100-8gpu.json", env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}, unpin=["NCCL_ALGO"])
    assert "NCCL_ALGO" not in plan.pinned
    assert plan.variables["NCCL_ALGO"] == ["Ring", "Tree"]
    assert plan.pinned["NCCL_PROTO"].value == "Simple"
    assert "NCCL_PROTO" not in plan.variables


def test_config_pins_are_pinned_and_win_over_the_environment() -> None:
    plan = _plan("hgx-h100-8gpu.json", env={"NCCL_PROTO": "LL"},
                 config_pins={"NCCL_PROTO": "^LL128", "NCCL_NVLS_ENABLE": "0"})
    assert plan.pinned["NCCL_PROTO"].value == "^LL128" and plan.pinned["NCCL_PROTO"].source == "config"
    assert plan.pinned["NCCL_NVLS_ENABLE"].source == "config"
    assert "NCCL_PROTO" not in plan.variables and "NCCL_NVLS_ENABLE" not in plan.variables


def test_unpin_also_releases_a_config_pin() -> None:
    # `--unpin NAME`: "sweep a variable although the environment or config sets it".
    plan = _plan("hgx-h100-8gpu.json", config_pins={"NCCL_PROTO": "^LL128"}, unpin=["NCCL_PROTO"])
    assert "NCCL_PROTO" not in plan.pinned
    assert plan.variables["NCCL_PROTO"] == ["Simple", "LL", "LL128"]


def test_excluded_variables_are_listed_as_pruned_and_not_measured() -> None:
    plan = _plan("hgx-h100-8gpu.json", exclude=["NCCL_ALGO", "NCCL_BUFFSIZE"])
    for name in ("NCCL_ALGO", "NCCL_BUFFSIZE"):
        assert name not in plan.variables
        assert _pruned(plan, name) == {"*": "excluded by config (sweep.exclude)"}


def test_policy_variables_are_never_swept_and_config_variables_replace_the_defaults() -> None:
    plan = _plan("hgx-h100-8gpu.json", variables={"NCCL_ALGO": ["Tree"],
                                                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": ["1"]})
    assert plan.variables["NCCL_ALGO"] == ["Tree"]
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in plan.variables
    assert plan.policy == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert plan.screening_count() == sum(len(v) for v in plan.variables.values())
    assert ("NCCL_ALGO", "Tree") in plan.candidates()


def test_a_gloo_plan_says_it_is_a_cpu_demo() -> None:
    plan = _plan("h200x2-nvswitch-vm.json", backend="gloo")
    assert plan.backend == "gloo"
    assert any(n.startswith("CPU demo") for n in plan.notes)
    assert not any(n.startswith("CPU demo") for n in _plan("h200x2-nvswitch-vm.json").notes)


# -- channels after the baseline --------------------------------------------------------------------


def _channel_plan() -> Plan:
    return _plan("hgx-h100-8gpu.json", variables={"NCCL_MIN_NCHANNELS": ["16", "24", "32"],
                                                   "NCCL_MAX_NCHANNELS": ["8", "16", "32"]})


def test_prune_channels_drops_values_that_cannot_change_the_count() -> None:
    plan = _channel_plan()
    before = len(plan.pruned)
    dropped = prune_channels(plan, 16)
    # MIN <= 16 and MAX >= 16 leave 16 channels as they are.
    assert plan.variables["NCCL_MIN_NCHANNELS"] == ["24", "32"]
    assert plan.variables["NCCL_MAX_NCHANNELS"] == ["8"]
    assert {(d.name, d.value) for d in dropped} == {
        ("NCCL_MIN_NCHANNELS", "16"), ("NCCL_MAX_NCHANNELS", "16"), ("NCCL_MAX_NCHANNELS", "32")}
    assert plan.pruned[before:] == dropped
    assert all("16 channels NCCL already uses" in d.reason for d in dropped)
    assert "at or below" in next(d.reason for d in dropped if d.name == "NCCL_MIN_NCHANNELS")
    assert "at or above" in next(d.reason for d in dropped if d.name == "NCCL_MAX_NCHANNELS")


def test_prune_channels_removes_a_variable_left_without_values() -> None:
    plan = _channel_plan()
    prune_channels(plan, 32)
    assert "NCCL_MIN_NCHANNELS" not in plan.variables
    assert plan.variables["NCCL_MAX_NCHANNELS"] == ["8", "16"]


@pytest.mark.parametrize("channels", [None, 0])
def test_prune_channels_without_a_channel_count_changes_nothing(channels: int | None) -> None:
    plan = _channel_plan()
    assert prune_channels(plan, channels) == []
    assert plan.variables["NCCL_MIN_NCHANNELS"] == ["16", "24", "32"]


def test_plan_notes_say_channels_are_pruned_later() -> None:
    assert any("Channel values" in n for n in _channel_plan().notes)


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("NCCL_P2P_LEVEL", "nvl", ["case-sensitive", "silently ignores", "'NVL'"]),
    ("NCCL_P2P_LEVEL", "Sys", ["case-sensitive", "'SYS'"]),
    ("NCCL_NET_GDR_LEVEL", "pxb", ["case-sensitive", "'PXB'"]),
    ("NCCL_P2P_LEVEL", "NET", ["not a level", "silently ignores"]),
    ("NCCL_P2P_LEVEL", "-1", ["not a level"]),
    ("NCCL_P2P_LEVEL", " 2", ["not a level"]),
    ("NCCL_ALGO", "Rign", ["unknown algorithm 'Rign'", "fails to initialise"]),
    ("NCCL_ALGO", "Ring,", ["unknown algorithm ''"]),
    ("NCCL_ALGO", "allreduce:ring;tree", ["only the first entry may omit the function"]),
    ("NCCL_ALGO", "allreduec:ring", ["unknown function 'allreduec'"]),
    ("NCCL_PROTO", "LL129", ["unknown protocol 'LL129'"]),
    ("NCCL_PROTO", "allreduce:^Simple;LL", ["only the first entry may omit the function"]),
    ("NCCL_BUFFSIZE", "010000000", ["leading 0", "octal"]),
    ("NCCL_MIN_NCHANNELS", "010", ["leading 0", "octal"]),
    ("NCCL_NTHREADS", "100", ["not a multiple of 32"]),
    ("NCCL_NTHREADS", "1024", ["outside 64..512"]),
    ("NCCL_NTHREADS", "32", ["outside 64..512"]),
    ("NCCL_MIN_NCHANNELS", "65", ["outside 1..64"]),
    ("NCCL_MAX_NCHANNELS", "0", ["outside 1..64"]),
    ("NCCL_BUFFSIZE", "1024", ["outside 65536.."]),
    ("NCCL_BUFFSIZE", "0x400000", ["not a decimal integer"]),
    ("NCCL_BUFFSIZE", "4M", ["not a decimal integer"]),
    ("NCCL_NTHREADS", "-256", ["not a decimal integer"]),
    ("NCCL_SHM_DISABLE", "2", ["'2' is not one of 0, 1"]),
    ("NCCL_SHM_DISABLE", "yes", ["not one of"]),
    ("NCCL_ALGO", "", ["empty value"]),
])
def test_invalid_values_are_named_with_the_problem(name: str, value: str, expected: list[str]) -> None:
    message = validate_value(name, value)
    assert message is not None
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.parametrize(("name", "value"), [
    ("NCCL_P2P_LEVEL", "NVL"), ("NCCL_P2P_LEVEL", "2"), ("NCCL_P2P_LEVEL", "P2C"),
    ("NCCL_ALGO", "Ring,Tree"), ("NCCL_ALGO", "allreduce:tree,ring"), ("NCCL_ALGO", "ring;allreduce:^tree"),
    ("NCCL_ALGO", "^NVLS"), ("NCCL_PROTO", "^LL128"), ("NCCL_PROTO", "ll,simple"),
    ("NCCL_BUFFSIZE", "4194304"), ("NCCL_NTHREADS", "256"), ("NCCL_NTHREADS", "64"),
    ("NCCL_MIN_NCHANNELS", "64"),
    ("NCCL_SHM_DISABLE", "1"), ("NCCL_NVLS_ENABLE", "0"),
    ("NCCL_UNKNOWN_TO_NCCLTUNE", "anything"),
])
def test_valid_values_pass(name: str, value: str) -> None:
    assert validate_value(name, value) is None


@pytest.mark.parametrize(("value", "level"), [
    ("LOC", "LOC"), ("PXN", "PXN"), ("0", "LOC"), ("1", "PIX"), ("2", "PXB"), ("3", "PHB"), ("4", "SYS"),
    ("5", "SYS"), ("17", "SYS"), ("nvl", None), ("NET", None), ("-1", None), (" 2", None), ("", None),
])
def test_level_of_follows_nccls_parser(value: str, level: str | None) -> None:
    assert level_of(value) == level


def test_every_portable_level_is_a_level_and_c2c_p2c_are_not_proposed() -> None:
    assert set(PORTABLE_LEVELS) <= set(LEVELS)
    assert "C2C" not in PORTABLE_LEVELS and "P2C" not in PORTABLE_LEVELS
    assert CATALOGUE["NCCL_P2P_LEVEL"].sweep == PORTABLE_LEVELS
