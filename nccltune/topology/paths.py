"""NCCL path types and bandwidths between GPUs and NICs, computed the way NCCL computes them.

This follows NCCL 2.28 `paths.cc:ncclTopoSetPaths` for *raw* paths (before P2P/GDR/PXN
rerouting, which depends on runtime settings): a hop's type comes from its link (NVLink: NVL;
a second NVLink hop through an intermediate GPU: NVB; PCI to or from a CPU: PHB; PCI between
two switches: PXB; other PCI: PIX; CPU to CPU: SYS); a path's type is the worst hop. NCCL
finds paths breadth-first from the destination and keeps, for every node, the path with the
fewest hops, and among those the highest bottleneck bandwidth; the type does not take part in
the choice (so a PCIe switch path can beat a slower NVLink-through-a-GPU path of equal length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .links import (
    LOC_BW,
    PATH_TYPES,
    RANK,
    attr_int,
    inter_cpu_bw,
    nvlink_bw_per_link,
    pci_bw_gbps,
    pci_lane_rate,
)
from .model import CLASS_NVLINK_CPU, Topology, XNode

__all__ = ["LOC_BW", "PATH_TYPES", "RANK", "Path", "PathGraph", "PathMatrix", "compute_paths", "pci_lane_rate"]

def _attr_int(node: XNode, key: str) -> int | None:
    return attr_int(node.attrs, key)


@dataclass(frozen=True)
class Path:
    type: str
    bw_gbps: float
    hops: int
    nvlinks: int = 0  # NVLinks on the narrowest NVLink hop, for "NV#" display


@dataclass
class _Node:
    key: str
    kind: str  # CPU, PCI, GPU, NIC, NVS
    xnode: XNode | None = None
    index: int | None = None


@dataclass
class _Link:
    to: str
    kind: str  # NVL, PCI, SYS, LOC
    bw: float
    count: int = 0


class PathGraph:
    """NCCL's node/link graph for a topology."""

    def __init__(self, topo: Topology) -> None:
        self.nodes: dict[str, _Node] = {}
        self.links: dict[str, list[_Link]] = {}
        self.gpu_keys: dict[int, str] = {}
        self.nic_keys: dict[str, str] = {}
        # The PCI link towards the CPU, per node of the PCI tree (ncclTopoSort puts it last).
        self.uplinks: dict[str, str] = {}
        self._build(topo)
        self._sort_links()

    def _add(self, node: _Node) -> None:
        self.nodes[node.key] = node
        self.links.setdefault(node.key, [])

    def _connect(self, a: str, b: str, kind: str, bw: float, count: int = 0) -> None:
        # Bandwidths of parallel links to the same node add up (ncclTopoConnectNodes).
        for link in self.links[a]:
            if link.to == b and link.kind == kind:
                link.bw += bw
                link.count += count
                break
        else:
            self.links[a].append(_Link(b, kind, bw, count))

    def _build(self, topo: Topology) -> None:
        cpus = [c for c in topo.system.children if c.tag == "cpu"]
        gpu_sm: dict[str, int | None] = {}
        pending_nvlinks: list[tuple[str, XNode, int | None]] = []

        def walk(parent_key: str, node: XNode) -> None:
            for child in node.children:
                if child.tag == "pci":
                    busid = child.attrs.get("busid", "")
                    gpu = next((c for c in child.children if c.tag == "gpu"), None)
                    nic = next((c for c in child.children if c.tag == "nic"), None)
                    bw = pci_bw_gbps(child.attrs.get("link_speed"), child.attrs.get("link_width"))
                    if gpu is not None:
                        dev = _attr_int(gpu, "dev")
                        idx = dev if dev is not None else len(self.gpu_keys)
                        key = f"GPU{idx}"
                        self._add(_Node(key, "GPU", gpu, idx))
                        self.gpu_keys[idx] = key
                        gpu_sm[busid] = _attr_int(gpu, "sm")
                        pending_nvlinks.append((key, gpu, gpu_sm[busid]))
                    elif nic is not None:
                        for net in (c for c in nic.children if c.tag == "net"):
                            self._add_nic(net, parent_key, bw)
                        continue
                    else:
                        key = f"PCI:{busid}"
                        self._add(_Node(key, "PCI", child))
                    self._connect(parent_key, key, "PCI", bw)
                    self._connect(key, parent_key, "PCI", bw)
                    self.uplinks[key] = parent_key
                    walk(key, child)
                elif child.tag == "nic":
                    for net in (c for c in child.children if c.tag == "net"):
                        self._add_nic(net, parent_key, LOC_BW)

        for i, cpu in enumerate(cpus):
            key = f"CPU{i}"
            self._add(_Node(key, "CPU", cpu))
            walk(key, cpu)
        for i, a in enumerate(cpus):
            for j, _b in enumerate(cpus):
                if i != j:
                    self._connect(f"CPU{i}", f"CPU{j}", "SYS", inter_cpu_bw(a.attrs))

        bus_to_gpu = {}
        for key in self.gpu_keys.values():
            node = self.nodes[key]
            assert node.xnode is not None
            bus_to_gpu[_busid_key(_pci_busid_of(topo.system, node.xnode))] = key
        for key, gpu, sm in pending_nvlinks:
            per_link = nvlink_bw_per_link(sm)
            for link in (c for c in gpu.children if c.tag == "nvlink"):
                count = _attr_int(link, "count") or 0
                target = link.attrs.get("target", "")
                tclass = link.attrs.get("tclass", "")
                if tclass.startswith("0x03"):
                    peer = bus_to_gpu.get(_busid_key(target))
                    if peer is None:
                        continue  # NCCL only links GPUs that are in the topology
                    self._connect(key, peer, "NVL", count * per_link, count)
                elif tclass == CLASS_NVLINK_CPU:
                    cpu_key = self._cpu_of(key)
                    if cpu_key:
                        self._connect(key, cpu_key, "NVL", count * per_link, count)
                        self._connect(cpu_key, key, "NVL", count * per_link, count)
                else:
                    # Every non-GPU, non-CPU target collapses into one NVS node (topo.cc).
                    if "NVS" not in self.nodes:
                        self._add(_Node("NVS", "NVS"))
                    self._connect(key, "NVS", "NVL", count * per_link, count)
                    self._connect("NVS", key, "NVL", count * per_link, count)

    def _add_nic(self, net: XNode, parent_key: str, bw: float) -> None:
        name = net.attrs.get("name", f"net{len(self.nic_keys)}")
        key = f"NIC:{name}"
        self._add(_Node(key, "NIC", net))
        self.nic_keys[name] = key
        self._connect(parent_key, key, "PCI", bw)
        self._connect(key, parent_key, "PCI", bw)
        self.uplinks[key] = parent_key

    def _sort_links(self) -> None:
        """Link order as NCCL leaves it: by bandwidth, highest first, and the uplink last.

        ncclTopoConnectNodes keeps each node's links sorted by bandwidth (stable), and
        ncclTopoSortSystem then moves every PCI node's link towards the CPU to the end. The
        order decides between paths of equal length and equal bandwidth (the first one wins).
        """
        for key, links in self.links.items():
            links.sort(key=lambda lk: -lk.bw)
            up = self.uplinks.get(key)
            if up is not None:
                links.sort(key=lambda lk: lk.to == up and lk.kind == "PCI")

    def _cpu_of(self, key: str) -> str | None:
        seen = {key}
        frontier = [key]
        while frontier:
            nxt = []
            for k in frontier:
                for link in self.links[k]:
                    if link.kind == "PCI" and link.to not in seen:
                        if self.nodes[link.to].kind == "CPU":
                            return link.to
                        seen.add(link.to)
                        nxt.append(link.to)
            frontier = nxt
        return None

    def hop_type(self, a: str, link: _Link, path_type: int) -> str:
        """The type of one hop from `a` along `link`, given the type of the path that reached `a`."""
        ka, kb = self.nodes[a].kind, self.nodes[link.to].kind
        if link.kind == "NVL":
            # NVLink out of a GPU that was itself reached over NVLink: through a GPU (NVB).
            return "NVB" if ka == "GPU" and path_type == RANK["NVL"] else "NVL"
        if link.kind == "SYS":
            return "SYS"
        if link.kind == "PCI":
            if ka == "CPU" or kb == "CPU":
                return "PHB"
            if ka == "PCI" and kb == "PCI":
                return "PXB"
            return "PIX"
        return "LOC"

    def paths_from(self, base: str, *, base_bw: float = LOC_BW, base_hops: int = 0) -> dict[str, Path]:
        """Every node's path to `base`, by NCCL's breadth-first search (ncclTopoSetPaths).

        A node's path is replaced only by one with no more hops and strictly more bandwidth,
        level by level, so the result is the shortest path with the highest bottleneck. A path
        may pass through a GPU only as GPU-NVLink-GPU-NVLink-GPU (NVB, NCCL_NVB_DISABLE=0).
        `base_bw`/`base_hops` start the search one NET link away (a NIC's NET node).
        """
        # node -> (type rank, bandwidth, hops, NVLinks on the narrowest NVLink hop)
        best: dict[str, tuple[int, float, int, int]] = {base: (RANK["LOC"], base_bw, base_hops, 0)}
        level = [base]
        while level:
            nxt: list[str] = []
            for node in level:
                trank, bw, hops, nvl = best[node]
                kind = self.nodes[node].kind
                if node != base and kind == "NIC":
                    continue  # a NIC only leads on to its own NET nodes
                for link in self.links[node]:
                    rem = link.to
                    if node != base and kind == "GPU" and (
                        link.kind != "NVL" or self.nodes[rem].kind != "GPU" or hops > 1
                    ):
                        continue
                    new_bw = min(bw, link.bw)
                    cur = best.get(rem)
                    if cur is None:
                        if new_bw <= 0:
                            continue
                    elif not (cur[2] > hops and cur[1] < new_bw):
                        continue
                    htype = RANK[self.hop_type(node, link, trank)]
                    count = min(nvl, link.count) if nvl and link.count else (link.count or nvl)
                    best[rem] = (max(trank, htype), new_bw, hops + 1, count)
                    if rem not in nxt:
                        nxt.append(rem)
            level = nxt
        return {key: Path(PATH_TYPES[t], round(bw, 3), hops, nvl) for key, (t, bw, hops, nvl) in best.items()}


