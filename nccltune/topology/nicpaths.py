"""GPU-NIC paths as NCCL finally uses them, and the NIC NCCL picks for each GPU.

`paths.compute_paths` gives the raw GPU-NIC types (what ncclTopoSetPaths finds). NCCL then
re-routes some of them in `paths.cc:ncclTopoComputePaths`, after the P2P checks, in this order:

1. P2C (2.27+): a GPU that reaches its local CPU over a C2C link, to a NIC on that CPU's PCIe,
   gets P2C instead of PHB (`mergePathType`: PHB merged with C2C is P2C), in both directions.
   NCCL 2.28 does this for every NIC; 2.29 and later only for the GPU's local NICs
   (`ncclTopoGetLocal`), so that a NIC further away is reached by PXN instead.
2. PXN, unless NCCL_PXN_DISABLE=1: GPU g goes to NIC n through peer GPU p, the NIC's local GPU
   (`topo.cc:ncclTopoGetLocalGpu`), when p's path to n is at most PXB (at most P2C with
   NCCL_PXN_C2C=1, the 2.28 default), p reaches g over NVLink (at most NVL), and p has more
   bandwidth to n than g has, or g's own path is worse than PXN. NCCL 2.30 also needs GDR
   between p and n (`ncclTopoCheckGdr` with read=1); 2.28 does not look at GDR here.
   Only the GPU-to-NIC direction changes (`addInterStep(GPU p, GPU g, NET n)`).
3. GDR: a path better than PHB on which GDR is not possible is sent through the GPU's local CPU
   instead, both directions (type = the two legs merged, bandwidth = the narrower leg).

The NIC a GPU uses (`topo.cc:ncclTopoGetLocalNet`, NCCL_NETDEVS_POLICY=AUTO): its local NICs are
those with the highest path bandwidth and, among those, the lowest path type (`ncclTopoGetLocal`:
bandwidth first, type second, every tie kept, in NCCL's NIC order). NCCL spreads GPUs over them:
`index = mirrorBits(gpu dev, count)` when the count is a power of two (else the dev itself), plus
`channel % netsPerGpu`, where netsPerGpu is the local NIC count divided by the number of GPUs local
to the first of those NICs, rounded up; the NIC is `local[index % count]`. On a rail-optimised node
(one NIC beside each GPU) that is GPU i -> the NIC under its own switch.

Everything here is a pure function of the topology, the raw matrix and the options.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from .model import Topology, XNode
from .paths import RANK, Path, PathGraph, PathMatrix, _Link

log = logging.getLogger(__name__)
K = TypeVar("K", int, str)

# GDR level NCCL uses when NCCL_NET_GDR_LEVEL is unset (paths.cc ncclTopoCheckGdr).
DEFAULT_GDR_LEVEL = "PXB"


@dataclass(frozen=True)
class NicPathOptions:
    """The settings and NCCL version that decide the re-routing."""

    pxn_disable: bool = False  # NCCL_PXN_DISABLE=1
    pxn_c2c: bool = True  # NCCL_PXN_C2C (default 1 since 2.28)
    net_gdr_c2c: bool = True  # NCCL_NET_GDR_C2C (default 1 since 2.27)
    gdr_level: str | None = None  # NCCL_NET_GDR_LEVEL as a level name; None: NCCL's default (PXB)
    gdr_read: bool | None = None  # NCCL_NET_GDR_READ; None: auto
    nccl_version: tuple[int, int] = (2, 28)


@dataclass(frozen=True)
class NicPath:
    """One GPU's path to one NIC: the raw one and the one NCCL ends up using."""

    gpu: int
    nic: str
    raw_type: str
    raw_bw_gbps: float
    final_type: str
    final_bw_gbps: float
    via_gpu: int | None  # the peer GPU for PXN
    gdr: bool  # GPUDirect RDMA between this GPU (or its PXN peer) and the NIC


@dataclass(frozen=True)
class NicChoice:
    """The NIC NCCL gives one GPU: on channel 0, and all it rotates over."""

    gpu: int
    nic: str
    local_nics: tuple[str, ...]  # the GPU's closest NICs (highest bandwidth, then lowest type)
    nics_per_gpu: int  # how many of them the GPU's channels rotate over
    channel_nics: tuple[str, ...]  # NIC of channel 0, 1, ... up to nics_per_gpu


