"""`nccltune fleet decide`: one environment for every node of one class, from all their sweeps.

The exports of the nodes of one class are pooled: every ok baseline trial of every node is one
sample of NCCL's defaults, every ok finalist trial one sample of its candidate, per size. The
pooled samples then go through the same rules a node's own sweep applies
(nccltune.sweep.select.judge: the per-size gain beyond the noise, the veto of the medians, the
largest allowed regression), so a class profile is what the sweep would have chosen had it
measured all the nodes itself.

A candidate counts only when every node of the pool measured it: comparing one node's candidate
with every node's defaults would judge the node, not the candidate.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import InputError, UsageError
from ..inputfile import read_input_file
from ..sweep.select import SizeStats, Verdict, fmt_size, judge, profile_weights, size_stats
from ..sweep.strategy import CARRIED, TOPO_ONLY, label_of
from ..topology.nodeclass import class_id_of, describe_difference
from .export import EXPORT_KIND
from .schema import SchemaViolation, load_schema, validate

log = logging.getLogger(__name__)

PROFILE_KIND = "nccltune-class-profile"
PROFILE_SCHEMA_VERSION = 1
TOPO_FILE = "NCCL_TOPO_FILE"
# Phases whose trials are repeated measurements of one candidate; screening runs are single
# shots taken against a fixed baseline median and are left to the node that took them.
CANDIDATE_PHASES = ("final",)
# A profile's `chosen` when the class keeps NCCL's defaults, and the setting of the baseline trials.
DEFAULTS = "NCCL defaults"
# Far above any real export or profile (a few MiB), far below what would exhaust memory.
MAX_DOCUMENT_BYTES = 64 << 20


@dataclass(frozen=True)
class Export:
    path: Path
    doc: dict[str, Any]
    sha256: str

    @property
    def class_id(self) -> str:
        return str(self.doc["node_class"]["id"])

    @property
    def name(self) -> str:
        return f"{self.doc['hostname']} ({self.path.name})"


def read_json_document(path: Path, schema_name: str, kind: str) -> tuple[dict[str, Any], bytes]:
    """Parse and validate one document against its schema.

    Raises:
        InputError: unreadable, not JSON (with its line), another kind, or an element the
            schema does not allow (named by its JSON path). Exit 78.
    """
    try:
        # Bounded, regular files only: a FIFO or /dev/zero given as a document must not hang.
        raw = read_input_file(path, MAX_DOCUMENT_BYTES, f"{kind} document")
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror}") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(str(path), f"not UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise InputError(str(path), f"not valid JSON: {exc.msg}", line=exc.lineno) from exc
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        got = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise InputError(str(path), f"not an {kind} document (kind is {got!r})")
    try:
        validate(doc, load_schema(schema_name))
    except SchemaViolation as exc:
        raise InputError(str(path), f"{exc.where}: {exc.detail}",
                         hint=f"the format is schemas/{schema_name}.schema.json") from exc
    cls = doc["node_class"]
    if class_id_of(cls["facts"]) != cls["id"]:
        # An edited fact with the old id would pass for the class it no longer describes.
        raise InputError(str(path), f"$.node_class.id: {cls['id']} is not the id of $.node_class.facts "
                         f"({class_id_of(cls['facts'])})", hint="regenerate the document rather than editing it")
    return doc, raw


def load_exports(paths: Sequence[Path]) -> list[Export]:
    """Read every export and check they describe distinct nodes of one class.

    Raises:
        InputError: a malformed export, the same node twice, demo and GPU measurements mixed, or
            exports of different classes (the reason names the facts that differ). Exit 78.
    """
    if not paths:
        raise UsageError("nccltune fleet decide: give at least one export")
    exports = []
    for p in paths:
        doc, raw = read_json_document(p, "export", EXPORT_KIND)
        exports.append(Export(p, doc, hashlib.sha256(raw).hexdigest()))
    first = exports[0]
    seen: dict[tuple[str, str], Path] = {}
    for e in exports:
        key = (e.doc["hostname"], e.doc["topology_fingerprint"])
        if key in seen:
            raise InputError(str(e.path), f"the same node as {seen[key]} (hostname {key[0]}, topology {key[1]})",
                             hint="each node's samples may count once")
        seen[key] = e.path
        if e.doc["demo"] != first.doc["demo"]:
            raise InputError(str(e.path), f"demo is {e.doc['demo']}, but {first.path} has {first.doc['demo']}",
                             hint="CPU demo measurements and GPU measurements do not pool")
        if e.class_id != first.class_id:
            why = describe_difference(first.doc["node_class"]["facts"], e.doc["node_class"]["facts"],
                                      a_name=first.path.name, b_name=e.path.name)
            raise InputError(str(e.path), f"node class {e.class_id} differs from {first.path}'s {first.class_id}: "
                             f"{why}", hint="decide each class from the exports of its own nodes")
    return exports


def _busbw(trial: Mapping[str, Any]) -> dict[int, float]:
    return {int(m["size_bytes"]): float(m["busbw_gbps"]) for m in trial["measurements"] if m["correct"]}


@dataclass
class _Candidate:
    env: dict[str, str]  # without NCCL_TOPO_FILE
    topology_file: bool
    label: str
    runs: list[dict[int, float]] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)


@dataclass
class Pool:
    baseline_runs: list[dict[int, float]]
    candidates: dict[str, _Candidate]
    per_node: list[dict[str, Any]]
    profiles: set[str | None]
    backends: set[str]
    ranks_per_node: int
    policy: dict[str, str]  # carried by every candidate (TORCH_NCCL_ASYNC_ERROR_HANDLING), not swept


def pool(exports: Sequence[Export]) -> Pool:
    """All ok baseline and finalist trials of all nodes, the candidates keyed by environment."""
    base: list[dict[int, float]] = []
    cands: dict[str, _Candidate] = {}
    per_node = []
    profiles: set[str | None] = set()
    backends: set[str] = set()
    nranks: dict[int, str] = {}
    policy: dict[str, tuple[str, str]] = {}  # name -> (value, where it was seen first)
    for e in exports:
        n_base = n_cand = 0
        for run in e.doc["runs"]:
            profiles.add(run["profile"])
            backends.add(run["backend"])
            if run["nranks"] is not None:
                nranks.setdefault(int(run["nranks"]), f"{e.path} run {run['id']}")
            for t in run["trials"]:
                if t["status"] != "ok":
                    continue
                values = _busbw(t)
                if not values:
                    continue
                if t["phase"] == "baseline":
                    base.append(values)
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
                if t["phase"] in CANDIDATE_PHASES:
                    env = {k: v for k, v in t["env"].items() if k != TOPO_FILE}
                    topo_file = TOPO_FILE in t["env"]
                    key = json.dumps([sorted(env.items()), topo_file])
                    cand = cands.setdefault(key, _Candidate(env, topo_file, label_of(t["env"])))
                    cand.runs.append(values)
                    cand.nodes.add(e.name)
                    n_cand += 1
        per_node.append({"hostname": e.doc["hostname"], "topology_fingerprint": e.doc["topology_fingerprint"],
                         "export": e.path.name, "export_sha256": e.sha256,
                         "runs": [int(r["id"]) for r in e.doc["runs"]],
                         "baseline_trials": n_base, "candidate_trials": n_cand, "per_size": node_per_size(e.doc)})
    if len(nranks) > 1:
        raise InputError(", ".join(sorted(nranks.values())), f"runs with different numbers of ranks ({sorted(nranks)}) "
                         "do not measure the same job shape", hint="sweep every node with the same bench settings")
    ranks = next(iter(nranks)) if nranks else int(exports[0].doc["node_class"]["facts"]["gpu_count"]) or 1
    return Pool(base, cands, per_node, profiles, backends, ranks, {k: v for k, (v, _) in policy.items()})


def node_per_size(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One node's own numbers: for NCCL's defaults (its baseline trials) and for each candidate
    it measured (its finalist trials, as `pool` counts them), the median bus bandwidth and the
    noise per collective and size. The class's distribution across its nodes, which the
    daemon's verify compares a node with, is made of these."""
    runs: dict[tuple[str, bool], list[dict[tuple[str, int], float]]] = {}
    for run in doc["runs"]:
        for t in run["trials"]:
            if t["status"] != "ok" or (t["phase"] != "baseline" and t["phase"] not in CANDIDATE_PHASES):
                continue
            values = {(str(m.get("collective", "all_reduce")), int(m["size_bytes"])): float(m["busbw_gbps"])
                      for m in t["measurements"] if m["correct"]}
            if not values:
                continue
            setting = (DEFAULTS, False) if t["phase"] == "baseline" else (label_of(t["env"]), TOPO_FILE in t["env"])
            runs.setdefault(setting, []).append(values)
    out = []
    for (label, topo_file), samples in sorted(runs.items()):
        for (collective, size), st in sorted(size_stats(samples).items()):
            out.append({"setting": label, "topology_file": topo_file, "collective": collective, "size_bytes": size,
                        "samples": st.n, "median_busbw_gbps": round(st.median, 4), "noise_pct": round(st.noise_pct, 3)})
    return out