def _pci_busid_of(system: XNode, gpu: XNode) -> str:
    for pci in system.iter("pci"):
        if any(child is gpu for child in pci.children):  # identity: two GPUs may look alike
            return pci.attrs.get("busid", "")
    return ""


def _busid_key(busid: str) -> int | str:
    """A bus id as NCCL matches an NVLink's GPU target: as a number (busIdToInt64), so that
    case and the width of the domain do not matter."""
    try:
        return int(busid.replace(":", "").replace(".", ""), 16)
    except ValueError:
        return busid


@dataclass
class PathMatrix:
    """Raw NCCL paths: GPU index pairs, and GPU index to NIC name."""

    gpu_gpu: dict[tuple[int, int], Path]
    gpu_nic: dict[tuple[int, str], Path]
    gpus: list[int]
    nics: list[str]
    # NIC name pairs (the matrix's NIC-NIC cells, as nvidia-smi topo -m shows them): the path from
    # the second NIC's search to the first; NCCL itself routes no NIC-to-NIC traffic.
    nic_nic: dict[tuple[str, str], Path] = field(default_factory=dict)

    def types_between_gpus(self, refused: set[tuple[int, int]] = frozenset()) -> set[str]:  # type: ignore[assignment]
        return {p.type for (a, b), p in self.gpu_gpu.items() if a < b and (a, b) not in refused}


