"""A node against its class: the per-node numbers `fleet decide` keeps in a profile, the class
distribution read back from them, and the one rule that says a node is below its class beyond
noise, each checked on numbers worked out by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from nccltune.fleet.decide import Rules, decide, load_exports, node_per_size
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.fleet.outlier import ClassSize, chosen_setting, class_reference, judge_node
from nccltune.names import DEFAULTS_LABEL
from tests.fleet_fixtures import h200x2_export

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
RING = {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


# -- the rule ------------------------------------------------------------------------------------


def test_a_node_far_below_the_class_median_is_an_outlier() -> None:
    # Class medians 100, 104, 96: median 100, the lowest node 4% below it. Their noise 1, 2, 3%:
    # typical 2%. The node's runs 80 and 84: best 84, its own noise (84-80)/(2*82) = 2.439%.
    # Allowed: max(threshold 5, 2 * max(2.439, 2) = 4.878, spread 4) = 5%. 84 is 16% below: an outlier.
    ref = ClassSize.of_nodes("all_reduce", MIB, (100.0, 104.0, 96.0), (1.0, 2.0, 3.0))
    verdict = judge_node([80.0, 84.0], ref, threshold_pct=5.0)
    assert verdict.measured_gbps == 84.0 and verdict.class_median_gbps == 100.0
    assert verdict.allowed_pct == pytest.approx(5.0)
    assert verdict.ratio == pytest.approx(0.84) and verdict.drift_pct == pytest.approx(-16.0)
    assert verdict.below


def test_a_node_within_the_bar_is_not() -> None:
    ref = ClassSize.of_nodes("all_reduce", MIB, (100.0, 104.0, 96.0), (1.0, 2.0, 3.0))
    # Best run 97: 3% below the median, inside the 5% bar.
    assert not judge_node([95.0, 97.0], ref, threshold_pct=5.0).below
    # Exactly at the bar is not beyond it.
    assert not judge_node([95.0], ref, threshold_pct=5.0).below


def test_the_bar_is_the_largest_of_threshold_noise_and_spread() -> None:
    # Noisy node: runs 60 and 90, best 90 (10% below); its own noise 30/(2*75) = 20%: allowed 40%.
    ref = ClassSize.of_nodes("all_reduce", MIB, (100.0, 100.0), (1.0, 1.0))
    noisy = judge_node([60.0, 90.0], ref, threshold_pct=5.0)
    assert noisy.allowed_pct == pytest.approx(40.0) and not noisy.below
    # A class whose lowest node was 12% below its median (88, 100, 112): a node at 90 is within.
    spread = ClassSize.of_nodes("all_reduce", MIB, (88.0, 100.0, 112.0), (0.0, 0.0, 0.0))
    assert judge_node([90.0], spread, threshold_pct=5.0).allowed_pct == pytest.approx(12.0)
    assert not judge_node([90.0], spread, threshold_pct=5.0).below
    assert judge_node([87.0], spread, threshold_pct=5.0).below
    # A node faster than its class is never an outlier.
    assert not judge_node([150.0], ref, threshold_pct=5.0).below
    with pytest.raises(ValueError):
        judge_node([], ref, threshold_pct=5.0)


# -- the per-node numbers a profile keeps ------------------------------------------------------------


def _export(host: str, base: list[float], cand: list[float], tmp_path: Path, *,
            collective: str | None = None) -> Path:
    sizes = [MIB, 1 << 24]

    def trial(seq: int, phase: str, env: dict[str, str], busbw: float) -> dict[str, Any]:
        measurements = [{"size_bytes": s, "time_us": 1.0, "algbw_gbps": busbw, "busbw_gbps": busbw * (1 + i),
                         "algo": None, "proto": None, "correct": True} for i, s in enumerate(sizes)]
        if collective is not None:
            for m in measurements:
                m["collective"] = collective
        return {"seq": seq, "phase": phase, "label": "x", "env": env, "status": "ok", "reason": None, "wall_s": 1.0,
                "measurements": measurements}

    trials = [trial(i + 1, "baseline", {}, b) for i, b in enumerate(base)]
    trials += [trial(10 + i, "final", RING, c) for i, c in enumerate(cand)]
    trials.append({**trial(20, "final", RING, 1.0), "status": "failed"})  # not counted
    doc = h200x2_export(host, trials)
    path = tmp_path / f"{host}.json"
    path.write_text(json.dumps(doc))
    return path


def test_each_node_keeps_its_own_medians_and_noise(tmp_path: Path) -> None:
    doc = json.loads(_export("a", [100, 101, 99], [110, 112], tmp_path).read_text())
    rows = {(r["setting"], r["size_bytes"]): r for r in node_per_size(doc)}
    # Defaults at 1 MiB: 99, 100, 101 -> median 100, noise 2/(2*100) = 1%.
    base = rows[(DEFAULTS_LABEL, MIB)]
    assert (base["samples"], base["median_busbw_gbps"], base["noise_pct"]) == (3, 100, 1.0)
    assert base["topology_file"] is False
    assert base["collective"] == "all_reduce"  # measurements that do not name one are all_reduce's
    # The candidate at 16 MiB (busbw doubled there): 220, 224 -> median 222, noise 4/(2*222) = 0.901%.
    cand = rows[("NCCL_ALGO=Ring", 1 << 24)]
    assert (cand["samples"], cand["median_busbw_gbps"], cand["noise_pct"]) == (2, 222, 0.901)
    named = json.loads(_export("b", [1.0, 1.0], [1.0], tmp_path, collective="all_gather").read_text())
    assert {r["collective"] for r in node_per_size(named)} == {"all_gather"}


def test_a_decided_profile_carries_the_class_distribution(tmp_path: Path) -> None:
    paths = [_export("a", [100, 101, 99], [110, 112], tmp_path), _export("b", [98, 100, 102], [104, 106], tmp_path)]
    prof = decide(load_exports(paths), Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    validate(prof, load_schema("profile"))
    assert prof["chosen"] == "NCCL_ALGO=Ring" and chosen_setting(prof) == ("NCCL_ALGO=Ring", False)
    ref = class_reference(prof, "p.json")
    assert ref is not None and ref.nodes == 2 and ref.setting == "NCCL_ALGO=Ring"
    at = ref.sizes[("all_reduce", MIB)]
    # The two nodes' candidate medians: 111 and 105; noise 2/(2*111) and 2/(2*105).
    assert (at.nodes, at.median_gbps, at.lowest_gbps) == (2, 108.0, 105.0)
    assert at.noise_pct == pytest.approx((0.901 + 0.952) / 2)
    assert at.spread_pct == pytest.approx(100 * 3 / 108)
    assert ref.describe() == f"class profile p.json (class {prof['node_class']['id']}, NCCL_ALGO=Ring, 2 node(s))"
    # A class keeping the defaults is compared on the defaults' numbers.
    keeps = copy.deepcopy(prof)
    keeps["chosen"] = DEFAULTS_LABEL
    kept = class_reference(keeps, "p.json")
    defaults = kept.sizes[("all_reduce", MIB)] if kept is not None else None
    assert defaults is not None and (defaults.nodes, defaults.median_gbps, defaults.lowest_gbps) == (2, 100.0, 100.0)


def test_no_distribution_from_one_node_or_an_older_profile(tmp_path: Path) -> None:
    one = decide(load_exports([_export("a", [100, 101, 99], [110, 112], tmp_path)]),
                 Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    assert class_reference(one, "p.json") is None  # one node is no distribution
    two = decide(load_exports([_export("a", [100, 101, 99], [110, 112], tmp_path),
                               _export("b", [98, 100, 102], [104, 106], tmp_path)]),
                 Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    for node in two["evidence"]["nodes"]:
        del node["per_size"]  # decided before per-node numbers were kept: still a valid profile
    for key in ("class_per_size", "node_count", "trials", "exports_sha256"):
        del two["evidence"][key]
    validate(two, load_schema("profile"))
    assert class_reference(two, "p.json") is None
