"""Where a topology comes from: this node (NVML + sysfs), a recorded snapshot, or an NCCL XML."""

from __future__ import annotations

from pathlib import Path

from .model import Topology, from_snapshot
from .ncclxml import load_xml, looks_like_xml
from .snapshot import load_snapshot, record_snapshot

_PACKAGE_TOPOLOGIES = Path(__file__).resolve().parents[1] / "data"
DEFAULT_DEMO_SNAPSHOT = "h200x2-nvswitch-vm.json"


def bundled_topologies_dir() -> Path:
    """`topologies/` of the source tree, or its copy installed as package data."""
    repo = Path(__file__).resolve().parents[2] / "topologies"
    return repo if repo.is_dir() else _PACKAGE_TOPOLOGIES


def resolve_snapshot(name: str | None) -> Path:
    """A snapshot path, or the name of a bundled one (with or without `.json`)."""
    if name is None:
        name = DEFAULT_DEMO_SNAPSHOT
    p = Path(name)
    if p.exists():
        return p
    bundled = bundled_topologies_dir()
    for candidate in (bundled / name, bundled / f"{name}.json"):
        if candidate.exists():
            return candidate
    return p  # let the loader report it missing, naming the path the user gave


def load_topology(input_path: str | None = None, *, with_nics: bool = True,
                  sysfs_root: str = "/") -> Topology:
    """The topology of this node, or of a snapshot / NCCL XML file given as input.

    Raises:
        UnavailableError: reading this node needs NVML and it is not there (exit 69).
        InputError: the input file is malformed (exit 78).
    """
    if input_path is None:
        snap = record_snapshot(sysfs_root)
        return from_snapshot(snap, with_nics=with_nics, source="nvml")
    path = resolve_snapshot(input_path)
    if looks_like_xml(path):
        return load_xml(path)
    snap = load_snapshot(path)
    return from_snapshot(snap, with_nics=with_nics, source=f"snapshot:{path}")
