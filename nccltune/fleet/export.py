"""`nccltune export`: a node's measurements from its history store as one JSON document.

The document is what `nccltune fleet decide` pools across the nodes of one class: every trial
with its per-size results and environment, the versions they ran with, the node's class and
topology fingerprint. It holds no time of export and lists everything in a fixed order, so two
exports of the same history are byte-identical (a shared filesystem or config management can
tell a changed export from an unchanged one).

It is written as it is read from the history, one trial at a time (`write_export`), so that the
memory an export takes does not grow with the history; and it is held, as it is written, to what
`fleet decide` reads (its schema, finite numbers, UTF-8 text, its size bound): an export decide
would refuse is refused (exit 78) and nothing is written.
"""

from __future__ import annotations

import io
import json
import logging
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from .. import __version__
from ..errors import CheckFailed, InputError
from ..files.inputfile import loads_strict, lone_surrogate
from ..store import RunRecord, Store, TrialRecord
from ..topology.fingerprint import topology_fingerprint
from ..topology.model import Topology
from . import document
from .gate import export_gate
from .jsonschema import SchemaViolation, load_schema, validate
from .member import FleetNode

log = logging.getLogger(__name__)

# The document's kind is its schema's name (schemas/export.schema.json); exports written before
# say "nccltune-export", which readers still take.
EXPORT_KIND = "export"
EXPORT_SCHEMA_VERSION = 1
WHERE = "nccltune export"  # what a refusal names


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


def run_nccl_version(run: RunRecord, trials: Iterable[TrialRecord]) -> str | None:
    """The NCCL version a run measured: the run's own field, else the first trial that reported one
    (the sweep learns it from its first finished trial); `trials` is read only as far as needed."""
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


def _run_doc(run: RunRecord, nccl_version: str | None) -> dict[str, Any]:
    """A run's part of the document, but its trials (which are streamed)."""
    return {
        "nranks": run.configured_nranks,
        "job": run_job(run),
        "id": run.id, "kind": run.kind, "status": run.status, "started_at": run.started_at,
        "finished_at": run.finished_at, "backend": run.backend, "demo": run.demo, "profile": run.profile,
        "nccl_version": nccl_version, "driver_version": run.driver_version, "torch_version": run.torch_version,
        "nccltune_version": run.nccltune_version, "hostname": run.hostname,
        "chosen_env": dict(sorted((run.chosen_env or {}).items())),
        "published_generation": run.published_generation,
    }


def select_run_ids(store: Store, fingerprint: str, run_id: int | None) -> list[int]:
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
        return [run_id]
    ids = store.run_ids("sweep", "ok", fingerprint)
    if not ids:
        raise CheckFailed(f"no ok sweep of topology {fingerprint} in the history", hint="run `nccltune sweep` first")
    return ids


@dataclass(frozen=True)
class Written:
    """What write_export wrote: the runs, the node's name, the document's size in bytes."""

    runs: int
    hostname: str
    size: int


class _Lazy:
    """A list of the document that is made one item at a time as it is written."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items


@dataclass(frozen=True)
class _Text:
    """A part of the document already written as JSON text (json.dumps, indent 2, sorted keys)."""

    text: str


class _Sink:
    """The document's bytes into `out`, at most `limit` of them: what fleet decide reads."""

    def __init__(self, out: BinaryIO, limit: int) -> None:
        self.out, self.limit, self.size = out, limit, 0

    def write(self, text: str) -> None:
        data = text.encode("ascii")  # json.dumps escapes everything else
        self.size += len(data)
        if self.size > self.limit:
            raise InputError(WHERE, f"the export would be larger than {self.limit} bytes, the most `nccltune fleet "
                             "decide` reads", hint="export fewer runs: one sweep per export (--run ID), the newest "
                             "of this node's class")
        self.out.write(data)


def _emit(sink: _Sink, value: Any, level: int) -> None:
    """`value` as json.dumps(value, indent=2, sort_keys=True) writes it at nesting `level`: a
    _Lazy list item by item, a dict holding one key by key, a _Text as it is."""
    pad = "  " * level
    if isinstance(value, _Lazy):
        first = True
        sink.write("[")
        for item in value.items:
            sink.write(("\n" if first else ",\n") + pad + "  ")
            first = False
            _emit(sink, item, level + 1)
        sink.write("]" if first else "\n" + pad + "]")
    elif isinstance(value, dict) and any(isinstance(v, _Lazy) for v in value.values()):
        sink.write("{")
        for i, key in enumerate(sorted(value)):
            sink.write(("\n" if i == 0 else ",\n") + pad + "  " + json.dumps(key) + ": ")
            _emit(sink, value[key], level + 1)
        sink.write("\n" + pad + "}")
    else:
        text = value.text if isinstance(value, _Text) else json.dumps(value, indent=2, sort_keys=True)
        sink.write(text.replace("\n", "\n" + pad))


