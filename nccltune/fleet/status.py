"""`nccltune fleet status`: per node class, which versions each node runs and what is in force.

The input is what the nodes already hand to `fleet decide`: their exports (each names its host,
its class and the NCCL, driver and torch versions of its last measurements), and the class
profiles (`fleet decide --out`, one `<class id>.json` each). What is in force on a node follows
the upgrade rule (docs/upgrades.md) from those documents alone:

- no profile for the class: each node's own choice;
- the node runs the NCCL and driver the profile was measured under: the profile, every part
  (the safe part, and the part of the job's shape);
- it runs another one: the profile's safe part only, as its daemon serves it, until the class
  has a profile for its versions. The canary is the node of lowest hostname among the nodes the
  profile was decided from (fleet.upgrade.canary_of), as every daemon computes it: the same node
  whoever runs the command; it re-measures once it runs the new versions.

Per kind of node, the upgrade rule's outcome (fleet.upgrade.upgrade_outcome) from the canary's
export (its `upgrade_gate`) and the profiles: the canary's new profile, the old one kept, or the
safe part. A profile `fleet upgrade` wrote for the new class id (its `provenance.upgrade`) is in
force on the upgraded nodes: every part when it decided or kept, the safe part when it carried
only that (and then it is no profile of the new versions for the rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from .decide import PROFILE_KIND
from .document import read_json_document
from .export import EXPORT_KIND
from .gate import GateReading
from .upgrade import canary_of, safe_part, upgrade_outcome
from .upgrade import hardware_class as hardware_class  # kept importable from here

# The document's kind is its schema's name (schemas/fleet-status.schema.json).
STATUS_KIND = "fleet-status"
STATUS_SCHEMA_VERSION = 1

IN_FORCE_OWN = "own choice (no class profile)"
IN_FORCE_PROFILE = "profile (every part)"
IN_FORCE_SAFE = "profile's safe part"


@dataclass(frozen=True)
class NodeStatus:
    hostname: str
    source: str
    versions: dict[str, str | None]  # nccl, driver, torch
    in_force: str
    why: str
    canary: bool

    def as_dict(self) -> dict[str, Any]:
        return {"hostname": self.hostname, "export": self.source, "versions": self.versions,
                "in_force": self.in_force, "why": self.why, "canary": self.canary}


@dataclass(frozen=True)
class ClassStatus:
    class_id: str
    profile: str | None
    profile_versions: dict[str, str | None] | None  # the previous profile's (before an upgrade)
    nodes: list[NodeStatus]
    safe: dict[str, str]  # the previous profile's safe part (fleet/upgrade.py)
    left_out: list[str]  # what of its env an upgraded node does not get
    canary: str | None = None  # the previous profile's canary (fleet.upgrade.canary_of)
    # While some node runs other versions than the profile: the upgrade rule's outcome and why.
    outcome: str | None = None
    outcome_why: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"class": self.class_id, "profile": self.profile, "profile_versions": self.profile_versions,
                "safe_part": self.safe, "left_out_after_upgrade": self.left_out, "canary": self.canary,
                "upgrade": None if self.outcome is None else {"outcome": self.outcome, "why": self.outcome_why},
                "nodes": [n.as_dict() for n in self.nodes]}


def document(classes: Sequence[ClassStatus]) -> dict[str, Any]:
    """`fleet status --json`: its kind, schema version and the classes."""
    return {"kind": STATUS_KIND, "schema_version": STATUS_SCHEMA_VERSION, "classes": [c.as_dict() for c in classes]}


def export_paths(args: Sequence[Path]) -> list[Path]:
    """The files named, and every `*.json` of a directory named, in name order.

    Raises:
        InputError: a path that does not exist, or a directory without exports (exit 78).
    """
    paths: list[Path] = []
    for arg in args:
        if arg.is_dir():
            found = sorted(arg.glob("*.json"))
            if not found:
                raise InputError(str(arg), "no *.json exports in this directory")
            paths.extend(found)
        elif arg.exists():
            paths.append(arg)
        else:
            raise InputError(str(arg), "no such file or directory")
    return paths


def _versions(doc: Mapping[str, Any]) -> dict[str, str | None]:
    v = doc["versions"]
    return {"nccl": v.get("nccl"), "driver": v.get("driver"), "torch": v.get("torch")}


def _differs(node: Mapping[str, str | None], profile: Mapping[str, str | None]) -> list[str]:
    return [f"{name} {profile[name] or 'unknown'} (profile) vs {node[name] or 'unknown'} (node)"
            for name in ("nccl", "driver") if node[name] != profile[name]]


def _carried(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The profile's `provenance.upgrade` (written by `fleet upgrade`), or None."""
    got = doc["provenance"].get("upgrade")
    return got if isinstance(got, Mapping) else None


def _safe_only(doc: Mapping[str, Any]) -> bool:
    """A profile `fleet upgrade` wrote of an old profile's safe part alone."""
    return (_carried(doc) or {}).get("outcome") == "safe"


def _profiles(path: Path | None) -> list[tuple[Path, dict[str, Any]]]:
    if path is None:
        return []
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    return [(f, read_json_document(f, "profile", PROFILE_KIND)[0]) for f in files]


