"""The node a fleet command speaks for: this one (NVML), the configured snapshot, or a demo
snapshot; its topology as the sweep fingerprints it, and its class.

The class is one definition everywhere (`nccltune topo`, `export`, `apply`, the daemon and the
metrics' `class` label): the node's hardware facts with the NICs, the driver NVML reports, and
the NCCL version the worker interpreter reports (the one the jobs load). A CPU demo runs no
NCCL, so its class has none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..config import Config
from ..images import parse_image
from ..node import Node
from ..topology.model import Topology, from_snapshot
from ..topology.nodeclass import NodeClass, node_class
from ..topology.source import load_topology, resolve_snapshot

log = logging.getLogger(__name__)

DEMO_NCCL = "a CPU demo runs no NCCL"


@dataclass(frozen=True)
class FleetNode:
    """`topo` is built as the sweep builds it (so its fingerprint names the sweep's runs);
    `class_topo` always includes the NICs, which are part of the class."""

    topo: Topology
    class_topo: Topology
    demo: bool
    image_digest: str | None = None  # bench.image's digest: the NCCL of the class is the image's

    def node_class(self, nccl_version: str | None) -> NodeClass:
        return node_class(self.class_topo, nccl_version=None if self.demo else nccl_version,
                          image_digest=self.image_digest)


@dataclass(frozen=True)
class WorkerNccl:
    """The NCCL version the node's jobs load, and where that came from (for `nccltune topo`)."""

    version: str | None
    source: str


def image_digest(cfg: Config) -> str | None:
    """bench.image's digest, a fact of the node's class; None without bench.image."""
    return parse_image(cfg.bench.image[0]).digest if cfg.bench.image else None


def load_fleet_node(cfg: Config, demo: str | bool | None) -> FleetNode:
    """The same source the sweep reads (pipeline.load_node), without its GPU checks.

    Raises:
        UnavailableError: no NVML here and no snapshot or --demo (exit 69).
        InputError: a malformed snapshot (exit 78).
    """
    if demo:
        source: str | None = str(resolve_snapshot(demo if isinstance(demo, str) else cfg.topology.snapshot))
    else:
        source = str(resolve_snapshot(cfg.topology.snapshot)) if cfg.topology.snapshot else None
    topo = load_topology(source, with_nics=cfg.topology.with_nics)
    class_topo = topo if cfg.topology.with_nics else load_topology(source)
    return FleetNode(topo, class_topo, bool(demo), image_digest(cfg))


def fleet_node_of(cfg: Config, node: Node) -> FleetNode:
    """The fleet view of a node the sweep (or the daemon) already loaded: no second reading of NVML."""
    class_topo = node.topo if cfg.topology.with_nics else from_snapshot(node.snapshot, source=node.topo.source)
    return FleetNode(node.topo, class_topo, node.demo, image_digest(cfg))


def worker_nccl(cfg: Config, demo: bool, python: str | None = None, *, strict: bool = False) -> WorkerNccl:
    """The NCCL version this node's jobs load, as the sweep's worker interpreter (bench.python,
    or --python) reports it; None in the CPU demo and where the worker has no torch.

    Raises:
        UnavailableError: with `strict`, no interpreter with torch was found (exit 69).
    """
    if demo:
        return WorkerNccl(None, DEMO_NCCL)
    if cfg.bench.image:
        from ..trials.container import probe_image

        container, probed = probe_image(cfg.bench)
        where = f"as the image {container.image.ref} reports it"
        return WorkerNccl(probed.get("nccl_version"), where if probed.get("nccl_version") else
                          f"the image {container.image.ref} reports none ({probed.get('error', 'no NCCL')})")
    from ..errors import UnavailableError
    from ..trials.probe import probe_nccl
    from ..trials.runner import find_worker_python

    try:
        interpreter = find_worker_python(python or cfg.bench.python)
    except UnavailableError as exc:
        if strict:
            raise
        return WorkerNccl(None, f"no worker interpreter ({exc.message})")
    got = probe_nccl(interpreter)
    version = got.get("nccl_version")
    if isinstance(version, str) and version:
        return WorkerNccl(version, f"as the worker interpreter {interpreter} reports it")
    why = got.get("error") or "its torch has no NCCL"
    return WorkerNccl(None, f"the worker interpreter {interpreter} reports none ({why})")
