"""The node a fleet command speaks for: this one (NVML), the configured snapshot, or a demo
snapshot; its topology as the sweep fingerprints it, and its class."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..config import Config
from ..topology.model import Topology
from ..topology.nodeclass import NodeClass, node_class
from ..topology.source import load_topology, resolve_snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetNode:
    """`topo` is built as the sweep builds it (so its fingerprint names the sweep's runs);
    `class_topo` always includes the NICs, which are part of the class."""

    topo: Topology
    class_topo: Topology
    demo: bool

    def node_class(self, nccl_version: str | None) -> NodeClass:
        return node_class(self.class_topo, nccl_version=nccl_version)


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
    return FleetNode(topo, class_topo, bool(demo))
