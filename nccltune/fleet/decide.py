"""`nccltune fleet decide`: one environment and tuner table for every node of one class, from all
their sweeps.

The exports of the nodes of one class are pooled: every ok baseline trial of every node is one
sample of NCCL's defaults, every ok finalist trial one sample of its candidate, per collective and
size (a measurement without a collective, from an older export, is all_reduce's). The pooled
samples then go through the same rules a node's own sweep applies
(nccltune.sweep.select.judge with the profile's weight per collective and size: the gain beyond
the noise, the veto of the medians, the largest allowed regression of any collective), so a class
profile is what the sweep would have chosen had it measured all the nodes itself.

The tuner table comes from the per-size stage's trials of the exports (labelled
sweep.pertable.TRIAL_LABEL), pooled per candidate, through the node's own per-size choice
(sweep.pertable.choose_table), as entries for one node of the class (its ranks per node). A
channel count above the defaults' is left out: on a node it is published for single-node jobs
only, and a class profile is for jobs of any number of nodes. The class has no final check of the
environment and table together (each node's own final check ran its own table), so each entry is
judged on every node's pooled samples with the sweep's full rule for its size, the bar for the
number of runs included (select.judge), not only screened as a node's per-size stage does.

A candidate counts only when every node of the pool measured it: comparing one node's candidate
with every node's defaults would judge the node, not the candidate. A candidate whose environment
`apply` would refuse to publish (fleet.values) is left out, with a warning, and the profile is
held to the same check before it is written (dumps_profile).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..compare import trial_setting
from ..errors import InputError, UsageError
from ..names import DEFAULTS_LABEL
from ..publish.policy import MAX_PROFILE_BYTES
from ..records import ALL_REDUCE, Measurement
from ..sweep import decision, profiles
from ..sweep.decision import Verdict, against_mean, log_ratios
from ..sweep.pertable import (
    STEERED,
    TRIAL_LABEL,
    SizeCandidate,
    TableChoice,
    candidate_of_env,
    choose_table,
    nccl_name,
    table_entries,
    table_inputs,
)
from ..sweep.select import Key, SizeStats, key_label, size_stats
from ..sweep.strategy import CARRIED, label_of
from ..topology.nodeclass import describe_difference, differing_facts
from .document import Export, read_json_document
from .export import EXPORT_KIND
from .parts import decide_parts
from .rules import Rules
from .values import check_values, env_problem

log = logging.getLogger(__name__)

# The document's kind is its schema's name (schemas/profile.schema.json).
PROFILE_KIND = "profile"
PROFILE_SCHEMA_VERSION = 1
TOPO_FILE = "NCCL_TOPO_FILE"
# Phases whose trials are repeated measurements of one candidate; screening runs are single
# shots taken against a fixed baseline median and are left to the node that took them.
CANDIDATE_PHASES = ("final",)
# A node's whole result with its tuner table names that node's own plugin and table (files of its
# run): never a class candidate. The class table is decided from the per-size trials instead.
TUNER_VARS = ("NCCL_TUNER_PLUGIN", "NCCLTUNE_TUNER_TABLE", "NCCLTUNE_TUNER_FINGERPRINT")
NO_RAISE = ("a channel count above the defaults' is published for single-node jobs only, and a class profile "
            "is for jobs of any number of nodes: no entry there")
def load_exports(paths: Sequence[Path]) -> list[Export]:
    """Read every export and check they describe distinct nodes of one class, or of classes that
    differ in their NCCL version alone (same_kind: decided in a section per version).

    Raises:
        InputError: a malformed export, the same node twice, demo and GPU measurements mixed, or
            exports of different classes beyond NCCL's version (the reason names the facts that
            differ). Exit 78.
    """
    if not paths:
        raise UsageError("nccltune fleet decide: give at least one export")
    exports = []
    for p in paths:
        doc, raw = read_json_document(p, "export", EXPORT_KIND)
        exports.append(Export(p, doc, raw))
    first = exports[0]
    seen: dict[tuple[str, str, str | None], Path] = {}
    for e in exports:
        # A node exported under two NCCL versions is two samples of two sections, never pooled.
        key = (e.doc["hostname"], e.doc["topology_fingerprint"], e.doc["node_class"]["facts"].get("nccl_version"))
        if key in seen:
            raise InputError(str(e.path), f"the same node as {seen[key]} (hostname {key[0]}, topology {key[1]})",
                             hint="each node's samples may count once")
        seen[key] = e.path
        if e.doc["demo"] != first.doc["demo"]:
            raise InputError(str(e.path), f"demo is {e.doc['demo']}, but {first.path} has {first.doc['demo']}",
                             hint="CPU demo measurements and GPU measurements do not pool")
        if e.class_id != first.class_id and not same_kind(first.doc["node_class"]["facts"],
                                                           e.doc["node_class"]["facts"]):
            why = describe_difference(first.doc["node_class"]["facts"], e.doc["node_class"]["facts"],
                                      a_name=first.path.name, b_name=e.path.name)
            raise InputError(str(e.path), f"node class {e.class_id} differs from {first.path}'s {first.class_id}: "
                             f"{why}", hint="decide each class from the exports of its own nodes")
    return exports


def same_kind(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Classes that differ in their NCCL version alone: one kind of node, whose exports decide
    together, each version's evidence in its own section (fleet/parts.py)."""
    return differing_facts(dict(a), dict(b)) == ["nccl_version"]


