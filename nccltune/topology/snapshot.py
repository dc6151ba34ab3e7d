"""Snapshot files: record this node's raw readings, and load recorded ones (`--input`)."""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

from ..errors import InputError
from ..hw.nvml import read_nvml
from ..hw.sysfs import read_sysfs
from ..hw.types import SNAPSHOT_SCHEMA_VERSION, Snapshot, SnapshotFormatError, from_dict, to_dict
from ..names import short_hostname

SNAPSHOT_KIND = "nccltune-snapshot"


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
        InputError: malformed JSON (with its line), wrong kind, unknown schema version, or a
            field that does not match the schema (named by its JSON path). Exit 78.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(path, f"not valid JSON: {exc.msg}", line=exc.lineno) from exc
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
        return from_dict(Snapshot, doc)
    except SnapshotFormatError as exc:
        raise InputError(path, f"bad snapshot field {exc.where}: {str(exc).split(': ', 1)[1]}") from exc


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Load a snapshot file. Raises InputError (exit 78) on any fault, naming the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InputError(str(p), f"cannot read: {exc.strerror}") from exc
    return parse_snapshot(text, str(p))


def save_snapshot(snap: Snapshot, path: str | os.PathLike[str]) -> None:
    from ..publish import atomic_write

    atomic_write(Path(path), snapshot_to_json(snap))
