"""`nccltune fleet upgrade`: the profile of a class's new class id after NCCL or the driver
changed, by the upgrade rule (fleet.upgrade.upgrade_outcome, docs/upgrades.md).

The input is the class's profile under the old versions and the exports of its upgraded nodes
(one new class id: the same kind of node under other versions), the canary's among them with its
`upgrade_gate`. What is written for the new class id:

- "new": the profile `fleet decide` makes from the upgraded nodes' exports (the caller decides, by
  fleet decide's own code; this module only records where it came from);
- "keep": the old profile's values under the new class id, every part. Its tuner table only where
  the NCCL version is the same (a driver upgrade): the plugin applies a table's section to exactly
  the NCCL version it was measured with, and the canary's per-size stage chose its own entries
  under the new version, so the gate vouches for no old entry under another NCCL. Of a profile
  with sections of several NCCL versions, the section of its own versions alone (the one the
  canary re-measured); nodes on the other versions keep the old profile;
- "safe": the old profile's safe part (fleet.upgrade.SAFE_AFTER_UPGRADE), no tuner table, no
  parts; its `provenance.upgrade.part` makes the published set say so (nccl.json's
  `class_profile.part`), so that verify does not compare the node with numbers the full profile
  reached under the old versions.

Nothing is written while nothing was compared (the canary's export missing, or without a gate):
the upgraded nodes' daemons serve the safe part already, and a profile in force for the new class
id would stop the canary's one re-measuring sweep (the daemon sweeps nothing while a class
profile is in force).

Every written profile records in `provenance.upgrade` the outcome and why, the old profile (file,
digest, class id, versions), the canary and its gate's reading.
"""

from __future__ import annotations

import copy
import datetime as _dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..errors import InputError
from ..names import DEFAULTS_LABEL
from ..sweep.strategy import CARRIED, label_of
from ..topology.nodeclass import describe_difference
from .apply import LoadedProfile
from .document import Export
from .gate import GateReading
from .upgrade import SAFE_PART, Outcome, canary_of, hardware_class, safe_part, upgrade_outcome

CREATED_BY = "nccltune fleet upgrade"


@dataclass(frozen=True)
class Upgrade:
    """The upgraded class as the exports show it, beside the old profile."""

    old: LoadedProfile
    exports: tuple[Export, ...]
    node_class: dict[str, Any]  # the new class (id and facts)
    canary: str | None  # the old profile's canary (fleet.upgrade.canary_of)
    canary_export: Export | None

    @property
    def class_id(self) -> str:
        return str(self.node_class["id"])

    @property
    def versions(self) -> tuple[str | None, str | None]:
        facts = self.node_class["facts"]
        return facts.get("nccl_version"), facts.get("driver_version")

    def changes(self) -> str:
        old = self.old.doc["versions"]
        nccl, driver = self.versions
        changed = [f"{name} {was or 'unknown'} -> {now or 'unknown'}"
                   for name, was, now in (("NCCL", old["nccl"], nccl), ("driver", old["driver"], driver)) if was != now]
        return ", ".join(changed) or "the same NCCL and driver"


@dataclass(frozen=True)
class Carried:
    """What `fleet upgrade` writes (`doc`, for the new class id) and says."""

    outcome: Outcome
    why: str
    doc: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def upgraded_class(old: LoadedProfile, exports: Sequence[Export]) -> Upgrade:
    """The exports as one upgraded class of `old`'s kind of node, with its canary's export.

    Raises:
        InputError: exports of several class ids, of another kind of node than the profile, of
            the profile's own versions, or demo beside GPU (exit 78).
    """
    first = exports[0]
    for e in exports[1:]:
        if e.class_id != first.class_id:
            why = describe_difference(first.doc["node_class"]["facts"], e.doc["node_class"]["facts"],
                                      a_name=first.path.name, b_name=e.path.name)
            raise InputError(str(e.path), f"node class {e.class_id}, but {first.path} is {first.class_id}: {why}",
                             hint="give the exports of the nodes of one upgraded class (one NCCL and driver version)")
    theirs = old.doc["node_class"]
    mine = first.doc["node_class"]
    if hardware_class(mine["facts"]) != hardware_class(theirs["facts"]):
        why = describe_difference(theirs["facts"], mine["facts"], a_name="profile", b_name=first.path.name)
        raise InputError(str(first.path), f"another kind of node than the profile {old.path.name} "
                         f"(class {theirs['id']}): {why}", hint="give the exports of the profile's own kind of node")
    if first.class_id == old.class_id:
        was = old.doc["versions"]
        raise InputError(str(first.path), f"node class {first.class_id} is the profile's own (NCCL "
                         f"{was['nccl'] or 'unknown'}, driver {was['driver'] or 'unknown'}): no upgrade to act on",
                         hint="these nodes take the profile as it is (`nccltune apply`)")
    if bool(first.doc["demo"]) != bool(old.doc["demo"]):
        raise InputError(str(first.path), f"demo is {first.doc['demo']}, the profile's {old.doc['demo']}",
                         hint="CPU demo measurements and GPU measurements do not mix")
    canary = canary_of(old.doc)
    found = next((e for e in exports if str(e.doc["hostname"]) == canary), None)
    return Upgrade(old, tuple(exports), dict(mine), canary, found)


