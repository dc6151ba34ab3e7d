"""The node a sweep or verify runs on: its topology, how ranks start there, and who uses its GPUs.

Loaded once per sweep (and once by the daemon at start and on topology changes); the CPU demo
loads a recorded snapshot instead of asking NVML.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .config import Config
from .errors import BusyError, UnavailableError
from .hw.types import Snapshot
from .records import Backend
from .topology.fingerprint import topology_fingerprint
from .topology.model import Topology, from_snapshot
from .topology.paths import PathMatrix, compute_paths
from .topology.snapshot import load_snapshot, record_snapshot
from .topology.source import resolve_snapshot

log = logging.getLogger(__name__)

# Why a node with one GPU (or bench.nranks 1) has no sweep or verification: there is no
# collective between GPUs to time. It still publishes what fits every job.
ONE_GPU = "one GPU: no collective between GPUs to measure"

# The demo ladder stays small: gloo on two CPU cores moves megabytes, not gigabytes, per second.
DEMO_SIZES = (4096, 16384, 65536, 262144, 1048576, 4194304)
DEMO_WARMUP, DEMO_ITERS = 2, 5


@dataclass
class Node:
    """What a sweep runs on: the topology, and how ranks are started there."""

    topo: Topology
    paths: PathMatrix
    snapshot: Snapshot
    demo: bool
    backend: Backend
    nranks: int

    @property
    def fingerprint(self) -> str:
        return topology_fingerprint(self.topo)

    @property
    def measurable(self) -> bool:
        """Two ranks or more: a collective between GPUs can be timed here."""
        return self.nranks >= 2


def size_ladder(cfg: Config, demo: bool) -> list[int]:
    """The message sizes a sweep measures: bench.min_bytes up to max_bytes by bench.factor."""
    if demo:
        return list(DEMO_SIZES)
    sizes, s = [], cfg.bench.min_bytes
    while s <= cfg.bench.max_bytes:
        sizes.append(s)
        s *= cfg.bench.factor
    return sizes


def iterations(cfg: Config, node: Node) -> tuple[int, int]:
    """(warm-up, timed) iterations per size of a trial on this node."""
    return (DEMO_WARMUP, DEMO_ITERS) if node.demo else (cfg.bench.warmup_iters, cfg.bench.iters)


def load_node(cfg: Config, demo: str | bool | None) -> Node:
    """The node to sweep: this one (NVML), or a recorded snapshot for the CPU demo.

    A node with one GPU loads with one rank (``measurable`` is false): a sweep of it alone publishes
    what fits every job, verify and the daemon's scheduler measure nothing; a sweep over several
    such nodes measures the job shape N x 1.

    Raises:
        UnavailableError: no NVIDIA GPU here and no --demo (exit 69).
    """
    if demo:
        path = resolve_snapshot(demo if isinstance(demo, str) else cfg.topology.snapshot)
        snap = load_snapshot(path)
        topo = from_snapshot(snap, with_nics=cfg.topology.with_nics, source=f"snapshot:{path.name} (CPU demo)")
        # Two gloo ranks stand in for the GPUs; a recording of one GPU runs one, as that node would.
        return Node(topo, compute_paths(topo), snap, True, "gloo", cfg.bench.nranks or min(2, len(snap.nvml.gpus)))
    if cfg.topology.snapshot:
        snap = load_snapshot(resolve_snapshot(cfg.topology.snapshot))
        source = f"snapshot:{cfg.topology.snapshot}"
    else:
        try:
            snap = record_snapshot()
        except UnavailableError as exc:
            raise UnavailableError(
                f"no NVIDIA GPU can be used here: {exc.message}",
                hint="run `nccltune sweep --demo` for the same pipeline on the CPU (gloo) over a recorded "
                     "topology",
            ) from exc
        source = "nvml"
    if not snap.nvml.gpus:
        raise UnavailableError("NVML sees no GPU on this node", hint="use --demo on machines without GPUs")
    topo = from_snapshot(snap, with_nics=cfg.topology.with_nics, source=source)
    backend: Backend = "gloo" if cfg.bench.backend == "gloo" else "nccl"
    gpus = cfg.bench.gpus or [g.index for g in snap.nvml.gpus]
    nranks = cfg.bench.nranks or len(gpus)
    if nranks < 2:
        log.info("%s on this node", ONE_GPU)
    return Node(topo, compute_paths(topo), snap, False, backend, nranks)


def busy_gpus(snap: Snapshot) -> dict[int, tuple[int, ...]]:
    """GPU index -> pids of the compute processes on it, for the GPUs that have any."""
    return {g.index: tuple(p.pid for p in g.processes) for g in snap.nvml.gpus if g.processes}


def require_idle(node: Node, force: bool) -> None:
    """A sweep measures only idle GPUs (the CPU demo has none to share).

    Raises:
        BusyError: compute processes use the GPUs and `force` is off (exit 75).
    """
    if node.demo or force:
        return
    busy = busy_gpus(node.snapshot)
    if busy:
        procs = "; ".join(f"GPU{i}: pid {', '.join(map(str, p))}" for i, p in busy.items())
        raise BusyError(f"compute processes are using the GPUs ({procs}); a sweep would disturb them",
                        hint="wait for them to finish, or pass --force")
