"""Snapshot files: record this node's raw readings, and load recorded ones (`--input`)."""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

from ..errors import InputError
from ..files.inputfile import parse_json, read_input_text
from ..hw.nvml import read_nvml
from ..hw.sysfs import read_sysfs
from ..hw.types import SNAPSHOT_SCHEMA_VERSION, Snapshot, SnapshotFormatError, from_dict, to_dict
from ..names import short_hostname

SNAPSHOT_KIND = "nccltune-snapshot"
# NCCL_TOPO_MAX_NODES: the most nodes of one kind (GPUs among them) NCCL's topology holds.
MAX_GPUS = 256
# A recorded node is tens of KiB; far beyond that is no snapshot.
MAX_SNAPSHOT_BYTES = 64 << 20


def record_snapshot(sysfs_root: str | os.PathLike[str] = "/", description: str | None = None) -> Snapshot:
    """Read this node through NVML and sysfs.

    Raises:
        UnavailableError: NVML is not usable here (exit 69).
    """
    nvml = read_nvml()
    sysfs = read_sysfs(sysfs_root, [g.bus_id for g in nvml.gpus])
    return Snapshot(
        nvml=nvml,
        sysfs=sysfs,
        hostname=short_hostname(),
        recorded_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        description=description,
    )


def snapshot_to_json(snap: Snapshot) -> str:
    doc = {"kind": SNAPSHOT_KIND, **to_dict(snap)}
    return json.dumps(doc, indent=2, sort_keys=False) + "\n"


def parse_snapshot(text: str, path: str = "<snapshot>") -> Snapshot:
    """Parse a snapshot document.

    Raises:
        InputError: not strict JSON (files.inputfile.parse_json: with its line and column;
            NaN, a key twice, too deep, over MAX_SNAPSHOT_BYTES), wrong kind, unknown schema version, or a
            field that does not match the schema (named by its JSON path). Exit 78.
    """
    doc = parse_json(text, path, max_bytes=MAX_SNAPSHOT_BYTES)
    if not isinstance(doc, dict):
        raise InputError(path, "a snapshot is a JSON object")
    kind = doc.pop("kind", None)
    if kind != SNAPSHOT_KIND:
        raise InputError(path, f"not an nccltune snapshot (kind is {kind!r}, expected {SNAPSHOT_KIND!r})")
    version = doc.get("schema_version")
    if version != SNAPSHOT_SCHEMA_VERSION:
        raise InputError(
            path,
            f"unknown snapshot schema_version {version!r}; this nccltune reads version {SNAPSHOT_SCHEMA_VERSION}",
        )
    try:
        snap = from_dict(Snapshot, doc)
    except SnapshotFormatError as exc:
        raise InputError(path, f"bad snapshot field {exc.where}: {str(exc).split(': ', 1)[1]}") from exc
    except RecursionError as exc:
        raise InputError(path, "JSON nested too deeply to be a snapshot") from exc
    validate_snapshot(snap, path)
    return snap


def validate_snapshot(snap: Snapshot, path: str) -> None:
    """What no real node can show, refused for every use of a snapshot alike (`topo --input`,
    `topo diff`, `sweep --plan` and the sweep itself all load through parse_snapshot).

    Raises:
        InputError: more GPUs than NCCL's topology holds, or two GPUs with the same bus id or
            index (the XML would get two identical <pci>), naming the JSON path (exit 78).
    """
    gpus = snap.nvml.gpus
    if len(gpus) > MAX_GPUS:
        raise InputError(path, f"nvml.gpus: {len(gpus)} GPUs; NCCL's topology of one node holds at most {MAX_GPUS}")
    seen_bus: dict[str, int] = {}
    seen_index: dict[int, int] = {}
    for i, gpu in enumerate(gpus):
        bus = gpu.bus_id.lower()
        if bus in seen_bus:
            raise InputError(path, f"nvml.gpus[{i}].bus_id: {gpu.bus_id} is also the bus id of "
                             f"nvml.gpus[{seen_bus[bus]}]")
        if gpu.index in seen_index:
            raise InputError(path, f"nvml.gpus[{i}].index: {gpu.index} is also the index of "
                             f"nvml.gpus[{seen_index[gpu.index]}]")
        seen_bus[bus] = i
        seen_index[gpu.index] = i


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Load a snapshot file. Raises InputError (exit 78) on any fault, naming the file."""
    p = Path(path)
    return parse_snapshot(read_input_text(p, MAX_SNAPSHOT_BYTES, "snapshot", not_text="not UTF-8 text (not a snapshot)",
                                          trusted=True), str(p))


def save_snapshot(snap: Snapshot, path: str | os.PathLike[str]) -> None:
    from ..files.atomicfile import atomic_write

    atomic_write(Path(path), snapshot_to_json(snap))