def gate_of(up: Upgrade) -> tuple[GateReading | None, list[str]]:
    """The canary's gate reading for this upgrade, or None: no canary export, no gate in it, or a
    gate against other versions than the profile's (it compared with another sweep than the one
    the profile rests on)."""
    if up.canary_export is None:
        return None, [f"the canary {up.canary or '(none: the profile names no node)'}'s export is not among those "
                      "given: nothing compared"]
    doc = up.canary_export.doc
    reading = GateReading.of_export(doc)
    if reading is None:
        return None, [f"the canary {up.canary}'s export ({up.canary_export.path}) carries no upgrade_gate: it has not "
                      "re-measured under the new versions"]
    before = doc["upgrade_gate"]["previous_versions"]
    old = up.old.doc["versions"]
    if (before.get("nccl"), before.get("driver")) != (old["nccl"], old["driver"]):
        return None, [f"the canary {up.canary}'s upgrade gate compared with NCCL {before.get('nccl') or 'unknown'}, "
                      f"driver {before.get('driver') or 'unknown'}, not the profile's NCCL {old['nccl'] or 'unknown'}, "
                      f"driver {old['driver'] or 'unknown'}: not a reading of this profile"]
    return reading, []


def _record(up: Upgrade, outcome: Outcome, why: str, *, part: str | None = None) -> dict[str, Any]:
    """provenance.upgrade (schemas/profile.schema.json)."""
    old = up.old
    gate = up.canary_export.doc.get("upgrade_gate") if up.canary_export is not None else None
    record: dict[str, Any] = {
        "outcome": outcome, "why": why, "canary": up.canary, "gate": copy.deepcopy(gate),
        "from": {"file": old.path.name, "sha256": old.sha256, "class_id": old.class_id,
                 "nccl": old.doc["versions"]["nccl"], "driver": old.doc["versions"]["driver"]}}
    if part is not None:
        record["part"] = part
    return record


def _provenance(up: Upgrade, record: dict[str, Any], now: _dt.datetime) -> dict[str, Any]:
    return {"created_by": CREATED_BY, "nccltune_version": __version__,
            "created_at": now.astimezone(_dt.timezone.utc).isoformat(timespec="seconds"), "upgrade": record}


def _versions(up: Upgrade) -> dict[str, Any]:
    nccl, driver = up.versions
    exporters = set(up.old.doc["versions"]["exporters"]) | {str(e.doc["versions"]["nccltune"]) for e in up.exports}
    return {"nccltune": __version__, "nccl": nccl, "driver": driver, "exporters": sorted(exporters)}


def _same_release(up: Upgrade) -> None:
    made_by = str(up.old.doc["provenance"]["nccltune_version"])
    if made_by.split(".")[:2] != __version__.split(".")[:2]:
        raise InputError(str(up.old.path), f"made by nccltune {made_by}, this is {__version__}: another release may "
                         "read a profile differently, its values are not carried",
                         hint="decide the class again from its exports (`nccltune fleet upgrade --decide`)")