def _measurements(trial: Mapping[str, Any]) -> list[Measurement]:
    """A trial's correct measurements as records (an older export's, without a collective, are all_reduce's)."""
    return [m for m in map(Measurement.from_doc, trial["measurements"]) if m.correct]


def _busbw(measurements: Sequence[Measurement]) -> dict[Key, float]:
    return {(m.collective, m.size_bytes): m.busbw_gbps for m in measurements}


@dataclass
class _Candidate:
    env: dict[str, str]  # without NCCL_TOPO_FILE
    topology_file: bool
    label: str
    runs: list[dict[Key, float]] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)
    # node -> its pairs (each trial with the defaults' run of its round: decision.Evidence's units)
    units: dict[str, list[dict[Key, float]]] = field(default_factory=dict)


@dataclass
class _PerSize:
    """One per-size candidate's trials over the pool."""

    runs: list[list[Measurement]] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)
    by_node: dict[str, list[dict[Key, float]]] = field(default_factory=dict)  # node -> its trials' busbw


@dataclass
class Pool:
    baseline_runs: list[dict[Key, float]]
    candidates: dict[str, _Candidate]
    per_node: list[dict[str, Any]]
    profiles: set[str | None]
    backends: set[str]
    ranks_per_node: int
    policy: dict[str, str]  # carried by every candidate (TORCH_NCCL_ASYNC_ERROR_HANDLING), not swept
    baseline_measurements: list[list[Measurement]] = field(default_factory=list)  # what NCCL's log showed
    baseline_channels: list[int] = field(default_factory=list)  # the defaults' channel count, per trial logged
    per_size: dict[SizeCandidate, _PerSize] = field(default_factory=dict)
    baseline_by_node: dict[str, list[dict[Key, float]]] = field(default_factory=dict)


def _round_partner(trials: Sequence[Mapping[str, Any]], i: int) -> int | None:
    """The index of the defaults' trial that pairs with candidate trial `i` of one run (trials in
    the run's order): the next ok baseline trial (an interleaved round ends with the defaults),
    else the last one before it."""
    after = next((j for j in range(i + 1, len(trials)) if trials[j]["phase"] == "baseline"
                  and trials[j]["status"] == "ok"), None)
    if after is not None:
        return after
    return next((j for j in range(i - 1, -1, -1) if trials[j]["phase"] == "baseline"
                 and trials[j]["status"] == "ok"), None)


