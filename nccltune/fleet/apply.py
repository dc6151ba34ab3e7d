"""`nccltune apply PROFILE` and the daemon's `profile.path`: publish a class profile on this
node, after checking it is for it.

A profile is refused (exit 78, nothing published changes) when it is malformed, when its file
may be changed by another user, when it was made for another class of node, when it is stale
(made with another NCCL, driver or nccltune release than this node runs), when its demo flag
does not match the node, or when any variable or what it carries fails the publish validation
or bounds (fleet.values, the check fleet decide makes before it writes a profile); the refusal's
`code` names which (the daemon's metrics carry it). Only then is the
profile published as one Setting (publish.publish_setting), atomically, with provenance that
names the profile (`nccltune env` shows it in the header, nccl.json carries its digest under
`class_profile`); its copy (PROFILE_IN_FORCE) is a file of that generation and follows it into
the state directory, for `nccltune verify` to compare the node with its class.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import __version__
from ..config import Config
from ..errors import InputError
from ..files import trust
from ..names import DEFAULTS_LABEL
from ..publish import (
    CURRENT_NAME,
    PROFILE_IN_FORCE,
    TOPO_FILE_VAR,
    PublishedFiles,
    Setting,
    build_provenance,
    names_own_topology,
    node_topology_pin,
    publish_setting,
    topology_env,
    validate_env,
)
from ..topology.fingerprint import topology_fingerprint
from ..topology.ncclxml import render_xml
from ..topology.nodeclass import describe_difference, differing_facts
from .classtable import profile_tuner
from .decide import PROFILE_KIND, profile_gains
from .document import FleetDocument, read_json_document
from .member import FleetNode, load_fleet_node, worker_nccl
from .parts import section_for, shape_envs
from .values import MAX_CHOSEN_CHARS as MAX_CHOSEN_CHARS  # kept importable from here
from .values import check_values

log = logging.getLogger(__name__)

# Facts of the class that a new release changes on every node at once: a mismatch there makes a
# profile stale rather than one for another kind of node.
VERSION_FACTS = ("driver_version", "nccl_version")

# Why a profile is not applied: no file for this class, not a valid profile, a file another user
# may change, made for another kind of node, made for other versions, a value that cannot be published.
RefusalCode = Literal["missing", "malformed", "untrusted", "other_class", "other_shape", "stale", "unsafe"]
REFUSAL_CODES: tuple[RefusalCode, ...] = ("missing", "malformed", "untrusted", "other_class", "other_shape", "stale",
                                          "unsafe")


class ProfileRefused(InputError):
    """A profile that is not applied on this node (exit 78); `code` says why in one word."""

    def __init__(self, path: str, message: str, *, code: RefusalCode, line: int | None = None,
                 hint: str | None = None) -> None:
        super().__init__(path, message, line=line, hint=hint)
        self.code: RefusalCode = code

    @classmethod
    def wrapping(cls, exc: InputError, code: RefusalCode) -> ProfileRefused:
        """The same message as `exc` (its path, line and hint), with a code."""
        prefix = f"{exc.path}:{exc.line}: " if exc.line is not None else f"{exc.path}: "
        return cls(exc.path, exc.message.removeprefix(prefix), code=code, line=exc.line, hint=exc.hint)


@dataclass(frozen=True)
class LoadedProfile(FleetDocument):
    """A class profile file as read, to check against this node and publish."""

    @property
    def note(self) -> str:
        return _note(self.path, self.doc)

    def provenance(self) -> dict[str, Any]:
        """What nccl.json says of the profile in force (`class_profile`): nodes of a class that
        publish the same profile carry the same digest."""
        got = {"file": self.path.name, "path": str(self.path), "sha256": self.sha256, "class_id": self.class_id,
               "chosen": str(self.doc["chosen"]), "decided_at": str(self.doc["provenance"]["created_at"]),
               "nodes": int(self.doc["evidence"].get("node_count", len(self.doc["evidence"]["nodes"])))}
        # A profile `fleet upgrade` wrote of an old profile's safe part says so, as the daemon's safe part does.
        part = (self.doc["provenance"].get("upgrade") or {}).get("part")
        return {**got, "part": str(part)} if part else got


@dataclass(frozen=True)
class ApplyResult:
    profile_path: Path
    class_id: str
    env: dict[str, str]
    published: PublishedFiles
    note: str


def _release(version: str | None) -> tuple[str, ...]:
    """major.minor: a patch release reads and writes the same formats."""
    return tuple((version or "").split(".")[:2])


def check_profile(doc: Mapping[str, Any], where: str, node: FleetNode, nccl_version: str | None) -> None:
    """Refuse a profile that is not for this node.

    Raises:
        ProfileRefused: demo/GPU mismatch, stale versions, another class, or an unpublishable
            variable; the message names what differs. Exit 78.
    """
    doc = section_for(doc, nccl_version)  # the section of this node's NCCL, when the profile has one
    if bool(doc["demo"]) != node.demo:
        kind = "a CPU demo profile" if doc["demo"] else "a GPU profile"
        raise ProfileRefused(where, f"{kind} cannot be applied to {'a demo' if node.demo else 'a GPU'} node",
                             code="other_class", hint="demo numbers are not NCCL numbers")
    shape = doc["job_shape"]
    if shape.get("loopback"):
        # NCCL forced onto the NICs inside one node (P2P and SHM off) is a shape no job runs in: its
        # numbers compare GDR levels per GPU-NIC pair, they are never a setting to publish.
        raise ProfileRefused(where, f"profile was measured through the NICs of one node ({shape.get('label')}, "
                             "NIC loopback): no job runs in that shape", code="other_shape",
                             hint="decide the profile from sweeps of the nodes' own ranks or across nodes")
    mine = node.node_class(nccl_version)
    theirs = doc["node_class"]
    hardware = [k for k in differing_facts(theirs["facts"], mine.facts) if k not in VERSION_FACTS]
    if hardware:
        why = describe_difference({k: theirs["facts"].get(k) for k in hardware},
                                  {k: mine.facts.get(k) for k in hardware}, a_name="profile", b_name="this node")
        raise ProfileRefused(where, f"profile is for node class {theirs['id']}, this node is {mine.id}: {why}",
                             code="other_class",
                             hint="apply the profile made for this node's class (`nccltune topo` shows it)")
    stale = []
    versions = doc["versions"]
    if versions["nccl"] != nccl_version:
        stale.append(f"NCCL {versions['nccl'] or 'unknown'} (profile) vs {nccl_version or 'unknown'} (this node)")
    if versions["driver"] != node.topo.driver_version:
        stale.append(f"driver {versions['driver'] or 'unknown'} (profile) vs "
                     f"{node.topo.driver_version or 'unknown'} (this node)")
    made_by = doc["provenance"]["nccltune_version"]
    if _release(made_by) != _release(__version__):
        stale.append(f"nccltune {made_by} (profile) vs {__version__} (this node)")
    if stale or mine.id != theirs["id"]:
        why = "; ".join(stale) or describe_difference(theirs["facts"], mine.facts, a_name="profile",
                                                      b_name="this node")
        raise ProfileRefused(where, f"stale profile: {why}", code="stale",
                             hint="re-sweep one node of the class and re-run `nccltune fleet decide`")
    try:
        check_values(doc, where)
    except InputError as exc:
        raise ProfileRefused.wrapping(exc, "unsafe") from exc


def _note(path: Path, doc: Mapping[str, Any]) -> str:
    evidence = doc["evidence"]
    nodes = evidence["nodes"]
    # The totals of every node; a profile older than them lists every node.
    trials = evidence.get("trials") or {"baseline": sum(int(n["baseline_trials"]) for n in nodes),
                                        "candidate": sum(int(n["candidate_trials"]) for n in nodes)}
    samples = int(trials["baseline"]) + int(trials["candidate"])
    shape = doc["job_shape"]
    measured = (f", measured as {shape['label']} (nodes x ranks per node)"
                if shape.get("label") and int(shape.get("measured_nnodes") or 1) > 1 else "")
    return (f"class profile {path.name} (class {doc['node_class']['id']}, {doc['chosen']}, "
            f"{int(evidence.get('node_count', len(nodes)))} node(s), {samples} trial(s){measured})")


def file_for(path: Path, class_id: str) -> Path:
    """The file a profile path stands for: itself, or `<path>/<class id>.json` when it is a
    directory (where `fleet decide --out` results are kept per class, one ConfigMap key each)."""
    return path / f"{class_id}.json" if path.is_dir() else path


def profile_in(directory: Path, class_id: str) -> Path:
    """`<directory>/<class id>.json`, which must exist.

    Raises:
        ProfileRefused: there is no profile for this class there (exit 78, code "missing").
    """
    path = file_for(directory, class_id)
    if not path.is_file():
        there = sorted(p.stem for p in directory.glob("*.json"))
        raise ProfileRefused(str(directory), f"no profile for this node's class {class_id} "
                             f"(profiles there: {', '.join(there) or 'none'})", code="missing",
                             hint="decide one from this class's exports with `nccltune fleet decide`")
    return path


def profile_file(path: Path, class_id: str) -> Path:
    """The file `path` stands for: itself, or this class's profile when it is a directory.

    Raises:
        ProfileRefused: nothing there, or no profile for this class in the directory (code "missing").
    """
    if path.is_dir():
        return profile_in(path, class_id)
    if not path.exists():
        raise ProfileRefused(str(path), "no such file", code="missing",
                             hint="a class profile written by `nccltune fleet decide`, or a directory of them")
    return path


def trusted_profile(path: Path) -> Path:
    """The real file a profile is read from, after the trust rule held for every directory and
    link on the way (a Kubernetes ConfigMap's `..data` link included, and the directories its
    targets are in): each owned by root or us and writable by nobody else. What every job sources
    must not be up to another user, nor may a file root wrote be reached through a name she placed.

    Raises:
        ProfileRefused: code "untrusted", or "missing" when it cannot be read (exit 78).
    """
    try:
        return trust.resolve_trusted(path, "profile")[0]
    except InputError as exc:
        raise ProfileRefused.wrapping(exc, "untrusted") from exc
    except OSError as exc:
        raise ProfileRefused(str(path), f"cannot read: {exc.strerror}", code="missing") from exc


def read_profile(path: Path) -> LoadedProfile:
    """A profile file, read and validated against its schema (not yet against this node).

    Raises:
        ProfileRefused: missing, untrusted, or malformed (with its line or JSON path). Exit 78.
    """
    real = trusted_profile(path)
    try:
        doc, raw = read_json_document(real, "profile", PROFILE_KIND, shown=path)
    except InputError as exc:
        raise ProfileRefused.wrapping(exc, "malformed") from exc
    return LoadedProfile(path, doc, raw)


def load_profile(path: Path, node: FleetNode, nccl_version: str | None) -> LoadedProfile:
    """The profile `path` stands for (a directory: this node's class's), read and checked against
    this node.

    Raises:
        ProfileRefused: it is not to be applied here; nothing was written (exit 78).
    """
    loaded = read_profile(profile_file(path, node.node_class(nccl_version).id))
    check_profile(loaded.doc, str(loaded.path), node, nccl_version)
    return loaded


def publish_loaded(cfg: Config, node: FleetNode, nccl_version: str | None, loaded: LoadedProfile, *,
                   now: _dt.datetime | None = None) -> ApplyResult:
    """Publish a profile load_profile accepted, and keep its copy as the profile in force.

    Raises:
        InputError: a config pin that cannot be published (exit 78); nothing was written.
        PublishError, BusyError: as publish.publish_setting.
    """
    doc = section_for(loaded.doc, nccl_version)
    # Pins of this node's config win, as they do over a node's own sweep.
    env = {**doc["env"], **cfg.sweep.pin}
    validate_env(env, source=f"{cfg.path or 'config'}: sweep.pin")
    single, nodes = shape_parts(doc, env)
    from ..publish.tuning import tuning_fingerprint

    tuning_fp = tuning_fingerprint(cfg, topology_fingerprint(node.topo), nccl_version, node.demo)
    # Checked (and the plugin built) before anything is written; the table carries the fingerprint
    # the node publishes, which the plugin checks.
    tuner, table_note = profile_tuner(cfg, doc, str(loaded.path), tuning_fp, os.environ)
    note = loaded.note + (f"; {table_note}" if table_note else "")
    prov = build_provenance(
        created_at=now, topology_fingerprint=topology_fingerprint(node.topo), nccl_version=nccl_version,
        backend=str(doc["backend"]), demo=bool(doc["demo"]), profile=str(doc["evidence"]["rules"]["profile"]),
        # The evidence is the top-level section's: its gains name no other version's choice.
        gains=profile_gains(doc) if doc["versions"]["nccl"] == loaded.doc["versions"]["nccl"] else {}, note=note,
        # What the daemon computes for this node's NCCL and sweep settings: it takes the profile as
        # current, and re-tunes only when one of them changes (as after its own sweep).
        tuning_fingerprint=tuning_fp, class_profile=loaded.provenance(),
        # A class that kept NCCL's defaults (fleet decide's chosen DEFAULTS_LABEL) publishes nothing measured.
        state="defaults" if doc.get("chosen") == DEFAULTS_LABEL and tuner is None else "tuned")
    # The class shares the tree's shape, not its bus ids: each node's own XML, as the generation's
    # own file, where nothing pins a topology file (publish.topology_pin: a config pin is published
    # as its path, the site's conf file is left to NCCL). The profile's copy in force is written
    # with the set (publish_setting), so a refused or failed publish leaves the previous profile in force.
    pin = node_topology_pin(cfg.sweep.pin, cfg.sweep.unpin, os.environ)
    env = {name: value for name, value in env.items() if name != TOPO_FILE_VAR}
    env.update(topology_env(pin, own=bool(doc["topology_file"])))
    setting = Setting(env, prov, single, topology_xml=render_xml(node.topo.system) if names_own_topology(env) else None,
                      tuner=tuner, class_profile=loaded.raw, where=str(loaded.path), nodes_env=nodes)
    published = publish_setting(cfg, setting)
    log.info("applied %s: generation %d", note, published.generation)
    return ApplyResult(loaded.path, loaded.class_id, dict(published.env), published, note)


def shape_parts(doc: Mapping[str, Any],
                every_job: Mapping[str, str]) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """The parts by job shape a profile's section publishes beside `every_job` (its safe part and
    the pins): the single-node part, and the part of every other measured node count (an empty
    one too: the jobs it reaches get the safe part, not a smaller count's values;
    publish.shapes.part_for_shape). A name `every_job` sets is left out of each: a pin wins, as
    over a node's own sweep."""
    _safe, parts = shape_envs(doc)
    shaped = {count: {k: v for k, v in part.items() if k not in every_job} for count, part in parts.items()}
    return shaped.pop(1, {}), shaped