def kept(up: Upgrade, why: str, now: _dt.datetime) -> Carried:
    """The old profile, every part, under the new class id (see the module docstring for the table)."""
    _same_release(up)
    old = up.old.doc
    doc = copy.deepcopy(old)
    nccl, _driver = up.versions
    same_nccl = nccl == old["versions"]["nccl"]
    notes = []
    if old["tuner_table"] and not same_nccl:
        rows = len(old["tuner_table"])
        notes.append(f"the tuner table ({rows} entr{'y' if rows == 1 else 'ies'}, NCCL {old['versions']['nccl']}'s "
                     "section) is not carried: the tuner plugin applies a section to exactly the NCCL version it "
                     f"was measured with, and the canary's gate compared its own per-size choice under NCCL {nccl}, "
                     "not these entries; NCCL's own choice stands there (`--decide` makes a table from the canary's "
                     "per-size trials)")
    table = old["tuner_table"] if same_nccl else []
    doc["tuner_table"] = copy.deepcopy(table)
    if "nccl_sections" in old:
        own = next(s for s in old["nccl_sections"] if s["nccl"] == old["versions"]["nccl"])
        others = [str(s["nccl"]) for s in old["nccl_sections"] if s is not own]
        if others:
            notes.append(f"the sections of NCCL {', '.join(others)} are not carried: nodes on those versions keep "
                         f"{up.old.path.name}")
        doc["nccl_sections"] = [{**copy.deepcopy(own), "nccl": nccl, "node_class": up.node_class,
                                 "tuner_table": copy.deepcopy(table)}]
    doc.update(node_class=up.node_class, versions=_versions(up),
               provenance=_provenance(up, _record(up, "keep", why), now))
    return Carried("keep", why, doc, notes)


def safe(up: Upgrade, why: str, now: _dt.datetime) -> Carried:
    """The old profile's safe part under the new class id: one env, no table, no parts."""
    _same_release(up)
    old = up.old.doc
    env, left = safe_part(old["env"])
    left += ["the tuner table"] if old["tuner_table"] else []
    left += ["the parts per node count"] if old.get("parts") else []
    doc = {k: copy.deepcopy(v) for k, v in old.items() if k not in ("parts", "nccl_sections")}
    measured = {k: v for k, v in env.items() if k not in CARRIED}
    doc.update(schema_version=1, node_class=up.node_class, versions=_versions(up), env=env, tuner_table=[],
               chosen=label_of(measured) if measured else DEFAULTS_LABEL,
               provenance=_provenance(up, _record(up, "safe", why, part=SAFE_PART), now))
    notes = [f"left out: {', '.join(left)}"] if left else []
    return Carried("safe", why, doc, notes)


def carry(up: Upgrade, decided: Mapping[str, Any] | None, *, now: _dt.datetime | None = None) -> Carried:
    """The profile for the new class id by the upgrade rule: `decided` (the profile fleet decide
    made from the upgraded nodes' exports, or None) wins; else the canary's gate keeps the old
    profile or its safe part.

    Raises:
        InputError: nothing compared and nothing decided (outcome "safe", nothing written: see the
            module docstring), or an old profile of another nccltune release to carry (exit 78).
    """
    now = now or _dt.datetime.now(_dt.timezone.utc)
    reading, notes = gate_of(up)
    outcome, why = upgrade_outcome(reading, decided)
    if outcome == "new":
        assert decided is not None
        doc = copy.deepcopy(dict(decided))
        hosts = sorted(str(e.doc["hostname"]) for e in up.exports)
        if up.canary_export is None:
            why += f", decided from {', '.join(hosts)} without the canary {up.canary}"
        doc["provenance"] = {**doc["provenance"], "created_by": CREATED_BY,
                             "upgrade": _record(up, "new", why)}
        return Carried("new", why, doc, [])
    if outcome == "keep":
        return kept(up, why, now)
    if reading is None or reading.compared == 0:
        raise InputError(str(up.canary_export.path if up.canary_export else up.old.path),
                         f"upgrade outcome safe: {'; '.join(notes) or why}. Nothing written: the upgraded nodes' "
                         f"daemons serve the safe part of {up.old.path.name} already, and a profile in force for "
                         f"class {up.class_id} would stop the canary's one sweep under the new versions",
                         hint=f"export the canary {up.canary} after its daemon's sweep under the new versions, or "
                         "decide the upgraded nodes' own sweeps with --decide")
    return safe(up, why, now)
