"""The plan's time estimate: each trial's start is what this node's own latest sweep measured."""

from __future__ import annotations

from pathlib import Path

from demo_state import SNAPSHOT

from nccltune import __version__
from nccltune.config import load_config, with_overrides
from nccltune.node import iterations, load_node
from nccltune.pipeline.planning import IDLE_TRIAL_START_S, estimate_seconds, make_plan, measured_start_s
from nccltune.records import Measurement
from nccltune.store import Store


def test_the_estimate_takes_the_trial_start_the_last_sweep_measured(tmp_path: Path) -> None:
    cfg = with_overrides(load_config(None), state_dir=str(tmp_path / "state"))
    node = load_node(cfg, str(SNAPSHOT))
    plan = make_plan(cfg, node, {})
    assert measured_start_s(cfg, node) is None  # no history: the idle node's constant
    idle = estimate_seconds(plan, 10, cfg, node)
    warmup, iters = iterations(cfg, node)
    (tmp_path / "state").mkdir()
    with Store(tmp_path / "state" / "history.db") as store:
        run = store.start_run(kind="sweep", fingerprint=node.fingerprint, backend=node.backend, demo=True,
                              profile=None, nccl_version=None, driver_version=None, torch_version=None,
                              nccltune_version=__version__, hostname="n", topology={}, config={})
        # Trials of 12, 14 and 30 s, each with 0.1 s of measured data time per iteration.
        for seq, wall in enumerate((12.0, 14.0, 30.0), start=1):
            store.add_trial(run, seq=seq, phase="baseline", label=f"defaults #{seq}", env={}, status="ok",
                            measurements=[Measurement(1 << 20, 100_000.0, 1.0, 1.0)], wall_s=wall)
        store.finish_run(run, status="ok", summary={})
    start = measured_start_s(cfg, node)
    assert start is not None and abs(start - (14.0 - (warmup + iters) * 0.1)) < 1e-9
    loaded = estimate_seconds(plan, 10, cfg, node)
    assert abs((loaded - idle) - 10 * (start - IDLE_TRIAL_START_S[(False, True)])) < 1e-6


def test_a_multi_node_plan_takes_the_start_of_a_multi_node_sweep_never_a_single_node_ones(tmp_path: Path) -> None:
    from nccltune.sweep.plan import JobShape

    cfg = with_overrides(load_config(None), state_dir=str(tmp_path / "state"))
    node = load_node(cfg, str(SNAPSHOT))
    one, two = make_plan(cfg, node, {}), make_plan(cfg, node, {}, shape=JobShape(nnodes=2))
    # Without history: torchrun's agents and rendezvous make a multi-node trial start later.
    assert estimate_seconds(two, 10, cfg, node) - estimate_seconds(one, 10, cfg, node) > 10 * 8.0
    (tmp_path / "state").mkdir()
    with Store(tmp_path / "state" / "history.db") as store:
        for job, wall in ((None, 5.0), ({"nnodes": 2, "label": "2x1"}, 21.0)):
            run = store.start_run(kind="sweep", fingerprint=node.fingerprint, backend=node.backend, demo=True,
                                  profile=None, nccl_version=None, driver_version=None, torch_version=None,
                                  nccltune_version=__version__, hostname="n", topology={}, config={})
            store.add_trial(run, seq=1, phase="baseline", label="defaults #1", env={}, status="ok",
                            measurements=[Measurement(1 << 20, 1.0, 1.0, 1.0)], wall_s=wall)
            store.finish_run(run, status="ok", summary={"job": job} if job else {})
    single, multi = measured_start_s(cfg, node), measured_start_s(cfg, node, 2)
    assert single is not None and multi is not None and 4.9 < single < 5.0 and 20.9 < multi < 21.0
    assert measured_start_s(cfg, node, 4) is None