def pool(exports: Sequence[Export]) -> Pool:
    """All ok baseline, finalist and per-size trials of all nodes, the candidates keyed by
    environment, the per-size ones by candidate."""
    base: list[dict[Key, float]] = []
    base_by_node: dict[str, list[dict[Key, float]]] = {}
    base_measurements: list[list[Measurement]] = []
    base_channels: list[int] = []
    per_size: dict[SizeCandidate, _PerSize] = {}
    cands: dict[str, _Candidate] = {}
    per_node = []
    profiles: set[str | None] = set()
    backends: set[str] = set()
    nranks: dict[int, str] = {}
    policy: dict[str, tuple[str, str]] = {}  # name -> (value, where it was seen first)
    left_out: set[str] = set()  # candidates apply would refuse, each said once
    for e in exports:
        n_base = n_cand = 0
        for run in e.doc["runs"]:
            profiles.add(run["profile"])
            backends.add(run["backend"])
            if run["nranks"] is not None:
                nranks.setdefault(int(run["nranks"]), f"{e.path} run {run['id']}")
            trials = sorted(run["trials"], key=lambda t: int(t["seq"]))
            for i, t in enumerate(trials):
                if t["status"] != "ok":
                    continue
                measured = _measurements(t)
                values = _busbw(measured)
                if not values:
                    continue
                if t["phase"] == "baseline":
                    base.append(values)
                    base_by_node.setdefault(e.name, []).append(values)
                    base_measurements.append(measured)
                    if t.get("coll_channels"):
                        base_channels.append(int(t["coll_channels"]))
                    n_base += 1
                    continue
                for name in sorted(CARRIED - {TOPO_FILE}):
                    if name not in t["env"]:
                        continue
                    value, first_seen = policy.setdefault(name, (t["env"][name], f"{e.path} run {run['id']}"))
                    if value != t["env"][name]:
                        raise InputError(str(e.path), f"run {run['id']} trial {t['seq']}: {name}={t['env'][name]}, but "
                                         f"{first_seen} has {name}={value}",
                                         hint="sweep every node of the class with the same policy settings")
                size_cand = candidate_of_env(t["env"]) if str(t["label"]).startswith(TRIAL_LABEL) else None
                if size_cand is not None:
                    got = per_size.setdefault(size_cand, _PerSize())
                    got.runs.append(measured)
                    got.nodes.add(e.name)
                    got.by_node.setdefault(e.name, []).append(values)
                    n_cand += 1
                elif t["phase"] in CANDIDATE_PHASES and not any(v in t["env"] for v in TUNER_VARS):
                    env = {k: v for k, v in t["env"].items() if k != TOPO_FILE}
                    unfit = env_problem(env, f"{e.path} run {run['id']} trial {t['seq']}")
                    if unfit is not None:
                        # A candidate no node may publish is no class candidate: apply would refuse it.
                        if label_of(env) not in left_out:
                            left_out.add(label_of(env))
                            log.warning("a candidate left out of the class, `nccltune apply` would refuse it: %s",
                                        unfit.message)
                        continue
                    topo_file = TOPO_FILE in t["env"]
                    key = json.dumps([sorted(env.items()), topo_file])
                    cand = cands.setdefault(key, _Candidate(env, topo_file, label_of(t["env"])))
                    cand.runs.append(values)
                    cand.nodes.add(e.name)
                    partner = _round_partner(trials, i)
                    pair = log_ratios(values, _busbw(_measurements(trials[partner]))) if partner is not None else {}
                    cand.units.setdefault(e.name, [])
                    if pair:
                        cand.units[e.name].append(pair)
                    n_cand += 1
        per_node.append({"hostname": e.doc["hostname"], "topology_fingerprint": e.doc["topology_fingerprint"],
                         "export": e.path.name, "export_sha256": e.sha256,
                         "runs": [int(r["id"]) for r in e.doc["runs"]],
                         "baseline_trials": n_base, "candidate_trials": n_cand, "per_size": node_per_size(e.doc)})
    if len(nranks) > 1:
        raise InputError(", ".join(sorted(nranks.values())), f"runs with different numbers of ranks ({sorted(nranks)}) "
                         "do not measure the same job shape", hint="sweep every node with the same bench settings")
    ranks = next(iter(nranks)) if nranks else int(exports[0].doc["node_class"]["facts"]["gpu_count"]) or 1
    return Pool(base, cands, per_node, profiles, backends, ranks, {k: v for k, (v, _) in policy.items()},
                base_measurements, base_channels, per_size, base_by_node)


def job_shape(exports: Sequence[Export], ranks_per_node: int) -> dict[str, Any]:
    """The profile's job shape: the one every run of the exports measured (`ranks_per_node`, the
    pool's, for sweeps of a node's own ranks).

    A node's own sweep measured one node, and every node of the class publishing the same values is
    what makes it safe for jobs of any number of these nodes. A sweep over several nodes (or
    through the NICs) measured one job shape: its profile is for that shape alone.

    Raises:
        InputError: runs of different shapes, naming two of them and where they are (exit 78).
    """
    shapes: dict[str, tuple[dict[str, Any] | None, str]] = {}  # label -> (job, where first seen)
    for e in exports:
        for run in e.doc["runs"]:
            job = run.get("job")
            label = str(job["label"]) if job else f"1x{run['nranks'] or ranks_per_node}"
            shapes.setdefault(label, (job, f"{e.path} run {run['id']}"))
    if len(shapes) > 1:
        (a, (_, where_a)), (b, (_, where_b)) = list(shapes.items())[:2]
        raise InputError(where_b, f"runs of different job shapes ({a} in {where_a}, {b} here) do not measure the "
                         "same job", hint="decide each shape from its own exports (nccltune export --run ID), or "
                         "a part per node count with --parts")
    job = next(iter(shapes.values()))[0] if shapes else None
    if job is None:
        return {"ranks_per_node": ranks_per_node, "measured_nnodes": 1, "min_nnodes": 1, "max_nnodes": None,
                "label": f"1x{ranks_per_node}", "loopback": False}
    nnodes = int(job["nnodes"])
    return {"ranks_per_node": int(job["ranks_per_node"]), "measured_nnodes": nnodes, "min_nnodes": nnodes,
            "max_nnodes": nnodes, "label": str(job["label"]), "loopback": bool(job["loopback"])}


