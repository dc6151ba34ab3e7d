"""A node against its class: the one rule for "this node is below its class beyond noise".

With a class profile in force, every node of the class publishes the same setting, and the
profile's evidence holds what each node that took part in the decision measured with it
(`evidence.nodes[].per_size`: one median and noise per node, collective and size). Those
per-node medians are the class's distribution. `nccltune verify` (and the daemon's verify)
measures the node with the published setting and asks `judge_node` whether it is below that
distribution by more than what the class itself shows:

- the node's value is the best of its verify runs (a degraded link is slow every time, noise
  is not), the class's value the median of the per-node medians;
- the node may fall below the class median by the largest of: the drift threshold
  (daemon.drift_threshold_pct, or --threshold), twice the noise (the larger of the node's own
  verify runs' and the class's typical per-node noise), and how far the class's own lowest node
  was below its median (the node-to-node spread the decision was made with).

A class distribution needs at least MIN_NODES nodes' numbers at a size; sizes with fewer are not
judged against the class.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .decide import DEFAULTS

log = logging.getLogger(__name__)

MIN_NODES = 2
Key = tuple[str, int]  # (collective, size_bytes)


@dataclass(frozen=True)
class ClassSize:
    """The class's distribution at one collective and size: one median (and noise) per node."""

    collective: str
    size_bytes: int
    node_medians_gbps: tuple[float, ...]
    node_noise_pcts: tuple[float, ...]

    @property
    def median_gbps(self) -> float:
        return float(statistics.median(self.node_medians_gbps))

    @property
    def noise_pct(self) -> float:
        """The class's typical run-to-run noise: the median of its nodes' own."""
        return float(statistics.median(self.node_noise_pcts)) if self.node_noise_pcts else 0.0

    @property
    def spread_pct(self) -> float:
        """How far below the class median its lowest node was, in percent."""
        median = self.median_gbps
        return 100.0 * (median - min(self.node_medians_gbps)) / median if median > 0 else 0.0


@dataclass(frozen=True)
class ClassReference:
    """What a node of the class is compared with: the profile's chosen setting, per size."""

    profile: str  # the profile's file name
    class_id: str
    setting: str
    nodes: int
    sizes: dict[Key, ClassSize]

    def describe(self) -> str:
        return f"class profile {self.profile} (class {self.class_id}, {self.setting}, {self.nodes} node(s))"


@dataclass(frozen=True)
class ClassVerdict:
    """One size: the node's best run, the class median, and whether the node is below the class."""

    measured_gbps: float
    class_median_gbps: float
    allowed_pct: float  # how far below the class median the node may be, in percent
    below: bool

    @property
    def ratio(self) -> float:
        return self.measured_gbps / self.class_median_gbps if self.class_median_gbps > 0 else 0.0

    @property
    def drift_pct(self) -> float:
        return 100.0 * (self.ratio - 1.0)


def _noise_pct(samples: Sequence[float]) -> float:
    """Half the relative range of the runs (select.SizeStats.noise_pct): 0 for one run."""
    if len(samples) < 2:
        return 0.0
    median = statistics.median(samples)
    return 100.0 * (max(samples) - min(samples)) / (2.0 * median) if median > 0 else 0.0


def judge_node(samples_gbps: Sequence[float], ref: ClassSize, threshold_pct: float) -> ClassVerdict:
    """The rule (see the module's docstring): is this node, measured `samples_gbps` (its verify
    runs at one size, bus bandwidth in GB/s), below the class `ref` beyond noise?

    Raises:
        ValueError: no sample, or no node in the class distribution.
    """
    if not samples_gbps or not ref.node_medians_gbps:
        raise ValueError("judge_node needs the node's samples and the class's per-node medians")
    measured = max(samples_gbps)
    median = ref.median_gbps
    noise = max(_noise_pct(samples_gbps), ref.noise_pct)
    allowed = max(threshold_pct, 2.0 * noise, ref.spread_pct)
    # Below the bar, not at it: the lowest value the class allows, compared as a bandwidth.
    return ClassVerdict(measured, median, allowed, measured < median * (1.0 - allowed / 100.0))


def chosen_setting(doc: Mapping[str, Any]) -> tuple[str, bool] | None:
    """(label, topology file) of what the profile publishes, as node_per_size names its numbers."""
    chosen = str(doc["chosen"])
    if chosen == DEFAULTS:
        return DEFAULTS, False
    for cand in doc["evidence"]["candidates"]:
        if cand["label"] == chosen and cand["eligible"]:
            return chosen, bool(cand["topology_file"])
    return None


def class_reference(doc: Mapping[str, Any], name: str) -> ClassReference | None:
    """The class's distribution of the setting profile `doc` (named `name`) publishes, or None
    when its evidence has no per-node numbers (a profile decided before they were kept) or fewer
    than MIN_NODES nodes at every size."""
    setting = chosen_setting(doc)
    if setting is None:
        return None
    medians: dict[Key, list[float]] = {}
    noises: dict[Key, list[float]] = {}
    nodes = 0
    for node in doc["evidence"]["nodes"]:
        rows = [r for r in node.get("per_size", []) if (r["setting"], r["topology_file"]) == setting]
        nodes += bool(rows)
        for r in rows:
            key = (str(r["collective"]), int(r["size_bytes"]))
            medians.setdefault(key, []).append(float(r["median_busbw_gbps"]))
            noises.setdefault(key, []).append(float(r["noise_pct"]))
    sizes = {key: ClassSize(key[0], key[1], tuple(values), tuple(noises[key]))
             for key, values in sorted(medians.items()) if len(values) >= MIN_NODES and min(values) > 0}
    if not sizes:
        return None
    return ClassReference(name, str(doc["node_class"]["id"]), setting[0], nodes, sizes)