def _size_doc(st: SizeStats, base: SizeStats | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"size_bytes": st.size_bytes, "samples": st.n, "median_busbw_gbps": round(st.median, 4),
                           "low_busbw_gbps": round(st.low, 4), "high_busbw_gbps": round(st.high, 4),
                           "noise_pct": round(st.noise_pct, 3)}
    if base is not None and base.median > 0:
        doc["ratio"] = round(st.median / base.median, 4)
    return doc


@dataclass(frozen=True)
class Rules:
    profile: str
    min_gain_pct: float
    max_regression_pct: float
    custom_profiles: Mapping[str, Mapping[int, float]] = field(default_factory=dict)


def decide(exports: Sequence[Export], rules: Rules, *, now: _dt.datetime | None = None) -> dict[str, Any]:
    """The class profile document for these exports (already checked by load_exports).

    Raises:
        InputError: no ok baseline trial in any export (exit 78).
    """
    pooled = pool(exports)
    if not pooled.baseline_runs:
        raise InputError(str(exports[0].path), "no ok baseline trial in any export: nothing to compare with",
                         hint="export nodes after a finished sweep")
    baseline = size_stats(pooled.baseline_runs)
    sizes = sorted(baseline)
    weights = profile_weights(rules.profile, sizes, rules.custom_profiles)
    all_nodes = {e.name for e in exports}
    judged: list[tuple[_Candidate, Verdict[int] | None, dict[int, SizeStats], str]] = []
    for key in sorted(pooled.candidates):
        cand = pooled.candidates[key]
        stats = size_stats(cand.runs)
        if cand.nodes != all_nodes:
            judged.append((cand, None, stats, f"measured on {len(cand.nodes)} of {len(all_nodes)} node(s); "
                                              "a class choice needs every node's samples"))
            continue
        topo_only = cand.label == TOPO_ONLY
        verdict = judge(stats, baseline, weights, min_gain_pct=rules.min_gain_pct,
                        max_regression_pct=rules.max_regression_pct, require_gain=not topo_only)
        judged.append((cand, verdict, stats, verdict.reason))
    # As the node's own sweep chooses: the best eligible candidate by the gain of its medians,
    # the topology file alone only when nothing else qualifies.
    eligible = [(c, v) for c, v, _s, _r in judged if v is not None and v.eligible and c.label != TOPO_ONLY]
    topo = [(c, v) for c, v, _s, _r in judged if v is not None and v.eligible and c.label == TOPO_ONLY]
    chosen: tuple[_Candidate, Verdict[int]] | None = None
    if eligible:
        chosen = max(eligible, key=lambda cv: cv[1].gain_pct)
    elif topo:
        chosen = topo[0]
    first = exports[0].doc
    facts = first["node_class"]["facts"]
    if len(pooled.backends) > 1:
        raise InputError(str(exports[0].path), f"runs of different backends ({', '.join(sorted(pooled.backends))})")
    if chosen is None:
        verdict_text = "no candidate beat NCCL's defaults on the pooled samples; the class keeps the defaults"
    else:
        verdict_text = f"{chosen[0].label}: {chosen[1].reason}"
    created = (now or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds")
    return {
        "kind": PROFILE_KIND,
        "schema_version": PROFILE_SCHEMA_VERSION,
        "node_class": first["node_class"],
        # The policy variables go with the defaults too, as a node's own sweep publishes them.
        "env": dict(sorted({**pooled.policy, **(chosen[0].env if chosen else {})}.items())),
        "topology_file": bool(chosen and chosen[0].topology_file),
        "chosen": chosen[0].label if chosen else "NCCL defaults",
        "demo": bool(first["demo"]),
        "backend": next(iter(pooled.backends)) if pooled.backends else "nccl",
        # Measured on one node at a time; every node of the class publishing the same values is
        # what makes the profile safe for jobs of any number of these nodes.
        "job_shape": {"ranks_per_node": pooled.ranks_per_node, "measured_nnodes": 1, "min_nnodes": 1,
                      "max_nnodes": None},
        "versions": {"nccltune": __version__, "nccl": facts.get("nccl_version"), "driver": facts.get("driver_version"),
                     "exporters": sorted({e.doc["versions"]["nccltune"] for e in exports})},
        "evidence": {
            "nodes": pooled.per_node,
            "rules": {"profile": rules.profile, "min_gain_pct": rules.min_gain_pct,
                      "max_regression_pct": rules.max_regression_pct,
                      "weights": {str(s): w for s, w in sorted(weights.items())}},
            "baseline": [_size_doc(baseline[s]) for s in sizes],
            "candidates": [
                {"label": c.label, "env": dict(sorted(c.env.items())), "topology_file": c.topology_file,
                 "nodes": len(c.nodes), "eligible": bool(v and v.eligible), "reason": reason,
                 "gain_pct": None if v is None else round(v.gain_pct, 3),
                 "robust_gain_pct": None if v is None else round(v.robust_gain_pct, 3),
                 "per_size": [_size_doc(st, baseline.get(s)) for s, st in sorted(stats.items())]}
                for c, v, stats, reason in judged
            ],
            "verdict": verdict_text,
        },
        "provenance": {"created_by": "nccltune fleet decide", "created_at": created, "nccltune_version": __version__},
        "tuner_table": [],
    }


def profile_gains(profile: Mapping[str, Any]) -> dict[str, float]:
    """The chosen candidate's median ratio per size ("64MiB" -> 1.12), for the publish header."""
    for cand in profile["evidence"]["candidates"]:
        if cand["label"] == profile["chosen"] and cand["eligible"]:
            return {fmt_size(int(s["size_bytes"])): float(s["ratio"]) for s in cand["per_size"] if "ratio" in s}
    return {}


def dumps_profile(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def rules_from(profile: str | None, runs_profiles: set[str | None], *, min_gain_pct: float,
               max_regression_pct: float, custom: Mapping[str, Mapping[int, float]]) -> Rules:
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