def apply_profile(cfg: Config, path: Path, *, demo: str | bool | None = None, python: str | None = None,
                  now: _dt.datetime | None = None) -> ApplyResult:
    """`nccltune apply`: check `path` against this node and publish it. A directory stands for
    the profile of this node's class in it (see profile_in).

    Raises:
        ProfileRefused: the profile is malformed or not for this node (exit 78); nothing was written.
        UnavailableError: a GPU node without a worker interpreter, so without the NCCL version (exit 69).
        PublishError, BusyError: as publish.publish_setting.
    """
    node = load_fleet_node(cfg, demo)
    nccl_version = worker_nccl(cfg, node.demo, python, strict=True).version
    return publish_loaded(cfg, node, nccl_version, load_profile(path, node, nccl_version), now=now)


def profile_in_force(cfg: Config, provenance: Mapping[str, Any]) -> LoadedProfile | None:
    """The class profile the published set came from, as kept in its generation (or, for a set
    published before generations kept it, in the state directory), or None when the set is a
    node's own decision or the copy is not the one published (another digest, gone, unreadable:
    logged); its document as the published set's NCCL's section (parts.section_for)."""
    published = provenance.get("class_profile")
    if not isinstance(published, Mapping) or not isinstance(published.get("sha256"), str):
        return None
    own = Path(cfg.publish_dir) / CURRENT_NAME / PROFILE_IN_FORCE
    path = own if os.path.lexists(own) else Path(cfg.state_dir) / PROFILE_IN_FORCE
    try:
        loaded = read_profile(path)
    except ProfileRefused as exc:
        log.warning("the class profile in force (%s) cannot be read back: %s", published.get("file"), exc)
        return None
    if loaded.sha256 != published["sha256"]:
        log.warning("%s is not the class profile in force (%s, sha256 %s...)", path, published.get("file"),
                    str(published["sha256"])[:12])
        return None
    nccl = provenance.get("nccl_version")
    view = section_for(loaded.doc, nccl if isinstance(nccl, str) else None)
    return LoadedProfile(loaded.path, dict(view), loaded.raw)
