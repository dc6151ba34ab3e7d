"""Simulated classes of nodes for the decision bench (bench/decision_power.py) and the tests that
pin the decision rule: exports of sweeps whose numbers are drawn from recorded real measurements,
decided by nccltune's own `fleet decide` code.

A node's sweep here is what a real one stores: three runs of NCCL's defaults, then three rounds
of the final check (each candidate, then the defaults). ln(busbw) of a run is the recorded
defaults' median at that size, plus the node's own level (the node-to-node spread), plus the
candidate's true effect, plus run noise. The noise is either Gaussian of a given size or
resampled from recorded runs: the deviations ln(run / median) of repeated runs of NCCL's
defaults, per size, on the lent 2x H200 NVSwitch node (bench/results/h200x2-2026-11-30/
noise-blocks.json). Nothing here is a measurement: it tells what the rule does with numbers like
the real ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nccltune.fleet.decide import Export, Rules, decide
from nccltune.topology.model import from_snapshot
from nccltune.topology.nodeclass import node_class
from nccltune.topology.snapshot import load_snapshot

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "bench" / "results" / "h200x2-2026-11-30" / "noise-blocks.json"
SNAPSHOT = ROOT / "topologies" / "h200x2-nvswitch-vm.json"
POLICY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
CANDIDATES = ({"NCCL_ALGO": "Ring", **POLICY}, {"NCCL_PROTO": "Simple", **POLICY})


@dataclass(frozen=True)
class Recorded:
    """The recorded defaults: median busbw per size and the runs' deviations ln(run / median)."""

    medians: dict[int, float]
    residuals: dict[int, list[float]]


def recorded(path: Path = RECORDED) -> Recorded:
    doc = json.loads(path.read_text())
    runs = [run for label, got in doc["trials"].items() if label.startswith("defaults") for run in got]
    sizes = sorted({int(s) for run in runs for s in run})
    medians = {s: statistics.median(float(run[str(s)]) for run in runs if str(s) in run) for s in sizes}
    residuals = {s: [math.log(float(run[str(s)]) / medians[s]) for run in runs if str(s) in run] for s in sizes}
    return Recorded(medians, residuals)


@dataclass(frozen=True)
class Scenario:
    effects: Sequence[float | Mapping[int, float]]  # per candidate: its true ratio, or one per size
    noise: float | None = 0.01  # Gaussian run noise (sd of ln busbw); None: resampled from the recording
    node_spread: float = 0.01  # sd of a node's own level (ln)
    rounds: int = 3  # rounds of the final check per node
    outlier: float | None = None  # one node's level as a ratio (0.75: a node 25% slow), or none


@dataclass
class _Node:
    rng: random.Random
    rec: Recorded
    sc: Scenario
    level: float
    trials: list[dict[str, Any]] = field(default_factory=list)

    def run(self, phase: str, label: str, env: Mapping[str, str], effect: float | Mapping[int, float]) -> None:
        ms = []
        for s, median in self.rec.medians.items():
            e = effect if isinstance(effect, float) else effect.get(s, 1.0)
            noise = (self.rng.gauss(0.0, self.sc.noise) if self.sc.noise is not None
                     else self.rng.choice(self.rec.residuals[s]))
            busbw = median * math.exp(self.level + math.log(e) + noise)
            ms.append({"collective": "all_reduce", "size_bytes": s, "time_us": 1.0, "algbw_gbps": busbw,
                       "busbw_gbps": round(busbw, 5), "algo": None, "proto": None, "correct": True})
        self.trials.append({"seq": len(self.trials) + 1, "phase": phase, "label": label, "env": dict(env),
                            "status": "ok", "reason": None, "wall_s": 1.0, "measurements": ms})


_FACTS: dict[str, Any] = {}


def _facts() -> dict[str, Any]:
    if not _FACTS:
        _FACTS.update(node_class(from_snapshot(load_snapshot(SNAPSHOT))).as_dict())
    return _FACTS


def node_export(host: str, trials: list[dict[str, Any]]) -> Export:
    """One node's export of one sweep of `trials` on the recorded 2x H200 node's class."""
    doc = {"kind": "nccltune-export", "schema_version": 1, "hostname": host, "demo": False,
           "topology_fingerprint": hashlib.sha256(host.encode()).hexdigest()[:16], "node_class": _facts(),
           "versions": {"nccltune": "0.2.0", "nccl": None, "driver": "580.159.04", "torch": None},
           "runs": [{"id": 1, "nranks": 2, "kind": "sweep", "status": "ok", "started_at": "t", "finished_at": "t",
                     "backend": "nccl", "demo": False, "profile": "balanced", "nccl_version": None,
                     "driver_version": "580.159.04", "torch_version": None, "nccltune_version": "0.2.0",
                     "hostname": host, "chosen_env": {}, "published_generation": 1, "trials": trials}]}
    return Export(Path(f"/exports/{host}.json"), doc, host.encode())


def class_exports(sc: Scenario, nodes: int, seed: int, rec: Recorded | None = None) -> list[Export]:
    """The exports of `nodes` nodes of one class under scenario `sc`, reproducible by `seed`."""
    rec = rec or recorded()
    rng = random.Random(seed)
    out = []
    for i in range(nodes):
        level = rng.gauss(0.0, sc.node_spread)
        if sc.outlier is not None and i == 0:
            level = math.log(sc.outlier)
        node = _Node(random.Random(rng.random()), rec, sc, level)
        for r in range(3):
            node.run("baseline", f"defaults #{r + 1}", {}, 1.0)
        for r in range(sc.rounds):
            for env, effect in zip(CANDIDATES, sc.effects, strict=False):
                node.run("final", f"candidate #{r + 1}", env, effect)
            node.run("baseline", f"defaults #{r + 4}", {}, 1.0)
        out.append(node_export(f"node-{i:04d}", node.trials))
    return out


RULES = Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0)


def chosen_index(profile: Mapping[str, Any]) -> int | None:
    """Which candidate of CANDIDATES the profile publishes (None: NCCL's defaults)."""
    env = {k: v for k, v in profile["env"].items() if k not in POLICY}
    for i, cand in enumerate(CANDIDATES):
        if env and env == {k: v for k, v in cand.items() if k not in POLICY}:
            return i
    return None


def decide_class(sc: Scenario, nodes: int, seed: int, rec: Recorded | None = None,
                 profile: str = "balanced") -> dict[str, Any]:
    rules = RULES if profile == RULES.profile else Rules(profile, RULES.min_gain_pct, RULES.max_regression_pct)
    return decide(class_exports(sc, nodes, seed, rec), rules)