def compute_paths(topo: Topology) -> PathMatrix:
    """Raw NCCL paths between GPUs and from GPUs to NICs (what NCCL_DEBUG_SUBSYS=GRAPH prints).

    As in NCCL, GPU a's path to GPU b is found searching from b, and a GPU's path to a NIC
    searching from the NIC's NET node, whose link to the NIC carries the NIC's own rate
    (speed in Mbps / 8000 GB/s; 10 Gb/s when unknown) and counts as a hop of type LOC.
    """
    graph = PathGraph(topo)
    gpu_gpu: dict[tuple[int, int], Path] = {}
    gpu_nic: dict[tuple[int, str], Path] = {}
    nic_nic: dict[tuple[str, str], Path] = {}
    for jdx, other in sorted(graph.gpu_keys.items()):
        paths = graph.paths_from(other)
        for idx, key in graph.gpu_keys.items():
            gpu_gpu[(idx, jdx)] = paths.get(key, Path("DIS", 0.0, 0))
    for name, nkey in graph.nic_keys.items():
        net = graph.nodes[nkey].xnode
        speed = _attr_int(net, "speed") if net is not None else None
        net_bw = (speed if speed is not None and speed > 0 else 10000) / 8000.0
        paths = graph.paths_from(nkey, base_bw=net_bw, base_hops=1)
        for idx, key in graph.gpu_keys.items():
            gpu_nic[(idx, name)] = paths.get(key, Path("DIS", 0.0, 0))
        for other, okey in graph.nic_keys.items():
            if other != name:
                nic_nic[(other, name)] = paths.get(okey, Path("DIS", 0.0, 0))
    return PathMatrix(gpu_gpu, gpu_nic, sorted(graph.gpu_keys), list(graph.nic_keys), nic_nic)
