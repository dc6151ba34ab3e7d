"""The sweep's choice and report rows: what NCCL used per size over a candidate's trials, the
published environment, and the rows the reports show."""

from __future__ import annotations

from nccltune.nccl.debuglog import SizeChoice
from nccltune.pipeline.choice import nccl_choices, report_rows
from nccltune.records import Measurement, ReportRow, TrialResult
from nccltune.sweep.select import SizeStats
from nccltune.sweep.strategy import Finalist, SearchResult


def _trial(choices: dict[int, tuple[str, str]], status: str = "ok") -> TrialResult:
    sizes = [Measurement(s, 1.0, 1.0, 1.0, algo=a, proto=p) for s, (a, p) in choices.items()]
    return TrialResult(status="ok" if status == "ok" else "crashed", reason=None, sizes=sizes, wall_s=1.0)


def test_what_nccl_used_is_the_prevailing_choice_of_the_good_trials() -> None:
    tree = {"NCCL_ALGO": "Tree", "NCCL_TOPO_FILE": "/run/t.xml"}
    got = nccl_choices([
        ({}, _trial({1024: ("RING", "LL"), 4096: ("TREE", "LL")})),
        ({}, _trial({1024: ("TREE", "LL")})),
        ({}, _trial({1024: ("RING", "LL")})),
        ({}, _trial({1024: ("NVLS", "SIMPLE")}, status="crashed")),
        (tree, _trial({1024: ("TREE", "LL128")})),
    ])
    # Keyed by (collective, size): each collective has NCCL's own choice per size.
    assert got == {"defaults": {("all_reduce", 1024): SizeChoice("RING", "LL"),
                                ("all_reduce", 4096): SizeChoice("TREE", "LL")},
                   "NCCL_ALGO=Tree": {("all_reduce", 1024): SizeChoice("TREE", "LL128")}}


def test_rows_compare_the_defaults_with_the_chosen_setting() -> None:
    baseline = {1024: SizeStats(1024, 2.0, 1.9, 2.1, 3), 4096: SizeStats(4096, 4.0, 4.0, 4.0, 3)}
    chosen = Finalist(env={"NCCL_ALGO": "Tree"}, label="NCCL_ALGO=Tree",
                      stats={1024: SizeStats(1024, 3.0, 3.0, 3.0, 2)})
    result = SearchResult(baseline_runs=[], baseline=baseline, screened=[], finalists=[chosen], chosen=chosen,
                          topo_only=None, weights={1024: 1.0, 4096: 0.0}, notes=[])
    choices = {"defaults": {1024: SizeChoice("RING", "LL")}, "NCCL_ALGO=Tree": {1024: SizeChoice("TREE", "LL")}}
    assert report_rows(result, chosen, choices) == [
        ReportRow(1024, 1.0, 2.0, 5.0, 3.0, 1.5, "RING/LL", "TREE/LL"),
        ReportRow(4096, 0.0, 4.0, 0.0, 4.0, 1.0, None, None),
    ]
    # Nothing chosen: the defaults on both sides.
    assert report_rows(result, None, choices)[0] == ReportRow(1024, 1.0, 2.0, 5.0, 2.0, 1.0, "RING/LL", "RING/LL")


def test_the_choice_splits_into_what_fits_every_job_and_what_was_tuned_on_this_node() -> None:
    from pathlib import Path

    from nccltune.pipeline.choice import choose
    from nccltune.publish import OWN_TOPOLOGY
    from nccltune.sweep.plan import build_plan
    from nccltune.topology.model import from_snapshot
    from nccltune.topology.paths import compute_paths
    from nccltune.topology.snapshot import load_snapshot
    from nccltune.topology.source import bundled_topologies_dir

    topo = from_snapshot(load_snapshot(bundled_topologies_dir() / "h200x2-nvswitch-vm.json"))
    plan = build_plan(topo, compute_paths(topo), env={"NCCL_DEBUG": "WARN"}, config_pins={"NCCL_IB_HCA": "^mlx5_2"},
                      unpin=[], variables={}, exclude=[], policy={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
                      sizes=[1024], backend="nccl", nranks=2)
    tuned = {"NCCL_MIN_NCHANNELS": "32", "NCCL_TOPO_FILE": "/run/0001/ncclTopology.xml"}
    chosen = Finalist(env=tuned, label="NCCL_MIN_NCHANNELS=32", stats={1024: SizeStats(1024, 3.0, 3.0, 3.0, 2)})
    result = SearchResult(baseline_runs=[], baseline={1024: SizeStats(1024, 2.0, 2.0, 2.0, 3)}, screened=[],
                          finalists=[chosen], chosen=chosen, topo_only=None, weights={1024: 1.0}, notes=[])
    got = choose(result, plan, Path("/var/lib/nccltune/ncclTopology.xml"), [], demo=False)
    # The topology file stays the marker for the publisher, which names the generation's own copy.
    assert got.every_job_env == {"NCCL_TOPO_FILE": OWN_TOPOLOGY,
                                 "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_IB_HCA": "^mlx5_2"}
    assert got.single_node_env == {"NCCL_MIN_NCHANNELS": "32"}
    # The run's record names the stable copy.
    assert got.recorded_every_job == {**got.every_job_env, "NCCL_TOPO_FILE": "/var/lib/nccltune/ncclTopology.xml"}
    assert got.env == {**got.recorded_every_job, **got.single_node_env}
    assert got.uses_topology_file
    # The calling environment's pin is not the operator's: it is not published at all.
    assert "NCCL_DEBUG" not in got.env


def test_a_topology_file_the_config_pins_is_published_as_its_path_never_replaced() -> None:
    from pathlib import Path

    from nccltune.pipeline.choice import choose
    from nccltune.sweep.plan import build_plan
    from nccltune.topology.model import from_snapshot
    from nccltune.topology.paths import compute_paths
    from nccltune.topology.snapshot import load_snapshot
    from nccltune.topology.source import bundled_topologies_dir

    topo = from_snapshot(load_snapshot(bundled_topologies_dir() / "h200x2-nvswitch-vm.json"))
    plan = build_plan(topo, compute_paths(topo), env={}, config_pins={"NCCL_TOPO_FILE": "/etc/site/topo.xml"},
                      unpin=[], variables={}, exclude=[], policy={}, sizes=[1024], backend="nccl", nranks=2)
    stats = {1024: SizeStats(1024, 2.0, 2.0, 2.0, 3)}
    result = SearchResult(baseline_runs=[], baseline=stats, screened=[], finalists=[], chosen=None, topo_only=None,
                          weights={1024: 1.0}, notes=[])
    got = choose(result, plan, Path("/var/lib/nccltune/ncclTopology.xml"), [], demo=False)
    assert got.every_job_env == {"NCCL_TOPO_FILE": "/etc/site/topo.xml"}
    assert got.recorded_every_job == got.every_job_env
    # The publish writes no XML of nccltune's in its place.
    assert not got.uses_topology_file
