"""A class after NCCL, the driver or torch changed (docs/upgrades.md): what a node serves, which
node re-measures, and which profile the class keeps.

- The safe part (`safe_part`): an allow-list, not a deny-list. A variable stays only when it names
  the node's hardware and wiring (which interfaces, which HCAs, which topology file) or the job's
  error handling, none of which an NCCL release re-decides. Everything else a profile carries
  (algorithm, protocol and channel pins, buffer sizes, the tuner's table, any name this list does
  not know) was chosen against the old version's defaults and is left out until the class's
  canary has re-measured. A node of the profile's kind that runs other versions serves this part
  (`upgraded_profile`, `safe_part_setting`), never a choice of its own.
- The canary (`canary_of`): the node of lowest hostname among the nodes a profile was decided
  from. Every daemon and `fleet status` computes it from the profile alone, with no view of the
  other nodes; and that node swept under the old version (its export is in the profile), so its
  own history holds the previous sweep the upgrade gate compares with, on the same topology.
- The rule (`upgrade_outcome`): the canary's profile for the new versions when `fleet decide`
  made one; else the old profile, every part, when the canary's gate compared sizes and found
  none slower beyond noise; else the safe part.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .. import __version__
from ..errors import InputError, NccltuneError
from ..names import DEFAULTS_LABEL
from ..nccl.site import conf_settings
from ..publish import Provenance, Setting, read_published, validate_env
from ..sweep.plan import PER_SIZE_VARS
from ..sweep.space import CATALOGUE
from ..topology.fingerprint import topology_fingerprint
from ..topology.ncclxml import render_xml
from ..topology.nodeclass import class_id_of
from .apply import VERSION_FACTS, LoadedProfile, ProfileRefused, check_profile, read_profile
from .gate import GateReading
from .values import check_values

if TYPE_CHECKING:
    from ..config import Config
    from ..store import Store
    from .member import FleetNode

log = logging.getLogger(__name__)

SAFE_AFTER_UPGRADE = frozenset({
    "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_SL", "NCCL_IB_TC", "NCCL_TOPO_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
})

# nccl.json's `class_profile.part` of a set that carries only a profile's safe part.
SAFE_PART = "safe part after upgrade"
# The torch policy variable every published set carries (pipeline.planning.POLICY_VAR).
_POLICY_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

Outcome = Literal["new", "keep", "safe"]
OUTCOMES: tuple[Outcome, ...] = ("new", "keep", "safe")


def safe_part(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """`env` split into what stays under a new version (in its order) and the names left out (sorted)."""
    kept = {name: value for name, value in env.items() if name in SAFE_AFTER_UPGRADE}
    return kept, sorted(set(env) - set(kept))


def hardware_class(facts: Mapping[str, Any]) -> str:
    """The class id without the versions: the nodes an upgrade moves to a new class id (its NCCL
    or driver is a fact of the class) are still the same kind of node."""
    return class_id_of({k: v for k, v in facts.items() if k not in VERSION_FACTS})


def canary_of(profile: Mapping[str, Any]) -> str | None:
    """The class's canary: the lowest hostname among the nodes `profile` was decided from."""
    hosts = sorted(str(n["hostname"]) for n in profile["evidence"]["nodes"])
    return hosts[0] if hosts else None


# -- the node's side: which profile's safe part ----------------------------------------------------


@dataclass(frozen=True)
class Upgraded:
    """A profile of this node's kind measured under other versions, and what differs."""

    loaded: LoadedProfile
    changes: tuple[str, ...]  # "NCCL 2.28.9 (profile) vs 2.29.1 (this node)", ...

    @property
    def canary(self) -> str | None:
        return canary_of(self.loaded.doc)


def _release(version: str | None) -> tuple[str, ...]:
    return tuple((version or "").split(".")[:2])