@dataclass(frozen=True)
class NicPaths:
    paths: dict[tuple[int, str], NicPath]
    choice: dict[int, NicChoice]
    gpus: list[int]
    nics: list[str]
    options: NicPathOptions

    def final_types(self) -> set[str]:
        return {p.final_type for p in self.paths.values()}

    def count(self, final_type: str) -> int:
        return sum(1 for p in self.paths.values() if p.final_type == final_type)

    def gdr_pairs(self) -> frozenset[tuple[int, str]]:
        return frozenset(k for k, p in self.paths.items() if p.gdr)


class _C2cGraph(PathGraph):
    """NCCL's graph with the GPU-CPU C2C links (`topo.cc:ncclTopoAddC2c`) that PathGraph leaves out.

    A `<c2c count bw>` under a `<gpu>` links the GPU to its own CPU at count * bw / 1000 GB/s
    (bw is per link, in MB/s), both ways; a hop over it has type C2C.
    """

    def __init__(self, topo: Topology) -> None:
        super().__init__(topo)
        self.c2c_gpus: set[int] = set()
        for idx, key in self.gpu_keys.items():
            node = self.nodes[key].xnode
            if node is None:
                continue
            for c2c in (c for c in node.children if c.tag == "c2c"):
                bw = _int(c2c, "bw") * _int(c2c, "count") / 1000.0
                cpu = self._cpu_of(key)
                if cpu is None or bw <= 0:
                    continue
                self._connect(key, cpu, "C2C", bw)
                self._connect(cpu, key, "C2C", bw)
                self.c2c_gpus.add(idx)
        self._sort_links()

    def hop_type(self, a: str, link: _Link, path_type: int) -> str:
        if link.kind == "C2C":
            return "C2C"
        return super().hop_type(a, link, path_type)


def _int(node: XNode, key: str) -> int:
    try:
        return int(node.attrs.get(key, "0"), 0)
    except ValueError:
        return 0


def merge_path_type(a: str, b: str) -> str:
    """Type of a path made of two legs (`paths.cc:mergePathType`): the worse one, except that
    C2C joined to PHB is P2C."""
    hi, lo = (a, b) if RANK[a] >= RANK[b] else (b, a)
    return "P2C" if hi == "PHB" and lo == "C2C" else hi


def _mirror_bits(val: int, pow2: int) -> int:
    """Reverse the low log2(pow2) bits of val (topo.h mirrorBits)."""
    out, b, mb = 0, 1, pow2 >> 1
    while b < pow2:
        if val & b:
            out |= mb
        b <<= 1
        mb >>= 1
    return out


def _is_pow2(val: int) -> bool:
    return val & (val - 1) == 0


def _local(paths: Mapping[K, Path], order: list[K]) -> list[K]:
    """`ncclTopoGetLocal`: the highest bandwidth, then the lowest type; ties in NCCL's order."""
    best: list[K] = []
    max_bw, min_type = 0.0, RANK["DIS"]
    for key in order:
        p = paths.get(key)
        if p is None:
            continue
        if p.bw_gbps > max_bw or (p.bw_gbps == max_bw and RANK[p.type] < min_type):
            max_bw, min_type, best = p.bw_gbps, RANK[p.type], []
        if p.bw_gbps == max_bw and RANK[p.type] == min_type:
            best.append(key)
    return best


