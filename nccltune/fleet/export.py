"""`nccltune export`: a node's measurements from its history store as one JSON document.

The document is what `nccltune fleet decide` pools across the nodes of one class: every trial
with its per-size results and environment, the versions they ran with, the node's class and
topology fingerprint. It holds no time of export and lists everything in a fixed order, so two
exports of the same history are byte-identical (a shared filesystem or config management can
tell a changed export from an unchanged one).
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..errors import CheckFailed, InputError
from ..store import RunRecord, Store, TrialRecord
from ..topology.fingerprint import topology_fingerprint
from ..topology.model import Topology
from .node import FleetNode

log = logging.getLogger(__name__)

# The document's kind is its schema's name (schemas/export.schema.json); exports written before
# say "nccltune-export", which readers still take.
EXPORT_KIND = "export"
EXPORT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class NodeIdentity:
    """What the export says about the node besides its runs: `topo` as the sweep fingerprints
    it, `class_topo` with the NICs (which the class always includes)."""

    topo: Topology
    class_topo: Topology
    hostname: str
    demo: bool


def node_identity(node: FleetNode) -> NodeIdentity:
    """A demo node is named by its snapshot's hostname (several demo nodes share one machine)."""
    host = socket.gethostname().split(".")[0]
    snap = node.class_topo.snapshot
    if node.demo and snap is not None and snap.hostname:
        host = snap.hostname
    return NodeIdentity(node.topo, node.class_topo, host, node.demo)


def run_nccl_version(run: RunRecord, trials: list[TrialRecord]) -> str | None:
    """The NCCL version a run measured: the run's own field, else the first trial that reported one
    (the sweep learns it from its first finished trial)."""
    if run.nccl_version:
        return run.nccl_version
    for t in trials:
        version = (t.nccl or {}).get("version")
        if isinstance(version, str) and version:
            return version
    return None


def _trial_doc(t: TrialRecord) -> dict[str, Any]:
    channels = (t.nccl or {}).get("coll_channels")
    return {
        "seq": t.seq, "phase": t.phase, "label": t.label, "env": dict(sorted(t.env.items())),
        "status": t.status, "reason": t.reason, "wall_s": t.wall_s,
        # The communicator's channel count as NCCL's log showed it: the per-size choice places a
        # channel candidate above or below it.
        "coll_channels": channels if isinstance(channels, int) and channels > 0 else None,
        "measurements": [m.to_doc() for m in t.measurements],
    }


# What an export says of a run's job shape (trials.launch.Launch.record, less the class the export holds).
JOB_KEYS = ("label", "nnodes", "ranks_per_node", "loopback", "launcher")


def run_job(run: RunRecord) -> dict[str, Any] | None:
    """The job shape a sweep for another shape (several nodes, NIC loopback) measured, as its run
    was stored; None for a sweep of this node's own ranks."""
    job = run.topology.get("job") if isinstance(run.topology, dict) else None
    return {k: job.get(k) for k in JOB_KEYS} if isinstance(job, dict) else None


def _run_doc(run: RunRecord, trials: list[TrialRecord], nccl_version: str | None) -> dict[str, Any]:
    return {
        "nranks": run.configured_nranks,
        "job": run_job(run),
        "id": run.id, "kind": run.kind, "status": run.status, "started_at": run.started_at,
        "finished_at": run.finished_at, "backend": run.backend, "demo": run.demo, "profile": run.profile,
        "nccl_version": nccl_version, "driver_version": run.driver_version, "torch_version": run.torch_version,
        "nccltune_version": run.nccltune_version, "hostname": run.hostname,
        "chosen_env": dict(sorted((run.chosen_env or {}).items())),
        "published_generation": run.published_generation,
        "trials": [_trial_doc(t) for t in trials],
    }


def select_runs(store: Store, fingerprint: str, run_id: int | None) -> list[RunRecord]:
    """The run asked for, or every ok sweep of this topology, oldest first.

    Raises:
        InputError: the run does not exist, is not a finished sweep, or was measured on another
            topology (exit 78).
        CheckFailed: no ok sweep of this topology in the store (exit 1).
    """
    if run_id is not None:
        run = store.run(run_id)
        if run is None:
            raise InputError("--run", f"no run {run_id} in the history")
        if run.kind != "sweep" or run.status != "ok":
            raise InputError("--run", f"run {run_id} is a {run.status} {run.kind}, not an ok sweep")
        if run.fingerprint != fingerprint:
            raise InputError("--run", f"run {run_id} was measured on topology {run.fingerprint}, this node is "
                             f"{fingerprint}", hint="a node's export describes its current topology")
        return [run]
    runs = [r for r in store.runs(limit=None, kind="sweep") if r.status == "ok" and r.fingerprint == fingerprint]
    if not runs:
        raise CheckFailed(f"no ok sweep of topology {fingerprint} in the history", hint="run `nccltune sweep` first")
    return sorted(runs, key=lambda r: r.id)


def build_export(store: Store, node: NodeIdentity, run_id: int | None = None) -> dict[str, Any]:
    """The export document of the selected runs.

    Runs measured with another NCCL version than the newest selected one are left out (with a
    warning): they describe another class, since the class includes the NCCL version.
    """
    fingerprint = topology_fingerprint(node.topo)
    runs = select_runs(store, fingerprint, run_id)
    with_trials = [(r, store.trials(r.id)) for r in runs]
    versions = [run_nccl_version(r, t) for r, t in with_trials]
    nccl_version = versions[-1]
    kept = []
    for (run, trials), version in zip(with_trials, versions, strict=True):
        if version != nccl_version:
            log.warning("leaving run %d out of the export: it measured NCCL %s, the newest run NCCL %s",
                        run.id, version, nccl_version)
            continue
        kept.append(_run_doc(run, trials, version))
    # The one class definition (fleet.node): the NCCL version is what the worker reported in these runs.
    cls = FleetNode(node.topo, node.class_topo, node.demo).node_class(nccl_version)
    return {
        "kind": EXPORT_KIND,
        "schema_version": EXPORT_SCHEMA_VERSION,
        "hostname": node.hostname,
        "demo": node.demo,
        "topology_fingerprint": fingerprint,
        "node_class": cls.as_dict(),
        "versions": {"nccltune": __version__, "nccl": nccl_version, "driver": node.topo.driver_version,
                     "torch": next((r.torch_version for r, _ in reversed(with_trials) if r.torch_version), None)},
        "runs": kept,
    }


def dumps_export(doc: dict[str, Any]) -> str:
    """Deterministic text: sorted keys, two-space indent, a final newline."""
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
