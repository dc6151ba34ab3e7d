"""`nccltune apply PROFILE`: publish a class profile on this node, after checking it is for it.

A profile is refused (exit 78, nothing published changes) when it is malformed, when it was made
for another class of node, when it is stale (made with another NCCL, driver or nccltune release
than this node runs), when its demo flag does not match the node, or when any variable fails the
publish validation. Only then are the node's files replaced, atomically, with provenance that
names the profile; `nccltune env` shows it in the header.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import Config
from ..errors import InputError
from ..publish import Provenance, PublishedFiles, Tuner, atomic_write, publish, update_nccl_conf, validate_env
from ..topology.fingerprint import topology_fingerprint
from ..topology.ncclxml import render_xml
from ..topology.nodeclass import describe_difference, differing_facts
from .decide import PROFILE_KIND, TOPO_FILE, profile_gains, read_json_document
from .node import FleetNode, load_fleet_node
from .table import profile_tuner

log = logging.getLogger(__name__)

# Facts of the class that a new release changes on every node at once: a mismatch there makes a
# profile stale rather than one for another kind of node.
VERSION_FACTS = ("driver_version", "nccl_version")


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


def node_nccl_version(cfg: Config, node: FleetNode, python: str | None) -> str | None:
    """The NCCL version this node's jobs load, as the sweep's worker interpreter reports it.
    None in the CPU demo, which runs no NCCL."""
    if node.demo:
        return None
    from ..probe import probe_nccl
    from ..trials.runner import find_worker_python

    version = probe_nccl(find_worker_python(python or cfg.bench.python)).get("nccl_version")
    return version if isinstance(version, str) else None


def check_profile(doc: Mapping[str, Any], where: str, node: FleetNode, nccl_version: str | None) -> None:
    """Refuse a profile that is not for this node.

    Raises:
        InputError: demo/GPU mismatch, stale versions, another class, or an unpublishable
            variable; the message names what differs. Exit 78.
    """
    if bool(doc["demo"]) != node.demo:
        kind = "a CPU demo profile" if doc["demo"] else "a GPU profile"
        raise InputError(where, f"{kind} cannot be applied to {'a demo' if node.demo else 'a GPU'} node",
                         hint="demo numbers are not NCCL numbers")
    mine = node.node_class(nccl_version)
    theirs = doc["node_class"]
    hardware = [k for k in differing_facts(theirs["facts"], mine.facts) if k not in VERSION_FACTS]
    if hardware:
        why = describe_difference({k: theirs["facts"].get(k) for k in hardware},
                                  {k: mine.facts.get(k) for k in hardware}, a_name="profile", b_name="this node")
        raise InputError(where, f"profile is for node class {theirs['id']}, this node is {mine.id}: {why}",
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
        raise InputError(where, f"stale profile: {why}",
                         hint="re-sweep one node of the class and re-run `nccltune fleet decide`")
    validate_env(doc["env"], source=f"{where}: env")
    if TOPO_FILE in doc["env"]:
        raise InputError(where, f"env: {TOPO_FILE} is set per node; a profile says topology_file: true instead")


def _note(path: Path, doc: Mapping[str, Any]) -> str:
    nodes = doc["evidence"]["nodes"]
    samples = sum(int(n["baseline_trials"]) + int(n["candidate_trials"]) for n in nodes)
    return (f"class profile {path.name} (class {doc['node_class']['id']}, {doc['chosen']}, "
            f"{len(nodes)} node(s), {samples} trial(s))")


def publish_profile(cfg: Config, env: Mapping[str, str], prov: Provenance,
                    tuner: Tuner | None = None) -> PublishedFiles:
    """The one place a profile is published: the node's publish directory (with the profile's
    tuner plugin and table, when given: files of the generation) and, where configured, the
    managed block of its NCCL conf file."""
    published = publish(cfg.publish_dir, env, prov, tuner=tuner)
    if cfg.nccl_conf is not None:
        update_nccl_conf(cfg.nccl_conf, env, prov)
    return published


def profile_in(directory: Path, class_id: str) -> Path:
    """`<directory>/<class id>.json`: where `fleet decide --out` results are kept per class.

    Raises:
        InputError: there is no profile for this class there (exit 78).
    """
    path = directory / f"{class_id}.json"
    if not path.is_file():
        there = sorted(p.stem for p in directory.glob("*.json"))
        raise InputError(str(directory), f"no profile for this node's class {class_id} "
                         f"(profiles there: {', '.join(there) or 'none'})",
                         hint="decide one from this class's exports with `nccltune fleet decide`")
    return path


def apply_profile(cfg: Config, path: Path, *, demo: str | bool | None = None, python: str | None = None,
                  now: _dt.datetime | None = None) -> ApplyResult:
    """Check `path` against this node and publish it. A directory stands for the profile of this
    node's class in it (see profile_in).

    Raises:
        InputError: the profile is malformed or not for this node (exit 78); nothing was written.
        PublishError, BusyError: as publish.publish.
    """
    node = load_fleet_node(cfg, demo)
    nccl_version = node_nccl_version(cfg, node, python)
    if path.is_dir():
        path = profile_in(path, node.node_class(nccl_version).id)
    doc, _raw = read_json_document(path, "profile", PROFILE_KIND)
    check_profile(doc, str(path), node, nccl_version)
    # Pins of this node's config win, as they do over a node's own sweep.
    env = {**doc["env"], **cfg.sweep.pin}
    validate_env(env, source=f"{cfg.path or 'config'}: sweep.pin")
    from ..tuning import tuning_fingerprint

    tuning_fp = tuning_fingerprint(cfg, topology_fingerprint(node.topo), nccl_version, node.demo)
    # Checked (and the plugin built) before anything is written; the table carries the fingerprint
    # the node publishes, which the plugin checks.
    tuner, table_note = profile_tuner(cfg, doc, str(path), tuning_fp, os.environ)
    if doc["topology_file"]:
        # The class shares the tree's shape, not its bus ids: each node points NCCL at its own XML.
        atomic_write(cfg.topology_file, render_xml(node.topo.system))
        env[TOPO_FILE] = str(cfg.topology_file)
    note = _note(path, doc) + (f"; {table_note}" if table_note else "")
    prov = Provenance(
        nccltune_version=__version__,
        created_at=(now or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds"),
        topology_fingerprint=topology_fingerprint(node.topo), nccl_version=nccl_version,
        backend=str(doc["backend"]), demo=bool(doc["demo"]), profile=str(doc["evidence"]["rules"]["profile"]),
        gains=profile_gains(doc), note=note,
        # What the daemon computes for this node's NCCL and sweep settings: it takes the profile as
        # current, and re-tunes only when one of them changes (as after its own sweep).
        tuning_fingerprint=tuning_fp,
        state="tuned")
    published = publish_profile(cfg, env, prov, tuner)
    log.info("applied %s: generation %d", note, published.generation)
    return ApplyResult(path, str(doc["node_class"]["id"]), env, published, note)