def _checked(doc: dict[str, Any], part: str, where: str, what: str) -> str:
    """`doc`, the export schema's `part` ($defs; "" for the document), as fleet decide would take
    it (read_json_document): valid against its schema, every number finite, every text with a
    UTF-8 form; its JSON text (indent 2, sorted keys).

    Raises:
        InputError: naming `what` and the JSON path (exit 78).
    """
    root = load_schema(EXPORT_KIND)
    try:
        validate(doc, root["$defs"][part] if part else root, root, where)
        text = json.dumps(doc, indent=2, sort_keys=True, allow_nan=False)
    except SchemaViolation as exc:
        raise InputError(WHERE, f"{what} ({exc.where}): {exc.detail}, which `nccltune fleet decide` refuses",
                         hint=f"the format is schemas/{EXPORT_KIND}.schema.json; export other runs (--run ID)",
                         ) from None
    except ValueError as exc:
        raise InputError(WHERE, f"{what} ({where}): a number JSON cannot carry ({exc}), which `nccltune fleet "
                         "decide` refuses", hint="export other runs (--run ID)") from None
    if "\\ud" in text:
        bad = lone_surrogate(doc, where)
        if bad is not None:
            raise InputError(WHERE, f"{what} ({bad}): a text without a UTF-8 form (a lone surrogate), which `nccltune "
                             "fleet decide` refuses", hint="export other runs (--run ID)")
    return text


def write_export(store: Store, node: NodeIdentity, out: BinaryIO, run_id: int | None = None, *,
                 limit: int | None = None) -> Written:
    """Write the export document of the selected runs to `out`, streamed: what is held at any
    time is one run's record and one trial, whatever the history's size. The bytes are those of
    dumps_export of the whole document.

    Runs measured with another NCCL version than the newest selected one are left out (with a
    warning): they describe another class, since the class includes the NCCL version. What is
    written is held to what `fleet decide` reads (read_json_document): each part valid against
    the export schema, no NaN or Infinity, no text without a UTF-8 form, at most `limit` bytes
    (default fleet.document.MAX_DOCUMENT_BYTES).

    Raises:
        InputError: the document would be one fleet decide refuses (exit 78); what reached `out`
            is then to be thrown away (`nccltune export` writes through a temp file). Also as
            select_run_ids.
        CheckFailed: no ok sweep of this topology (exit 1).
    """

    fingerprint = topology_fingerprint(node.topo)
    ids = select_run_ids(store, fingerprint, run_id)
    versions: list[str | None] = []
    torch = None
    for i in ids:
        run = store.run(i)
        assert run is not None
        versions.append(run_nccl_version(run, store.iter_trials(i, measurements=False)))
        torch = run.torch_version or torch
    nccl_version = versions[-1]
    kept = []
    for i, version in zip(ids, versions, strict=True):
        if version != nccl_version:
            log.warning("leaving run %d out of the export: it measured NCCL %s, the newest run NCCL %s",
                        i, version, nccl_version)
            continue
        kept.append(i)
    # The one class definition (fleet.member): the NCCL version is what the worker reported in these runs.
    cls = FleetNode(node.topo, node.class_topo, node.demo).node_class(nccl_version)
    head = {
        "kind": EXPORT_KIND,
        "schema_version": EXPORT_SCHEMA_VERSION,
        "hostname": node.hostname,
        "demo": node.demo,
        "topology_fingerprint": fingerprint,
        "node_class": cls.as_dict(),
        "versions": {"nccltune": __version__, "nccl": nccl_version, "driver": node.topo.driver_version,
                     "torch": torch},
    }
    gate = _upgrade_gate(store, kept)
    if gate is not None:
        head["upgrade_gate"] = gate
    _checked({**head, "runs": []}, "", "$", "the export")

    def trials(n: int, run: int) -> Iterator[_Text]:
        for j, t in enumerate(store.iter_trials(run)):
            yield _Text(_checked(_trial_doc(t), "trial", f"$.runs[{n}].trials[{j}]", f"run {run} trial {t.seq}"))

    def runs() -> Iterator[dict[str, Any]]:
        for n, i in enumerate(kept):
            record = store.run(i)
            assert record is not None
            doc = _run_doc(record, nccl_version)
            _checked({**doc, "trials": []}, "run", f"$.runs[{n}]", f"run {i}")
            yield {**doc, "trials": _Lazy(trials(n, i))}

    sink = _Sink(out, document.MAX_DOCUMENT_BYTES if limit is None else limit)
    _emit(sink, {**head, "runs": _Lazy(runs())}, 0)
    sink.write("\n")
    return Written(len(kept), node.hostname, sink.size)


def _upgrade_gate(store: Store, kept: list[int]) -> dict[str, Any] | None:
    """The upgrade gate of the newest exported run (fleet/upgrade.py), for `fleet status`."""
    return export_gate(store, max(kept)) if kept else None


def build_export(store: Store, node: NodeIdentity, run_id: int | None = None) -> dict[str, Any]:
    """The export document of the selected runs, in memory (write_export's, read back)."""
    buffer = io.BytesIO()
    write_export(store, node, buffer, run_id)
    doc: dict[str, Any] = loads_strict(buffer.getvalue())
    return doc


def dumps_export(doc: dict[str, Any]) -> str:
    """Deterministic text: sorted keys, two-space indent, a final newline (what write_export writes)."""
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
