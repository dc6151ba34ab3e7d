"""A node against its class: the one rule for "this node is below its class beyond noise".

With a class profile in force, every node of the class publishes the same setting, and the
profile's evidence holds the class's distribution of what its nodes measured with it: per
collective and size, the median of the per-node medians, the lowest one and the median of the
per-node noise (`evidence.class_per_size`, a summary of any number of nodes), and, for a class
of up to 16 nodes, each node's own numbers besides (`evidence.nodes[].per_size`; profiles decided
before the summary carry only these). Both give the same three numbers. `nccltune verify` (and the daemon's verify)
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

from ..names import DEFAULTS_LABEL

log = logging.getLogger(__name__)

MIN_NODES = 2
Key = tuple[str, int]  # (collective, size_bytes)


@dataclass(frozen=True)
class ClassSize:
    """The class's distribution at one collective and size, as the rule uses it: how many nodes,
    the median of their medians, the lowest median, and the class's typical run-to-run noise (the
    median of its nodes' own)."""

    collective: str
    size_bytes: int
    nodes: int
    median_gbps: float
    lowest_gbps: float
    noise_pct: float

    @classmethod
    def of_nodes(cls, collective: str, size_bytes: int, medians: Sequence[float],
                 noises: Sequence[float]) -> ClassSize:
        """From one median and one noise per node."""
        return cls(collective, size_bytes, len(medians), float(statistics.median(medians)) if medians else 0.0,
                   min(medians) if medians else 0.0, float(statistics.median(noises)) if noises else 0.0)

    @property
    def spread_pct(self) -> float:
        """How far below the class median its lowest node was, in percent."""
        median = self.median_gbps
        return 100.0 * (median - self.lowest_gbps) / median if median > 0 else 0.0


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
    if not samples_gbps or ref.nodes < 1:
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
    if chosen == DEFAULTS_LABEL:
        return DEFAULTS_LABEL, False
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
    evidence = doc["evidence"]
    listed = evidence["nodes"]
    every_node_listed = len(listed) == int(evidence.get("node_count", len(listed)))
    if every_node_listed and all("per_size" in node for node in listed):
        nodes, all_sizes = _from_nodes(listed, setting)
    elif "class_per_size" in evidence:
        nodes, all_sizes = _from_summary(evidence["class_per_size"], setting)
    else:
        return None
    sizes = {key: st for key, st in sorted(all_sizes.items()) if st.nodes >= MIN_NODES and st.lowest_gbps > 0}
    if not sizes:
        return None
    return ClassReference(name, str(doc["node_class"]["id"]), setting[0], nodes, sizes)


def _from_nodes(listed: Sequence[Mapping[str, Any]], setting: tuple[str, bool]) -> tuple[int, dict[Key, ClassSize]]:
    """Every node's own numbers of `setting` (a small class, or a profile older than the summary)."""
    medians: dict[Key, list[float]] = {}
    noises: dict[Key, list[float]] = {}
    nodes = 0
    for node in listed:
        rows = [r for r in node.get("per_size", []) if (r["setting"], r["topology_file"]) == setting]
        nodes += bool(rows)
        for r in rows:
            key = (str(r["collective"]), int(r["size_bytes"]))
            medians.setdefault(key, []).append(float(r["median_busbw_gbps"]))
            noises.setdefault(key, []).append(float(r["noise_pct"]))
    return nodes, {key: ClassSize.of_nodes(key[0], key[1], values, noises[key]) for key, values in medians.items()}


def _from_summary(rows: Sequence[Mapping[str, Any]], setting: tuple[str, bool]) -> tuple[int, dict[Key, ClassSize]]:
    """The class's summary of `setting` (evidence.class_per_size)."""
    sizes = {(str(r["collective"]), int(r["size_bytes"])):
             ClassSize(str(r["collective"]), int(r["size_bytes"]), int(r["nodes"]), float(r["median_busbw_gbps"]),
                       float(r["lowest_busbw_gbps"]), float(r["noise_pct"]))
             for r in rows if (r["setting"], r["topology_file"]) == setting}
    return max((st.nodes for st in sizes.values()), default=0), sizes
