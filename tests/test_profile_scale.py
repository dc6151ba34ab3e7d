"""A class profile stays small at fleet size: 1,000 nodes of one class on the bundled size ladder
decide a profile under 256 KiB (a ConfigMap holds 1 MiB, one key per class), and the outlier rule
still judges a node against the whole class from the profile's summary."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from fleet_fixtures import h200x2_export

from nccltune.config import Config
from nccltune.fleet.decide import MAX_NODE_ENTRIES, Export, Rules, decide, dumps_profile
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.fleet.outlier import class_reference, judge_node
from nccltune.node import size_ladder

NODES = 1000
LIMIT_BYTES = 256 * 1024
RING = {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
PROTO = {"NCCL_PROTO": "Simple", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def node_export(host: str, rng: random.Random, sizes: list[int], scale: float) -> Export:
    """One node's sweep: three baseline trials, two finals of each of two candidates (Ring 30% faster)."""

    def trial(seq: int, phase: str, env: dict[str, str], gain: float) -> dict[str, Any]:
        return {"seq": seq, "phase": phase, "label": "x", "env": env, "status": "ok", "reason": None, "wall_s": 1.0,
                "measurements": [{"collective": "all_reduce", "size_bytes": s, "time_us": 1.0, "algbw_gbps": 1.0,
                                  "busbw_gbps": round(scale * gain * (40 + 40 * i) * rng.uniform(0.99, 1.01), 3),
                                  "algo": None, "proto": None, "correct": True} for i, s in enumerate(sizes)]}

    trials = [trial(i + 1, "baseline", {}, 1.0) for i in range(3)]
    trials += [trial(10 + i, "final", RING, 1.30) for i in range(2)]
    trials += [trial(20 + i, "final", PROTO, 1.0) for i in range(2)]
    doc = h200x2_export(host, trials)
    raw = json.dumps(doc).encode()
    return Export(Path(f"/exports/{host}.json"), doc, raw)


def test_a_profile_of_1000_nodes_stays_under_256_kib_and_names_its_outlier() -> None:
    sizes = size_ladder(Config(), False)
    rng = random.Random(7)
    # Node 0 is 15% slower than the rest on the defaults themselves: named and left out of the pool.
    exports = [node_export(f"gpu-{i:04d}", rng, sizes, 0.85 if i == 0 else 1.0) for i in range(NODES)]
    prof = decide(exports, Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    text = dumps_profile(prof)
    assert len(text.encode()) < LIMIT_BYTES, len(text.encode())
    validate(prof, load_schema("profile"))
    evidence = prof["evidence"]
    assert prof["chosen"] == "NCCL_ALGO=Ring"
    assert [o["hostname"] for o in evidence["outliers"]] == ["gpu-0000"]
    assert 0.83 < evidence["outliers"][0]["ratio"] < 0.87 and evidence["outliers"][0]["sizes"]
    assert "gpu-0000 x0.8" in prof["evidence"]["verdict"]
    assert evidence["node_count"] == NODES - 1 and len(evidence["nodes"]) == MAX_NODE_ENTRIES
    assert evidence["trials"] == {"baseline": 3 * (NODES - 1), "candidate": 4 * (NODES - 1)}
    assert "gpu-0000" not in {n["hostname"] for n in evidence["nodes"]}
    assert all("per_size" not in n for n in evidence["nodes"])

    ref = class_reference(prof, "class.json")
    assert ref is not None and ref.nodes == NODES - 1 and ref.setting == "NCCL_ALGO=Ring"
    at = ref.sizes[("all_reduce", sizes[2])]
    assert at.nodes == NODES - 1
    # The class's median at this size is about 1.30 * 120 GB/s, and without the slow node its
    # lowest is within a few percent of it.
    assert 153 < at.median_gbps < 159 and at.lowest_gbps > 0.9 * at.median_gbps
    # The rule from the summary: a node at the class median passes; the slow node, 15% below, does not.
    assert not judge_node([at.median_gbps], at, threshold_pct=5.0).below
    assert judge_node([0.7 * at.median_gbps], at, threshold_pct=5.0).below
    assert judge_node([0.85 * at.median_gbps], at, threshold_pct=5.0).below


def test_a_small_class_keeps_every_node_with_its_own_numbers() -> None:
    sizes = size_ladder(Config(), False)
    rng = random.Random(3)
    exports = [node_export(f"gpu-{i}", rng, sizes, 1.0) for i in range(3)]
    prof = decide(exports, Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    evidence = prof["evidence"]
    assert [n["hostname"] for n in evidence["nodes"]] == ["gpu-0", "gpu-1", "gpu-2"]
    assert all(n["per_size"] for n in evidence["nodes"])
    # The summary and the per-node numbers give the outlier rule the same class.
    from_nodes = class_reference(prof, "c.json")
    summary_only = json.loads(json.dumps(prof))
    for node in summary_only["evidence"]["nodes"][1:]:
        del node["per_size"]
    from_summary = class_reference(summary_only, "c.json")
    assert from_nodes is not None and from_summary is not None
    for key, st in from_nodes.sizes.items():
        other = from_summary.sizes[key]
        assert (st.nodes, st.lowest_gbps) == (other.nodes, other.lowest_gbps)
        assert abs(st.median_gbps - other.median_gbps) < 1e-3 and abs(st.noise_pct - other.noise_pct) < 1e-3