def node_per_size(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One node's own numbers: for NCCL's defaults and for each candidate it measured, over the
    trials behind a setting's number on the node itself (compare.trial_setting: the baseline
    trials, the finalist trials as `pool` counts them; the ok ones, their correct results), the
    median bus bandwidth and the noise per collective and size, a candidate named by its variables
    and whether it carried the topology file. The class's distribution across its nodes, which the
    daemon's verify compares a node with, is made of these."""
    runs: dict[tuple[str, bool], list[dict[tuple[str, int], float]]] = {}
    for run in doc["runs"]:
        for t in run["trials"]:
            which = trial_setting(str(t["phase"]), str(t["label"]))
            if t["status"] != "ok" or which is None:
                continue
            values = _busbw(_measurements(t))
            if not values:
                continue
            setting = ((DEFAULTS_LABEL, False) if which == DEFAULTS_LABEL
                       else (label_of(t["env"]), TOPO_FILE in t["env"]))
            runs.setdefault(setting, []).append(values)
    out = []
    for (label, topo_file), samples in sorted(runs.items()):
        for (collective, size), st in sorted(size_stats(samples).items()):
            out.append({"setting": label, "topology_file": topo_file, "collective": collective, "size_bytes": size,
                        "samples": st.n, "median_busbw_gbps": round(st.median, 4), "noise_pct": round(st.noise_pct, 3)})
    return out


# A profile stays the same size whatever the class's size: the class's distribution per setting,
# collective and size is kept as a summary (class_per_size: what the outlier rule reads), and
# per-node detail for at most this many nodes: all of a small class, the lowest ones of a large one.
MAX_NODE_ENTRIES = 16