def fleet_status(exports: Sequence[Path], profiles: Path | None) -> list[ClassStatus]:
    """Each kind of node of `exports` (its class without the versions), in id order, with its
    nodes in hostname order; `profiles`: a class profile, or a directory of them.

    Raises:
        InputError: a malformed export or profile, or a node given twice (exit 78).
    """
    by_class: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    seen: dict[str, Path] = {}
    for path in exports:
        doc, _ = read_json_document(path, "export", EXPORT_KIND)
        host = str(doc["hostname"])
        if host in seen:
            raise InputError(str(path), f"node {host} is also in {seen[host]}", hint="give each node's export once")
        seen[host] = path
        by_class.setdefault(hardware_class(doc["node_class"]["facts"]), []).append((path, doc))
    known = _profiles(profiles)
    result = []
    for hw in sorted(by_class):
        mine = [(p, d) for p, d in known if hardware_class(d["node_class"]["facts"]) == hw]
        result.append(_class_status(hw, mine, by_class[hw]))
    return result


def _class_status(hw: str, profiles: list[tuple[Path, dict[str, Any]]],
                  members: list[tuple[Path, dict[str, Any]]]) -> ClassStatus:
    by_id = {d["node_class"]["id"]: (p, d) for p, d in profiles}
    # The profile the class had before an upgrade: the one most of its nodes run under.
    # One `fleet upgrade` wrote for an upgraded class is the previous one only where no other is run.
    counts: dict[str, int] = {}
    for own in (False, True):
        for _, doc in members:
            cid = doc["node_class"]["id"]
            if cid in by_id and (own or _carried(by_id[cid][1]) is None):
                counts[cid] = counts.get(cid, 0) + 1
        if counts:
            break
    previous = max(sorted(counts), key=lambda c: counts[c], default=None)
    if previous is None and profiles:
        previous = profiles[0][1]["node_class"]["id"]
    prof_path, prof_versions, canary = None, None, None
    safe: dict[str, str] = {}
    left_out: list[str] = []
    if previous is not None:
        path, prof = by_id[previous]
        prof_path, prof_versions = str(path), {"nccl": prof["versions"]["nccl"], "driver": prof["versions"]["driver"]}
        safe, left_out = safe_part(prof["env"])
        canary = canary_of(prof)
        if prof.get("tuner_table"):
            left_out.append("the tuner table")
    nodes = []
    for path, doc in sorted(members, key=lambda m: str(m[1]["hostname"])):
        versions = _versions(doc)
        host, cid = str(doc["hostname"]), doc["node_class"]["id"]
        if cid in by_id and _safe_only(by_id[cid][1]):
            nodes.append(NodeStatus(host, str(path), versions, IN_FORCE_SAFE, _why(*by_id[cid]), False))
        elif cid in by_id:
            nodes.append(NodeStatus(host, str(path), versions, IN_FORCE_PROFILE, _why(*by_id[cid]), False))
        elif prof_versions is None:
            nodes.append(NodeStatus(host, str(path), versions, IN_FORCE_OWN, "", False))
        else:
            # The canary re-measures while it serves the safe part; the others wait for it.
            nodes.append(NodeStatus(host, str(path), versions, IN_FORCE_SAFE,
                                    "; ".join(_differs(versions, prof_versions)), host == canary))
    status = ClassStatus(hw, prof_path, prof_versions, nodes, safe, left_out, canary)
    return _with_outcome(status, members, by_id)


def _why(path: Path, doc: Mapping[str, Any]) -> str:
    """The profile's file, and where `fleet upgrade` carried it from."""
    carried = _carried(doc)
    if carried is None:
        return str(path)
    return f"{path}: fleet upgrade {carried['outcome']} of {carried['from']['file']}"


def _with_outcome(status: ClassStatus, members: list[tuple[Path, dict[str, Any]]],
                  by_id: Mapping[str, tuple[Path, dict[str, Any]]]) -> ClassStatus:
    """While some node serves the safe part: the upgrade rule's outcome, from the canary's export
    (its `upgrade_gate`) and whether a profile exists for the canary's versions."""
    from dataclasses import replace

    if not any(n.in_force == IN_FORCE_SAFE for n in status.nodes):
        return status
    canary = next((d for _, d in members if str(d["hostname"]) == status.canary), None)
    new = None
    own = by_id.get(canary["node_class"]["id"]) if canary is not None else None
    if own is not None and not _safe_only(own[1]):
        new = own[1] if str(own[0]) != status.profile else None
    # A safe part `fleet upgrade` wrote leaves the canary as upgraded as the daemon's safe part does.
    upgraded_canary = canary is not None and (own is None or _safe_only(own[1]))
    outcome, why = upgrade_outcome(GateReading.of_export(canary) if upgraded_canary and canary is not None else None,
                                   new)
    return replace(status, outcome=outcome, outcome_why=why)


def render(classes: Sequence[ClassStatus]) -> str:
    lines = []
    for cls in classes:
        if cls.profile is None:
            lines.append(f"class {cls.class_id} (without versions): no class profile")
        else:
            pv = cls.profile_versions or {}
            lines.append(f"class {cls.class_id} (without versions): profile {cls.profile} "
                         f"(NCCL {pv.get('nccl') or 'unknown'}, driver {pv.get('driver') or 'unknown'})")
            lines.append(f"  safe part after an upgrade: {', '.join(cls.safe) or 'nothing (NCCL defaults)'}; "
                         f"left out: {', '.join(cls.left_out) or 'nothing'}; canary: {cls.canary or 'none'}")
        if cls.outcome is not None:
            lines.append(f"  upgrade: {cls.outcome} ({cls.outcome_why})")
        for n in cls.nodes:
            v = n.versions
            role = "  [canary: re-measures the profile's values under its versions]" if n.canary else ""
            why = f" ({n.why})" if n.why else ""  # the stale versions, or the profile's file
            lines.append(f"  {n.hostname}: NCCL {v['nccl'] or 'unknown'}, driver {v['driver'] or 'unknown'}, "
                         f"torch {v['torch'] or 'unknown'}: {n.in_force}{why}{role}")
    return "\n".join(lines) + "\n"