def version_changes(doc: Mapping[str, Any], where: str, node: FleetNode, nccl_version: str | None) -> list[str]:
    """What differs between `doc`'s NCCL and driver and this node's; [] when the profile is for
    these versions and applies as a whole.

    Raises:
        ProfileRefused: anything besides the versions keeps it from this node: another kind of
            node, a demo or shape mismatch, another nccltune release, an unpublishable value.
    """
    try:
        check_profile(doc, where, node, nccl_version)
        return []
    except ProfileRefused as exc:
        if exc.code != "stale":
            raise
        refusal = exc
    if _release(doc["provenance"]["nccltune_version"]) != _release(__version__):
        raise refusal  # another release may read the profile differently: refused, not carried over
    changes = []
    if doc["versions"]["nccl"] != nccl_version:
        changes.append(f"NCCL {doc['versions']['nccl'] or 'unknown'} (profile) vs {nccl_version or 'unknown'} "
                       "(this node)")
    if doc["versions"]["driver"] != node.topo.driver_version:
        changes.append(f"driver {doc['versions']['driver'] or 'unknown'} (profile) vs "
                       f"{node.topo.driver_version or 'unknown'} (this node)")
    if not changes:
        raise refusal
    try:
        check_values(doc, where)
    except InputError as exc:
        raise ProfileRefused.wrapping(exc, "unsafe") from exc
    return changes


def upgraded_profile(path: Path, node: FleetNode, nccl_version: str | None) -> Upgraded | None:
    """The profile at `path` (a file, or the directory of every class's) whose safe part this node
    serves: of its kind, measured under other versions. In a directory, of several such profiles
    the one decided last (then by name). None when there is none.

    Raises:
        ProfileRefused: a file at `path` that is not of this node's kind, or unreadable.
    """
    if not path.is_dir():
        loaded = read_profile(path)
        changes = version_changes(loaded.doc, str(loaded.path), node, nccl_version)
        return Upgraded(loaded, tuple(changes)) if changes else None
    mine = hardware_class(node.node_class(nccl_version).facts)
    found: list[Upgraded] = []
    for file in sorted(path.glob("*.json")):
        try:
            loaded = read_profile(file)
            if hardware_class(loaded.doc["node_class"]["facts"]) != mine:
                continue
            changes = version_changes(loaded.doc, str(file), node, nccl_version)
        except ProfileRefused as exc:
            log.debug("not a profile of this node's kind: %s", exc)
            continue
        if changes:
            found.append(Upgraded(loaded, tuple(changes)))
    found.sort(key=lambda u: (str(u.loaded.doc["provenance"]["created_at"]), u.loaded.path.name), reverse=True)
    return found[0] if found else None


def _left_out(doc: Mapping[str, Any]) -> list[str]:
    left = safe_part(doc["env"])[1]
    return left + (["the tuner table"] if doc.get("tuner_table") else [])


def safe_part_setting(cfg: Config, node: FleetNode, nccl_version: str | None, upgraded: Upgraded,
                      now: _dt.datetime) -> Setting:
    """The set a node of the profile's kind publishes under other versions: the profile's safe part
    (the config's pins win, as over the whole profile), no tuner table; state "safe", and
    `class_profile` naming the profile with `part` = SAFE_PART. The profile's copy goes with it, so
    that a sweep on this node (the canary's) records its result without publishing it.

    Raises:
        InputError: a config pin that cannot be published (exit 78).
    """
    doc = upgraded.loaded.doc
    kept = safe_part(doc["env"])[0]
    env = {_POLICY_VAR: str(cfg.sweep.async_error_handling), **kept, **cfg.sweep.pin}
    validate_env(env, source=f"{cfg.path or 'config'}: sweep.pin")
    left = _left_out(doc)
    note = (f"safe part of class profile {upgraded.loaded.path.name} after an upgrade "
            f"({'; '.join(upgraded.changes)}): {len(left)} setting(s) left out until the canary "
            f"{upgraded.canary or 'of the class'} has re-measured")
    prov = Provenance(
        nccltune_version=__version__, created_at=now.astimezone(_dt.timezone.utc).isoformat(timespec="seconds"),
        topology_fingerprint=topology_fingerprint(node.topo), nccl_version=nccl_version,
        backend=str(doc["backend"]), demo=bool(doc["demo"]), profile=None, note=note, tuning_fingerprint=None,
        state="safe", class_profile={**upgraded.loaded.provenance(), "part": SAFE_PART})
    own_xml = doc["topology_file"] and "NCCL_TOPO_FILE" not in conf_settings(os.environ)
    return Setting(env, prov, topology_xml=render_xml(node.topo.system) if own_xml else None,
                   class_profile=upgraded.loaded.raw, where=str(upgraded.loaded.path))