def class_per_size(per_node: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The class's distribution across its nodes, per setting, collective and size, from each node's
    own numbers (node_per_size): how many nodes measured it, the median of their medians, the lowest
    median and its node, and the median of their noise. Exactly what fleet.outlier judges a node with."""
    groups: dict[tuple[str, bool, str, int], list[tuple[float, float, str]]] = {}
    for node in per_node:
        for r in node.get("per_size", []):
            key = (str(r["setting"]), bool(r["topology_file"]), str(r["collective"]), int(r["size_bytes"]))
            groups.setdefault(key, []).append((float(r["median_busbw_gbps"]), float(r["noise_pct"]),
                                               str(node["hostname"])))
    rows = []
    for (setting, topology_file, collective, size), values in sorted(groups.items()):
        lowest = min(values, key=lambda v: (v[0], v[2]))
        rows.append({"setting": setting, "topology_file": topology_file, "collective": collective,
                     "size_bytes": size, "nodes": len(values),
                     "median_busbw_gbps": round(statistics.median(v[0] for v in values), 4),
                     "lowest_busbw_gbps": lowest[0], "lowest_node": lowest[2],
                     "noise_pct": round(statistics.median(v[1] for v in values), 4)})
    return rows


def bounded_nodes(per_node: Sequence[Mapping[str, Any]], summary: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The per-node entries a profile keeps: every node, with its own numbers, of a class of up to
    MAX_NODE_ENTRIES nodes; of a larger one the MAX_NODE_ENTRIES nodes lowest at the most sizes
    (ties by name), without their numbers (class_per_size holds the distribution)."""
    if len(per_node) <= MAX_NODE_ENTRIES:
        return [dict(n) for n in per_node]
    lowest_at: dict[str, int] = {}
    for row in summary:
        lowest_at[row["lowest_node"]] = lowest_at.get(row["lowest_node"], 0) + 1
    ranked = sorted(per_node, key=lambda n: (-lowest_at.get(str(n["hostname"]), 0), str(n["hostname"])))
    return [{k: v for k, v in n.items() if k != "per_size"} for n in ranked[:MAX_NODE_ENTRIES]]


def _size_doc(st: SizeStats, base: SizeStats | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"collective": st.collective, "size_bytes": st.size_bytes, "samples": st.n,
                           "median_busbw_gbps": round(st.median, 4),
                           "low_busbw_gbps": round(st.low, 4), "high_busbw_gbps": round(st.high, 4),
                           "noise_pct": round(st.noise_pct, 3)}
    if base is not None and base.median > 0:
        doc["ratio"] = round(st.median / base.median, 4)
    return doc


# The outlier rule at decide time: a node whose own defaults are far from its class's is left out
# of the pool (a broken link, a throttled GPU, a mis-set BIOS: it measures that node, not the class).
OUTLIER_MIN_NODES = 3  # with two nodes nothing says which one is off
OUTLIER_MIN_PCT = 10.0  # never flag a node within this of the class's median node ...
OUTLIER_SPREAD = 4.0  # ... nor within this many robust standard deviations of the class's nodes


@dataclass(frozen=True)
class Outlier:
    hostname: str
    export: str
    ratio: float  # the node's defaults over the class's median node, profile-weighted (geometric)
    sizes: list[tuple[Key, float]]  # the weighted keys where the node alone is beyond OUTLIER_MIN_PCT

    def doc(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "export": self.export, "ratio": round(self.ratio, 4),
                "sizes": [{"collective": c, "size_bytes": sz, "ratio": round(r, 4)} for (c, sz), r in self.sizes]}


def find_outliers(exports: Sequence[Export], pooled: Pool, weights: Mapping[Key, float]) -> list[Outlier]:
    """The nodes far from their class on NCCL's defaults themselves: the profile-weighted geometric
    mean of a node's median over the class's median node (per key, the median of the nodes' medians)
    more than OUTLIER_MIN_PCT away and more than OUTLIER_SPREAD robust standard deviations (1.4826
    times the median absolute deviation of the nodes' log ratios) from the class's median node.
    Needs OUTLIER_MIN_NODES nodes."""
    medians = {name: {k: statistics.median(r[k] for r in runs if k in r) for k in {k for r in runs for k in r}}
               for name, runs in pooled.baseline_by_node.items()}
    if len(medians) < OUTLIER_MIN_NODES:
        return []
    keys = [k for k, w in weights.items() if w > 0]
    centre = {k: statistics.median(m[k] for m in medians.values() if k in m) for k in keys
              if any(k in m for m in medians.values())}
    scores: dict[str, float] = {}
    for name, m in medians.items():
        terms = [(weights[k], math.log(m[k] / centre[k])) for k in keys if k in m and k in centre
                 and m[k] > 0 and centre[k] > 0]
        total = sum(w for w, _x in terms)
        if total > 0:
            scores[name] = sum(w * x for w, x in terms) / total
    if len(scores) < OUTLIER_MIN_NODES:
        return []
    mid = statistics.median(scores.values())
    spread = 1.4826 * statistics.median(abs(x - mid) for x in scores.values())
    bar = max(math.log1p(OUTLIER_MIN_PCT / 100.0), OUTLIER_SPREAD * spread)
    by_name = {e.name: e for e in exports}
    out = []
    for name, score in sorted(scores.items()):
        if abs(score - mid) <= bar:
            continue
        e = by_name[name]
        sizes = [(k, medians[name][k] / centre[k]) for k in keys if k in medians[name] and k in centre
                 and abs(math.log(medians[name][k] / centre[k])) > math.log1p(OUTLIER_MIN_PCT / 100.0)]
        out.append(Outlier(str(e.doc["hostname"]), e.path.name, math.exp(score - mid), sorted(sizes)))
    return out


def _weights(rules: Rules, baseline: Mapping[Key, SizeStats]) -> dict[Key, float]:
    """The profile's weight per (collective, size), each collective over its own measured sizes, as
    a node's sweep weighs them (sweep.profiles.weights).

    Raises:
        UsageError: a profile neither built in nor in this config's sweep.profiles (exit 2).
    """
    out: dict[Key, float] = {}
    for collective in dict.fromkeys(c for c, _s in sorted(baseline)):
        sizes = sorted(s for c, s in baseline if c == collective)
        try:
            got = profiles.weights(rules.profile, sizes, rules.custom_profiles)
        except KeyError:
            raise UsageError(f"profile {rules.profile!r} is neither built in ({', '.join(profiles.BUILTIN)}) nor in "
                             "this config's sweep.profiles") from None
        out.update({k: w for k, w in got.items() if k[0] == collective})
    return out


def _table(pooled: Pool, baseline: Mapping[Key, SizeStats], rules: Rules,
           all_nodes: set[str], nnodes: int = 1) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The class's tuner table entries and their evidence, from the pooled per-size trials through
    the node's own per-size choice: for one node of the class, or for the `nnodes` nodes of the job
    shape the exports measured (the plugin applies an entry only to a communicator of its shape)."""
    order = profiles.collectives_of(rules.profile, rules.custom_profiles)
    measured = {c for c, _s in baseline}
    collectives = [c for c in order if c in measured and c in STEERED]
    # The profile names the table's collectives as its rows do, in NCCL's spelling (table_collective).
    evidence: dict[str, Any] = {"collectives": [nccl_name(c) for c in collectives], "default_channels": None,
                                "candidates": [], "wins": [], "notes": []}
    if not pooled.per_size:
        evidence["status"] = "no per-size trials in the exports (the nodes' sweeps had no tuner table)"
        return [], evidence
    if not collectives:
        evidence["status"] = "no measured collective of the profile is steered by a tuner"
        return [], evidence
    counted: list[tuple[SizeCandidate, list[list[Measurement]]]] = []
    for cand, got in sorted(pooled.per_size.items(), key=lambda kv: kv[0].label):
        ok = got.nodes == all_nodes
        evidence["candidates"].append({"label": cand.label, "env": cand.env(), "nodes": len(got.nodes),
                                       "samples": len(got.runs), "counted": ok})
        if ok:
            counted.append((cand, got.runs))
    channels = sorted(set(pooled.baseline_channels))
    default_channels = channels[0] if len(channels) == 1 else None
    if len(channels) > 1:
        evidence["notes"].append(f"the defaults used different channel counts on the nodes "
                                 f"({', '.join(map(str, channels))}): channel candidates are not placed")
    elif not channels and any(cand.channels for cand, _runs in counted):
        evidence["notes"].append("the exports do not give the defaults' channel count (older exports, or NCCL's "
                                 "log not read): channel candidates are not placed")
    evidence["default_channels"] = default_channels
    def pairs(cand: SizeCandidate, collective: str) -> dict[int, decision.Evidence[int]]:
        """Per size, the candidate's run on each node against that node's runs of the defaults."""
        def of(runs: Sequence[Mapping[Key, float]]) -> list[dict[int, float]]:
            return [{sz: v for (c, sz), v in run.items() if c == collective} for run in runs]
        units: dict[str, tuple[Mapping[int, float], ...]] = {
            node: against_mean(of(runs), of(pooled.baseline_by_node.get(node, [])))
            for node, runs in pooled.per_size[cand].by_node.items()}
        sizes = sorted({sz for blocks in units.values() for b in blocks for sz in b})
        return {sz: decision.evidence({node: [{sz: b[sz]} for b in blocks if sz in b]
                                       for node, blocks in units.items()}) for sz in sizes}

    choice = choose_table(table_inputs(collectives, baseline, counted, pooled.baseline_measurements, pairs=pairs),
                          default_channels=default_channels, min_gain_pct=rules.min_gain_pct,
                          max_regression_pct=rules.max_regression_pct, allow_raise=False, no_raise_reason=NO_RAISE,
                          final=True)
    evidence["wins"] = _wins_doc(choice)
    evidence["notes"].extend(choice.notes)
    entries = table_entries(choice, nranks=pooled.ranks_per_node * nnodes, nnodes=nnodes)
    evidence["status"] = (f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} from {len(counted)} per-size "
                          f"candidate(s) measured on every node")
    return [{"collective": e.collective, "min_bytes": e.min_bytes, "max_bytes": e.max_bytes, "nnodes": e.nnodes,
             "nranks": e.nranks, "ranks_per_node": e.ranks_per_node, "algo": e.algo, "proto": e.proto,
             "channels": e.channels or None} for e in entries], evidence


def _wins_doc(choice: TableChoice) -> list[dict[str, Any]]:
    return [{"collective": nccl_name(part.collective), "size_bytes": w.size_bytes, "label": w.candidate.label,
             "ratio": round(w.ratio, 4), "reason": w.reason}
            for part in choice.parts for _s, w in sorted(part.wins.items())]


def decide(exports: Sequence[Export], rules: Rules, *, now: _dt.datetime | None = None,
           by_node_count: bool = False) -> dict[str, Any]:
    """The class profile document for these exports (already checked by load_exports): one section
    per NCCL version and, `by_node_count`, one part per measured node count, each decided by
    decide_group from its own runs alone (fleet/parts.py); without it, runs of different job
    shapes are refused.

    Raises:
        InputError: no ok baseline trial in a group's exports, runs of different job shapes (by
            node count: of different ranks per node, or NIC loopback beside other runs). Exit 78.
    """
    return decide_parts(exports, rules, decide_group, now=now, by_node_count=by_node_count)


def decide_group(exports: Sequence[Export], rules: Rules, *, now: _dt.datetime | None = None) -> dict[str, Any]:
    """The class profile document for exports of one NCCL version and one job shape.

    Raises:
        InputError: no ok baseline trial in any export (exit 78).
    """
    pooled = pool(exports)
    if not pooled.baseline_runs:
        raise InputError(str(exports[0].path), "no ok baseline trial in any export: nothing to compare with",
                         hint="export nodes after a finished sweep")
    weights = _weights(rules, size_stats(pooled.baseline_runs))
    outliers = find_outliers(exports, pooled, weights)
    if outliers:
        left_out = {o.export for o in outliers}
        for o in outliers:
            log.warning("%s: NCCL's defaults at x%.3f of the class's median node: left out of the pool", o.hostname,
                        o.ratio)
        exports = [e for e in exports if e.path.name not in left_out]
        pooled = pool(exports)
    baseline = size_stats(pooled.baseline_runs)
    keys = sorted(baseline)
    weights = _weights(rules, baseline)
    all_nodes = {e.name for e in exports}
    rule = decision.Rule(rules.min_gain_pct, rules.max_regression_pct)
    judged: list[tuple[_Candidate, Verdict[Key] | None, dict[Key, SizeStats], str]] = []
    family: dict[str, decision.Evidence[Key]] = {}
    for key in sorted(pooled.candidates):
        cand = pooled.candidates[key]
        if cand.nodes == all_nodes:
            family[key] = decision.evidence(cand.units)
    verdicts = decision.holm(family, weights, rule)
    for key in sorted(pooled.candidates):
        cand = pooled.candidates[key]
        stats = size_stats(cand.runs)
        if key not in verdicts:
            judged.append((cand, None, stats, f"measured on {len(cand.nodes)} of {len(all_nodes)} node(s); "
                                              "a class choice needs every node's samples"))
            continue
        judged.append((cand, verdicts[key], stats, verdicts[key].reason))
    # As the node's own sweep chooses: the best eligible candidate by its estimated gain (the
    # topology file alone included: it too is published on a gain only).
    eligible = [(c, v) for c, v, _s, _r in judged if v is not None and v.eligible]
    chosen: tuple[_Candidate, Verdict[Key]] | None = None
    if eligible:
        chosen = max(eligible, key=lambda cv: cv[1].gain_pct)
    first = exports[0].doc
    facts = first["node_class"]["facts"]
    if len(pooled.backends) > 1:
        raise InputError(str(exports[0].path), f"runs of different backends ({', '.join(sorted(pooled.backends))})")
    if chosen is None:
        verdict_text = "no candidate beat NCCL's defaults on the pooled samples; the class keeps the defaults"
    else:
        verdict_text = f"{chosen[0].label}: {chosen[1].reason}"
    if outliers:
        verdict_text += (f" ({len(outliers)} node(s) left out of the pool, far from the class on NCCL's defaults: "
                         + ", ".join(f"{o.hostname} x{o.ratio:.3f}" for o in outliers) + ")")
    shape = job_shape(exports, pooled.ranks_per_node)
    tuner_table, table_evidence = _table(pooled, baseline, rules, all_nodes, int(shape["measured_nnodes"]))
    if first["demo"]:
        table_evidence["notes"].append("CPU demo: computed from gloo trials, which NCCL's tuner never steers; "
                                       "`nccltune apply` does not publish it")
    created = (now or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds")
    summary = class_per_size(pooled.per_node)
    return {
        "kind": PROFILE_KIND,
        "schema_version": PROFILE_SCHEMA_VERSION,
        "node_class": first["node_class"],
        # The policy variables go with the defaults too, as a node's own sweep publishes them.
        "env": dict(sorted({**pooled.policy, **(chosen[0].env if chosen else {})}.items())),
        "topology_file": bool(chosen and chosen[0].topology_file),
        "chosen": chosen[0].label if chosen else DEFAULTS_LABEL,
        "demo": bool(first["demo"]),
        "backend": next(iter(pooled.backends)) if pooled.backends else "nccl",
        "job_shape": shape,
        "versions": {"nccltune": __version__, "nccl": facts.get("nccl_version"), "driver": facts.get("driver_version"),
                     "exporters": sorted({e.doc["versions"]["nccltune"] for e in exports})},
        "evidence": {
            "node_count": len(pooled.per_node),
            "outliers": [o.doc() for o in outliers],
            "outlier_rule": (f"left out: a node whose defaults, profile-weighted, are more than {OUTLIER_MIN_PCT:g}% "
                             f"and more than {OUTLIER_SPREAD:g} robust standard deviations from the class's median "
                             f"node (with {OUTLIER_MIN_NODES} nodes or more)"),
            "trials": {"baseline": sum(int(n["baseline_trials"]) for n in pooled.per_node),
                       "candidate": sum(int(n["candidate_trials"]) for n in pooled.per_node)},
            # Names the set of exports decided from, whatever part of it `nodes` lists.
            "exports_sha256": hashlib.sha256("\n".join(sorted(n["export_sha256"] for n in pooled.per_node))
                                             .encode()).hexdigest(),
            "class_per_size": summary,
            "nodes": bounded_nodes(pooled.per_node, summary),
            "rules": {"profile": rules.profile, "min_gain_pct": rules.min_gain_pct,
                      "max_regression_pct": rules.max_regression_pct,
                      "weights": {f"{c}:{s}": w for (c, s), w in sorted(weights.items())}},
            "baseline": [_size_doc(baseline[k]) for k in keys],
            "candidates": [
                {"label": c.label, "env": dict(sorted(c.env.items())), "topology_file": c.topology_file,
                 "nodes": len(c.nodes), "eligible": bool(v and v.eligible), "reason": reason,
                 "gain_pct": None if v is None else round(v.gain_pct, 3),
                 "lower_gain_pct": None if v is None or v.lower_pct is None else round(v.lower_pct, 3),
                 "confidence_pct": None if v is None else round(v.confidence_pct, 3),
                 "pairs": 0 if v is None else v.pairs,
                 "status": "not judged" if v is None else v.status,
                 "per_size": [_size_doc(st, baseline.get(k)) for k, st in sorted(stats.items())]}
                for c, v, stats, reason in judged
            ],
            "verdict": verdict_text,
            "table": table_evidence,
        },
        "provenance": {"created_by": "nccltune fleet decide", "created_at": created, "nccltune_version": __version__},
        "tuner_table": tuner_table,
    }


def profile_gains(profile: Mapping[str, Any]) -> dict[str, float]:
    """The chosen candidate's median ratio per collective and size ("64MiB" for all_reduce,
    "all_gather 64MiB" for another -> 1.12), for the publish header, as a node's sweep names them."""
    for cand in profile["evidence"]["candidates"]:
        if cand["label"] == profile["chosen"] and cand["eligible"]:
            return {key_label((str(s.get("collective", ALL_REDUCE)), int(s["size_bytes"]))): float(s["ratio"])
                    for s in cand["per_size"] if "ratio" in s}
    return {}


