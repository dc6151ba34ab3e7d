"""A class profile's parts by job shape and its sections by NCCL version.

The exports of one kind of node are split by the NCCL version each measured with (a class fact:
exports of classes that differ in it alone decide together) and, asked for (`by_node_count`,
`fleet decide --parts`), inside each version by the node count of each run's job shape (1 for a
node's own ranks, N for a sweep over N nodes); without it a version's runs must share one shape,
as a profile of one shape always needed. Each group
is decided on its own by decide.decide_group, the one decision rule of a node's sweep: only the
runs of that version and node count are evidence for that part, so 2.27 and 2.28 samples, or one
node's samples and a 2-node sweep's, are never pooled.

A profile of one group is what decide_group writes (schema_version 1). Otherwise (schema_version
2) each version is a section (`nccl_sections`): its `parts`, one per measured node count, each with
the environment decided for jobs of that shape; its safe part (`env`: the values every part chose
alike, for a job of any or of unknown size); its tuner table (every part's entries, each keyed by
its node count, as the plugin applies them). The profile's top level is the section of the newest
version, with the evidence of its smallest node count, so that a reader of one section (verify,
the note of `nccltune env`) reads it as before. `shape_envs` turns a section into what
publish.shapes.part_for_shape takes.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..errors import InputError
from ..names import DEFAULTS_LABEL
from .document import Export
from .rules import Rules

# decide.decide_group, handed in by decide.decide: the one rule, which lives above this module.
GroupRule = Callable[..., dict[str, Any]]  # (exports, rules, *, now) -> profile

SECTIONS_SCHEMA_VERSION = 2


def _run_shape(export: Export, run: Mapping[str, Any]) -> tuple[int, int, bool, str]:
    """(node count, ranks per node, NIC loopback, label) of one run's job shape."""
    job = run.get("job")
    if job:
        return int(job["nnodes"]), int(job["ranks_per_node"]), bool(job["loopback"]), str(job["label"])
    ranks = int(run["nranks"] or export.doc["node_class"]["facts"]["gpu_count"] or 1)
    return 1, ranks, False, f"1x{ranks}"


def check_one_job(exports: Sequence[Export]) -> None:
    """The parts of one profile differ in their node count alone: the same ranks per node, and no
    NIC loopback beside another shape (its numbers are for no job).

    Raises:
        InputError: naming two shapes and where they are (exit 78).
    """
    first: tuple[int, bool, str, str] | None = None
    for e in exports:
        for run in e.doc["runs"]:
            _n, ranks, loopback, label = _run_shape(e, run)
            where = f"{e.path} run {run['id']}"
            if first is None:
                first = (ranks, loopback, label, where)
            elif (ranks, loopback) != first[:2] or (loopback and label != first[2]):
                raise InputError(where, f"runs of different job shapes ({first[2]} in {first[3]}, {label} here) do "
                                 "not measure the same job", hint="a profile's parts differ in their node count "
                                 "alone; decide each other shape from its own exports (nccltune export --run ID)")


def nccl_of(export: Export) -> str | None:
    version = export.doc["node_class"]["facts"].get("nccl_version")
    return str(version) if version else None


def version_key(version: str | None) -> tuple[int, ...]:
    """Newest first when sorted in reverse; an unknown version last."""
    if not version:
        return (-1,)
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


def split(exports: Sequence[Export], by_node_count: bool) -> dict[str | None, dict[int, list[Export]]]:
    """NCCL version -> node count -> the exports of its runs, each export cut to those runs; not
    `by_node_count`, a version's runs are one group (key 0), whose shapes decide_group checks."""
    out: dict[str | None, dict[int, list[Export]]] = {}
    for e in exports:
        counts: dict[int, list[dict[str, Any]]] = {}
        for run in e.doc["runs"]:
            counts.setdefault(_run_shape(e, run)[0] if by_node_count else 0, []).append(run)
        for nnodes, runs in counts.items():
            out.setdefault(nccl_of(e), {}).setdefault(nnodes, []).append(replace(e, doc={**e.doc, "runs": runs}))
    return out