class _State:
    """Mutable path tables during the computation, like NCCL's per-node path arrays."""

    def __init__(self, topo: Topology, raw: PathMatrix, opts: NicPathOptions) -> None:
        self.topo, self.raw, self.opts = topo, raw, opts
        self.gpus = list(raw.gpus)
        self.nics = list(raw.nics)
        self.g2n: dict[int, dict[str, Path]] = {g: {} for g in self.gpus}
        self.n2g: dict[str, dict[int, Path]] = {n: {} for n in self.nics}
        for (g, n), p in raw.gpu_nic.items():
            self.g2n[g][n] = p
            self.n2g[n][g] = p
        self.via: dict[tuple[int, str], int] = {}
        graph = _C2cGraph(topo)
        cpu_keys = [k for k, node in graph.nodes.items() if node.kind == "CPU"]
        to_cpu = {c: graph.paths_from(c) for c in cpu_keys}
        # ncclGetLocalCpu: the CPU with the fewest hops from the GPU (the first on a tie).
        self.local_cpu: dict[int, str | None] = {}
        self.gpu_cpu: dict[int, Path] = {}
        for g, key in graph.gpu_keys.items():
            cands = [(to_cpu[c][key].hops, i, c) for i, c in enumerate(cpu_keys) if key in to_cpu[c]]
            cpu = min(cands)[2] if cands else None
            self.local_cpu[g] = cpu
            if cpu is not None:
                self.gpu_cpu[g] = to_cpu[cpu][key]
        # A CPU's path to a NIC's NET node: the PCI path plus the NIC's own rate on the NET hop.
        self.nic_cpu: dict[tuple[str, str], Path] = {}
        for name, nkey in graph.nic_keys.items():
            net_bw = _net_bw(graph.nodes[nkey].xnode)
            for c in cpu_keys:
                leg = to_cpu[c].get(nkey)
                if leg is not None:
                    self.nic_cpu[(name, c)] = Path(leg.type, min(leg.bw_gbps, net_bw), leg.hops + 1)
        self.gpu_gdr = {g: _gpu_gdr(graph, key) for g, key in graph.gpu_keys.items()}
        self.nic_gdr = {n.name: bool(n.gdr) for n in topo.nics}
        self.sm = {g.index: g.sm for g in topo.gpus}

    # -- NCCL's helpers, on the current state ----------------------------------------------------

    def local_nets(self, g: int) -> list[str]:
        return _local(self.g2n[g], self.nics)

    def local_gpus(self, n: str) -> list[int]:
        return _local(self.n2g[n], self.gpus)

    def nets_per_gpu(self, local: list[str]) -> int:
        gpus = self.local_gpus(local[0])
        return -(-len(local) // max(len(gpus), 1))

    def net_of(self, g: int, channel: int) -> str | None:
        """`ncclTopoGetLocalNet` under the AUTO policy."""
        local = self.local_nets(g)
        if not local:
            return None
        index = g
        if _is_pow2(len(local)):
            index = _mirror_bits(index, len(local))
        index += channel % self.nets_per_gpu(local)
        return local[index % len(local)]

    def local_gpu(self, n: str) -> int | None:
        """`ncclTopoGetLocalGpu`: the first of the NIC's local GPUs that picks it on some channel."""
        local = self.local_gpus(n)
        for channel in range(64):  # MAXCHANNELS
            for g in local:
                if self.net_of(g, channel) == n:
                    return g
        return None

    def gdr(self, g: int, n: str, *, read: bool) -> bool:
        """`ncclTopoCheckGdr`: both ends support it, and the distance is within the GDR level."""
        if not self.nic_gdr.get(n) or not self.gpu_gdr.get(g, True):
            return False
        if read and not self._gdr_read(g):
            return False
        level = RANK[self.opts.gdr_level or DEFAULT_GDR_LEVEL]
        p = self.g2n[g][n]
        distance = p.type
        if distance == "PXN":
            distance = self.g2n[self.via[(g, n)]][n].type
        if self.opts.net_gdr_c2c and distance == "P2C":
            distance = "C2C"
        return RANK[distance] <= level

    def _gdr_read(self, g: int) -> bool:
        if self.opts.gdr_read is not None:
            return self.opts.gdr_read
        if (self.sm.get(g) or 0) >= 80 or len(self.gpus) == 1:
            return True
        return any(self.raw.gpu_gpu[(g, h)].type == "NVL" for h in self.gpus if h != g)

    # -- the three steps of ncclTopoComputePaths ------------------------------------------------

    def apply_p2c(self) -> None:
        for g in self.gpus:
            cpu = self.local_cpu.get(g)
            gcpu = self.gpu_cpu.get(g)
            if cpu is None or gcpu is None:
                continue
            nics = self.local_nets(g) if self.opts.nccl_version >= (2, 29) else self.nics
            for n in nics:
                ncpu = self.nic_cpu.get((n, cpu))
                if ncpu is None or merge_path_type(gcpu.type, ncpu.type) != "P2C":
                    continue
                self.g2n[g][n] = _at_most_p2c(self.g2n[g][n])
                self.n2g[n][g] = _at_most_p2c(self.n2g[n][g])

    def apply_pxn_and_gdr(self) -> None:
        limit = RANK["P2C"] if self.opts.pxn_c2c else RANK["PXB"]
        for n in self.nics:
            for g in self.gpus:
                if not self.opts.pxn_disable:
                    p = self.local_gpu(n)
                    if p is not None and p != g and self._pxn_ok(g, p, n, limit):
                        hop = self.raw.gpu_gpu[(g, p)]
                        peer = self.g2n[p][n]
                        self.g2n[g][n] = Path("PXN", min(hop.bw_gbps, peer.bw_gbps), hop.hops + peer.hops)
                        self.via[(g, n)] = p
                if RANK[self.g2n[g][n].type] < RANK["PHB"] and not self.gdr(g, n, read=False):
                    self._through_cpu(g, n)

    def _pxn_ok(self, g: int, p: int, n: str, limit: int) -> bool:
        peer, own = self.g2n[p][n], self.g2n[g][n]
        if RANK[peer.type] > limit:
            return False
        if self.opts.nccl_version >= (2, 30) and not self.gdr(p, n, read=True):
            return False
        if RANK[self.raw.gpu_gpu[(p, g)].type] > RANK["NVL"]:
            return False
        return peer.bw_gbps > own.bw_gbps or RANK[own.type] > RANK["PXN"]

    def _through_cpu(self, g: int, n: str) -> None:
        cpu = self.local_cpu.get(g)
        gcpu = self.gpu_cpu.get(g)
        ncpu = self.nic_cpu.get((n, cpu)) if cpu is not None else None
        if gcpu is None or ncpu is None:
            return
        p = Path(merge_path_type(gcpu.type, ncpu.type), min(gcpu.bw_gbps, ncpu.bw_gbps), gcpu.hops + ncpu.hops)
        self.g2n[g][n] = p
        self.n2g[n][g] = p
        self.via.pop((g, n), None)


def _at_most_p2c(p: Path) -> Path:
    return Path("P2C", p.bw_gbps, p.hops) if RANK[p.type] > RANK["P2C"] else p


def _net_bw(net: XNode | None) -> float:
    speed = _int(net, "speed") if net is not None else 0
    return (speed if speed > 0 else 10000) / 8000.0


def _gpu_gdr(graph: PathGraph, key: str) -> bool:
    """The GPU's own GDR support: `<gpu gdr>` when the file says, else supported (NCCL asks CUDA,
    which says yes for data-centre GPUs)."""
    node = graph.nodes[key].xnode
    if node is None or "gdr" not in node.attrs:
        return True
    return node.attrs["gdr"] == "1"


def compute_nic_paths(topo: Topology, raw: PathMatrix, options: NicPathOptions | None = None) -> NicPaths:
    """Final GPU-NIC path types and the NIC per GPU, as NCCL computes them (module docstring)."""
    opts = options or NicPathOptions()
    st = _State(topo, raw, opts)
    if st.nics:
        st.apply_p2c()
        st.apply_pxn_and_gdr()
    out: dict[tuple[int, str], NicPath] = {}
    for (g, n), rp in raw.gpu_nic.items():
        fp = st.g2n[g][n]
        out[(g, n)] = NicPath(gpu=g, nic=n, raw_type=rp.type, raw_bw_gbps=rp.bw_gbps, final_type=fp.type,
                              final_bw_gbps=fp.bw_gbps, via_gpu=st.via.get((g, n)), gdr=st.gdr(g, n, read=False))
    choice: dict[int, NicChoice] = {}
    for g in st.gpus:
        local = st.local_nets(g)
        if not local:
            continue
        per_gpu = st.nets_per_gpu(local)
        channels = tuple(nic for c in range(per_gpu) if (nic := st.net_of(g, c)) is not None)
        choice[g] = NicChoice(gpu=g, nic=channels[0], local_nics=tuple(local), nics_per_gpu=per_gpu,
                              channel_nics=channels)
    log.debug("final GPU-NIC types %s", sorted({p.final_type for p in out.values()}))
    return NicPaths(paths=out, choice=choice, gpus=list(raw.gpus), nics=list(raw.nics), options=opts)