def dumps_profile(doc: Mapping[str, Any]) -> str:
    """The profile as JSON, never what `apply` refuses: no NaN or Infinity (not JSON), no value it
    would not publish (fleet.values, the check apply makes), no more bytes than a published set
    keeps in force (publish.policy.MAX_PROFILE_BYTES).

    Raises:
        InputError: a number of the profile is not finite (exports are read without them), a value
            or bound apply refuses, or a profile too large (exit 78).
    """
    try:
        text = json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as exc:
        raise InputError("fleet decide", f"the profile would hold a number JSON cannot carry ({exc})",
                         hint="the exports' measurements must be finite numbers") from None
    try:
        check_values(doc, "fleet decide: the profile")
    except InputError as exc:
        raise InputError(exc.path, exc.message.removeprefix(f"{exc.path}: "),
                         hint="`nccltune apply` would refuse it; sweep the nodes with values every node may "
                         "publish") from None
    size = len(text.encode("utf-8"))
    if size > MAX_PROFILE_BYTES:
        raise InputError("fleet decide", f"the profile would be {size} bytes; a published set keeps at most "
                         f"{MAX_PROFILE_BYTES} in force", hint="decide from fewer runs (nccltune export --run ID)")
    return text


def rules_from(profile: str | None, runs_profiles: set[str | None], *, min_gain_pct: float,
               max_regression_pct: float, custom: profiles.Custom) -> Rules:
    """The choice rules: the objective the nodes swept for (or the one asked for), the thresholds
    of this config.

    Raises:
        UsageError: the nodes swept for different objectives and none was given (exit 2).
    """
    if profile is None:
        named = {p or "balanced" for p in runs_profiles}
        if len(named) > 1:
            raise UsageError(f"the exports were swept for different objectives ({', '.join(sorted(named))}); "
                             "choose one with --profile")
        profile = named.pop() if named else "balanced"
    return Rules(profile, min_gain_pct, max_regression_pct, custom)