def safe_part_published(publish_dir: Path, upgraded: Upgraded, node: FleetNode) -> bool:
    """Whether the published set is `upgraded`'s safe part for this node's topology."""
    try:
        got = read_published(publish_dir)
    except NccltuneError:
        return False
    if got is None:
        return False
    prov = got[1]
    profile = prov.get("class_profile")
    return (isinstance(profile, dict) and profile.get("part") == SAFE_PART
            and profile.get("sha256") == upgraded.loaded.sha256 and prov.get("state") == "safe"
            and prov.get("topology_fingerprint") == topology_fingerprint(node.topo))


# -- the canary: what it measures ------------------------------------------------------------------


def canary_overrides(doc: Mapping[str, Any]) -> dict[str, object]:
    """The config overrides of the canary's sweep: the whole-environment search narrowed to the
    profile's own values (every other variable of the catalogue excluded), the per-size stage
    as it is (it re-measures the tuner table's candidates), so that the sweep measures the
    profile's choices against NCCL's new defaults, and nothing else."""
    ours = {name: [str(value)] for name, value in doc["env"].items()
            if name in CATALOGUE and CATALOGUE[name].kind != "policy" and name not in PER_SIZE_VARS}
    others = sorted(name for name, t in CATALOGUE.items()
                    if t.kind != "policy" and name not in ours and name not in PER_SIZE_VARS)
    return {"sweep.variables": ours, "sweep.exclude": others}


def canary_measured(store: Store, fingerprint: str, nccl_version: str | None, driver: str | None) -> int | None:
    """The canary's ok sweep of this topology under these NCCL and driver versions (the newest),
    or None: it has not re-measured yet."""
    from ..compare import versions

    for run in store.runs(limit=None, kind="sweep"):
        got = versions(run)
        if run.fingerprint == fingerprint and run.status == "ok" and got[:2] == (nccl_version, driver):
            return run.id
    return None


# -- the rule: the old profile, its safe part, or the canary's new one ------------------------------


def upgrade_outcome(gate: GateReading | None, new_profile: Mapping[str, Any] | None) -> tuple[Outcome, str]:
    """THE rule of what an upgraded class serves (docs/upgrades.md), with the reason:

    1. "new": `fleet decide` made a profile from the canary's evidence under the new versions
       (`new_profile`, for their class id): its choice won by the decision rule against NCCL's new
       defaults (or the defaults won, and it keeps them);
    2. "keep": no such profile yet, and the canary's upgrade gate compared sizes and found none
       slower beyond noise, neither NCCL's new defaults against the old ones nor the profile's
       values against their result under the old version: the old profile, every part;
    3. "safe": otherwise (a size slower, or the canary has not measured): the old profile's safe part.
    """
    if new_profile is not None:
        chosen = str(new_profile.get("chosen"))
        what = "NCCL's defaults" if chosen == DEFAULTS_LABEL and not new_profile.get("tuner_table") else chosen
        return "new", f"the canary's profile for the new versions ({what})"
    if gate is None or gate.compared == 0:
        return "safe", ("nothing compared: the canary has not re-measured under the new versions, or its "
                        "history holds no sweep of the previous ones")
    if gate.slower:
        return "safe", (f"the canary measured {len(gate.slower)} size(s) slower than under the previous versions "
                        f"beyond noise: {'; '.join(gate.slower[:3])}")
    return "keep", f"the canary measured no size slower beyond noise ({gate.compared} compared)"