def _common(envs: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The variables every env sets to the same value."""
    first = envs[0]
    return {k: v for k, v in sorted(first.items()) if all(env.get(k) == v for env in envs[1:])}


def _part_doc(doc: Mapping[str, Any]) -> dict[str, Any]:
    evidence = doc["evidence"]
    return {"nnodes": doc["job_shape"]["measured_nnodes"], "job_shape": doc["job_shape"], "env": doc["env"],
            "topology_file": doc["topology_file"],
            "chosen": doc["chosen"], "node_count": evidence["node_count"], "trials": evidence["trials"],
            "verdict": evidence["verdict"], "table_status": evidence["table"]["status"],
            "candidates": [{k: c[k] for k in ("label", "eligible", "status", "gain_pct", "reason", "topology_file")}
                           for c in evidence["candidates"]]}


def _section(version: str | None, docs: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    parts = [_part_doc(docs[n]) for n in sorted(docs)]
    # One label for what the section publishes: a part's own where it has one part (verify finds
    # its candidate by it), NCCL's defaults where every part kept them (a published state of "defaults").
    chosen = (parts[0]["chosen"] if len(parts) == 1 else DEFAULTS_LABEL
              if all(p["chosen"] == DEFAULTS_LABEL for p in parts)
              else "; ".join(f"{p['nnodes']} node(s): {p['chosen']}" for p in parts))
    return {"nccl": version, "node_class": docs[min(docs)]["node_class"],
            "env": _common([p["env"] for p in parts]),
            # NCCL_TOPO_FILE is every job's (the publisher's own variable): only where every part chose it.
            "topology_file": all(p["topology_file"] for p in parts), "chosen": chosen, "parts": parts,
            "tuner_table": [e for n in sorted(docs) for e in docs[n]["tuner_table"]],
            "class_per_size": docs[min(docs)]["evidence"]["class_per_size"]}


def decide_parts(exports: Sequence[Export], rules: Rules, decide_group: GroupRule, *,
                 now: _dt.datetime | None = None, by_node_count: bool = False) -> dict[str, Any]:
    """The class profile of `exports` (see the module docstring): a part per node count only
    `by_node_count` (`fleet decide --parts`), else one part per version, of its runs' one shape;
    each group decided by `decide_group` (decide.decide_group, the one rule: decide.py calls this
    module and hands it the rule, so that this module imports nothing of decide.py).

    Raises:
        InputError: as decide_group for any group, or check_one_job (exit 78).
    """
    if by_node_count:
        check_one_job(exports)
    groups = split(exports, by_node_count)
    decided = {version: {n: decide_group(group, rules, now=now) for n, group in sorted(counts.items())}
               for version, counts in groups.items()}
    versions = sorted(decided, key=version_key, reverse=True)
    if len(versions) == 1 and len(decided[versions[0]]) == 1:
        return next(iter(decided[versions[0]].values()))  # one group: the profile as decide_group writes it
    sections = [_section(v, decided[v]) for v in versions]
    top = sections[0]
    profile = copy.deepcopy(decided[versions[0]][min(decided[versions[0]])])
    profile.update({"schema_version": SECTIONS_SCHEMA_VERSION, "node_class": top["node_class"], "env": top["env"],
                    "topology_file": top["topology_file"], "chosen": top["chosen"], "parts": top["parts"],
                    "tuner_table": top["tuner_table"], "nccl_sections": sections})
    profile["versions"]["exporters"] = sorted({e.doc["versions"]["nccltune"] for e in exports})
    profile["evidence"]["exports_sha256"] = hashlib.sha256("\n".join(sorted({e.sha256 for e in exports}))
                                                           .encode()).hexdigest()
    return profile


def sections(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every NCCL version's section of a profile; a profile of one group (and every profile
    written before sections) is its own one section, its env the part of its one job shape."""
    if "nccl_sections" in doc:
        return list(doc["nccl_sections"])
    return [{"nccl": doc["versions"]["nccl"], "node_class": doc["node_class"], "env": doc["env"],
             "topology_file": doc["topology_file"], "chosen": doc["chosen"], "tuner_table": doc["tuner_table"],
             "parts": []}]


def section_for(doc: Mapping[str, Any], nccl: str | None) -> Mapping[str, Any]:
    """The profile as seen by a node that runs NCCL `nccl`: its top level replaced by that
    version's section, when the profile has one; else the profile itself (which apply then
    refuses as stale when its version is not the node's). Of another section than the top
    level's, the evidence verify reads is that section's: its smallest node count's candidates and
    class distribution, without per-node numbers (fleet.outlier reads the summary)."""
    for section in doc.get("nccl_sections", []):
        if section["nccl"] != nccl:
            continue
        view = {**doc, **{k: section[k] for k in ("node_class", "env", "topology_file", "chosen", "parts",
                                                   "tuner_table")}}
        view["versions"] = {**doc["versions"], "nccl": section["nccl"]}
        if section["nccl"] != doc["versions"]["nccl"]:
            smallest = section["parts"][0]
            view["evidence"] = {**doc["evidence"], "nodes": [], "node_count": smallest["node_count"],
                                "candidates": smallest["candidates"], "class_per_size": section["class_per_size"],
                                "verdict": smallest["verdict"]}
        return view
    return doc


def shape_envs(section: Mapping[str, Any]) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """(the safe part, node count -> its part) of one section, each part without what the safe
    part already sets: what publish.shapes.part_for_shape takes. A section of one job shape (a
    profile of one group) is its safe part alone, as such profiles always were published."""
    safe = dict(section["env"])
    parts = {int(p["nnodes"]): {k: v for k, v in sorted(p["env"].items()) if safe.get(k) != v}
             for p in section.get("parts", [])}
    return safe, parts


def summary_lines(doc: Mapping[str, Any]) -> list[str]:
    """What `fleet decide` says of each version's section and each part, beyond the top level's
    verdict: nothing for a profile of one group."""
    lines = []
    for section in doc.get("nccl_sections", []):
        for part in section["parts"]:
            lines.append(f"NCCL {section['nccl'] or 'unknown'}, {part['nnodes']} node(s) "
                         f"({part['job_shape']['label']}, {part['node_count']} node(s) measured): {part['verdict']}")
        lines.append(f"NCCL {section['nccl'] or 'unknown'}: safe part for every job: "
                     + (", ".join(f"{k}={v}" for k, v in section["env"].items()) or "nothing"))
    return lines
