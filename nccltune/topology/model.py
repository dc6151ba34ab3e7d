"""The topology model: NCCL's own view of the node, built from a snapshot or from an NCCL XML.

The heart of the model is the tree NCCL itself works on (`<system>/<cpu>/<pci>/<gpu>|<nic>`),
kept as plain `XNode`s, so that the same path computation serves a live node, a recorded
snapshot and a vendor's or NCCL's own topology file. Facts NCCL does not keep (GPU names,
UUIDs, driver version) ride alongside in `GpuInfo`/`NicInfo`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..hw.cpuset import cpulist_from_cpus, cpumask_from_cpus, cpus_from_cpumask
from ..hw.types import Gpu, Nic, PciDevice, Snapshot, parse_int
from .links import pci_lane_rate

log = logging.getLogger(__name__)

# NCCL's class codes (xml.cc kvDictPciClass; prefix match).
CLASS_NVSWITCH = "0x068000"
CLASS_NVLINK_CPU = "0x068001"
# NVML reports an NVSwitch that a VM cannot see as FFFFFFFF:FF:FF.0; NCCL 2.28.9 writes it back
# in this 7-digit form (seen in the reference machine's NCCL_TOPO_DUMP_FILE).
NCCL_INVISIBLE_BUSID = "fffffff:ff:ff.0"

_GEN_SPEED = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
              5: "32.0 GT/s PCIe", 6: "64.0 GT/s PCIe"}


@dataclass
class XNode:
    """One element of NCCL's topology XML: tag, attributes in order, children."""

    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[XNode] = field(default_factory=list)
    line: int | None = None  # source line when read from a file

    def add(self, child: XNode) -> XNode:
        self.children.append(child)
        return child

    def iter(self, tag: str | None = None) -> list[XNode]:
        out: list[XNode] = []
        stack = [self]
        while stack:
            node = stack.pop(0)
            if tag is None or node.tag == tag:
                out.append(node)
            stack[0:0] = node.children
        return out

    def count(self) -> int:
        return 1 + sum(c.count() for c in self.children)


@dataclass(frozen=True)
class GpuInfo:
    """What the matrix and reports show about a GPU, beyond NCCL's tree."""

    index: int
    bus_id: str
    name: str | None = None
    uuid: str | None = None
    sm: int | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    pcie_cur_gen: int | None = None
    pcie_cur_width: int | None = None
    nvlinks_total: int = 0
    nvlinks_active: int = 0
    mig_enabled: bool | None = None
    processes: tuple[int, ...] = ()


@dataclass(frozen=True)
class NicInfo:
    name: str
    kind: str
    bus_id: str | None
    speed_mbps: int | None
    active: bool
    numa_node: int | None = None
    gdr: bool | None = None


@dataclass
class Topology:
    system: XNode
    gpus: list[GpuInfo]
    nics: list[NicInfo]
    source: str
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    snapshot: Snapshot | None = None
    p2p_refused: set[tuple[int, int]] = field(default_factory=set)  # NVML index pairs, a < b

    def gpu(self, index: int) -> GpuInfo:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)


# -- building from a snapshot ----------------------------------------------------------------------


def _speed_rank(speed: str | None) -> float:
    return pci_lane_rate(speed) if speed else 0.0


def _min_speed(a: str | None, b: str | None) -> str | None:
    if not a:
        return b
    if not b:
        return a
    return a if _speed_rank(a) <= _speed_rank(b) else b


def _min_width(a: int | None, b: int | None) -> int | None:
    vals = [v for v in (a, b) if v]
    return min(vals) if vals else None


def _nccl_parents(path: tuple[str, ...]) -> list[str]:
    """The `<pci>` ancestors NCCL creates for a device, top first.

    NCCL walks the sysfs path two components at a time (switch upstream port, skipping the
    downstream port) and stops at the first non-PCI component, the root complex (xml.cc,
    ncclTopoGetXmlFromSys). A device on a root port or the root bus hangs off the CPU.
    """
    parents: list[str] = []
    i = len(path) - 1
    while True:
        if i - 1 < 0 or path[i - 1].startswith("pci"):
            break
        if i - 2 < 0 or path[i - 2].startswith("pci"):
            break
        parents.append(path[i - 2])
        i -= 2
    return list(reversed(parents))


class _SnapshotBuilder:
    def __init__(self, snap: Snapshot, with_nics: bool) -> None:
        self.snap = snap
        self.with_nics = with_nics
        self.pci = {d.bus_id: d for d in snap.sysfs.pci}
        self.system = XNode("system", {"version": "1"})
        self.cpus: dict[int, XNode] = {}
        self.pci_nodes: dict[str, XNode] = {}

    def cpu_node(self, numa: int) -> XNode:
        if numa in self.cpus:
            return self.cpus[numa]
        cpu = self.snap.sysfs.cpu
        attrs = {"numaid": str(numa)}
        node_info = next((n for n in self.snap.sysfs.numa_nodes if n.id == numa), None)
        if node_info is not None and node_info.cpumap:
            total = cpu.logical_cpus
            attrs["affinity"] = cpumask_from_cpus(cpus_from_cpumask(node_info.cpumap), total)
        attrs["arch"] = {"aarch64": "arm64", "ppc64le": "ppc64"}.get(cpu.arch, cpu.arch)
        if cpu.vendor:
            attrs["vendor"] = cpu.vendor
        if cpu.family is not None:
            attrs["familyid"] = str(cpu.family)
        if cpu.model is not None:
            attrs["modelid"] = str(cpu.model)
        node = XNode("cpu", attrs)
        self.cpus[numa] = node
        return node

    def numa_of(self, dev: PciDevice | None, fallback: int | None) -> int:
        if dev is not None and dev.numa_node is not None:
            return dev.numa_node
        if fallback is not None:
            return fallback
        return -1

    def link_of(self, dev: PciDevice) -> tuple[str | None, int | None]:
        """NCCL takes min(own max link, parent port's max link) for speed and width."""
        speed, width = dev.max_link_speed, dev.max_link_width
        if len(dev.path) >= 2 and not dev.path[-2].startswith("pci"):
            parent = self.pci.get(dev.path[-2])
            if parent is not None:
                speed = _min_speed(speed, parent.max_link_speed)
                width = _min_width(width, parent.max_link_width)
        return speed, width

    def pci_attrs(self, dev: PciDevice, speed: str | None, width: int | None) -> dict[str, str]:
        attrs = {"busid": dev.bus_id, "class": dev.class_code}
        for key, value in (("vendor", dev.vendor), ("device", dev.device),
                           ("subsystem_vendor", dev.subsystem_vendor),
                           ("subsystem_device", dev.subsystem_device)):
            if value:
                attrs[key] = value
        # Always explicit: absent values make NCCL fall back to Gen3 (speed) or x16 (width), and
        # NCCL 2.30.7 would otherwise take the GPU's *current* (possibly idle-downtrained) link.
        attrs["link_speed"] = speed or "16.0 GT/s PCIe"
        attrs["link_width"] = str(width or 16)
        return attrs

    def attach(self, dev: PciDevice | None, bus_id: str, numa: int) -> XNode:
        """Create (or find) the chain of `<pci>` switch nodes above a device; return its parent."""
        parent = self.cpu_node(numa)
        if dev is None:
            return parent
        for up in _nccl_parents(dev.path):
            if up in self.pci_nodes:
                parent = self.pci_nodes[up]
                continue
            up_dev = self.pci.get(up)
            if up_dev is None:
                break
            speed, width = self.link_of(up_dev)
            node = parent.add(XNode("pci", self.pci_attrs(up_dev, speed, width)))
            self.pci_nodes[up] = node
            parent = node
        return parent

    def add_gpu(self, gpu: Gpu, gpus_by_bus: dict[str, Gpu]) -> None:
        dev = self.pci.get(gpu.bus_id)
        numa = self.numa_of(dev, gpu.numa_node)
        parent = self.attach(dev, gpu.bus_id, numa)
        if dev is not None:
            speed, width = self.link_of(dev)
            cls = dev.class_code
        else:
            speed, width, cls = None, None, "0x030200"
        speed = speed or (_GEN_SPEED.get(gpu.pcie_max_gen or 0))
        width = width or gpu.pcie_max_width
        fake = PciDevice(bus_id=gpu.bus_id, class_code=cls, path=(gpu.bus_id,),
                         vendor=gpu.pci_vendor_id, device=gpu.pci_device_id,
                         subsystem_vendor=gpu.pci_subsystem_vendor_id,
                         subsystem_device=gpu.pci_subsystem_device_id)
        pci_node = parent.add(XNode("pci", self.pci_attrs(fake, speed, width)))
        gpu_attrs = {"dev": str(gpu.index)}
        if gpu.sm is not None:
            gpu_attrs["sm"] = str(gpu.sm)
        gnode = pci_node.add(XNode("gpu", gpu_attrs))
        counts: dict[str, int] = {}
        classes: dict[str, str] = {}
        for link in gpu.nvlinks:
            if not link.active:
                continue
            target = link.remote_bus_id or "ffffffff:ff:ff.0"
            if target == "ffffffff:ff:ff.0":
                target = NCCL_INVISIBLE_BUSID
            counts[target] = counts.get(target, 0) + 1
            classes[target] = self.nvlink_class(link.remote_type, target, gpus_by_bus)
        for target in sorted(counts):
            gnode.add(XNode("nvlink", {"target": target, "count": str(counts[target]),
                                       "tclass": classes[target]}))

    def nvlink_class(self, remote_type: str | None, target: str, gpus_by_bus: dict[str, Gpu]) -> str:
        """The `tclass` of an NVLink's far end, as NCCL fills it in (xml.cc ncclTopoGetXmlFromGpu).

        NCCL reads the class of the remote bus id from sysfs and assumes an NVSwitch only when
        it cannot. NVML's remote device type says the same where the binding has it; where it
        does not (None), a remote that is one of our GPUs, or a device in the snapshot's sysfs,
        still has a known class, so a GPU-to-GPU bridge is not mistaken for an NVSwitch.
        """
        peer_dev = self.pci.get(target)
        if remote_type == "cpu":
            return CLASS_NVLINK_CPU
        if remote_type == "gpu" or (remote_type is None and target in gpus_by_bus):
            if peer_dev is not None:
                return peer_dev.class_code
            return "0x030200" if target in gpus_by_bus else "0x030000"
        if remote_type is None and peer_dev is not None:
            return peer_dev.class_code
        return CLASS_NVSWITCH

    def add_nic(self, nic: Nic, dev_index: int) -> None:
        dev = self.pci.get(nic.bus_id) if nic.bus_id else None
        numa = self.numa_of(dev, None)
        if dev is None:
            # NCCL attaches non-PCI network devices (virtio) to the first CPU.
            parent = next(iter(self.cpus.values())) if self.cpus else self.cpu_node(numa)
            nic_parent = parent
        else:
            parent = self.attach(dev, dev.bus_id, numa)
            existing = next((c for c in parent.children
                             if c.tag == "pci" and c.attrs.get("busid") == dev.bus_id), None)
            if existing is None:
                speed, width = self.link_of(dev)
                existing = parent.add(XNode("pci", self.pci_attrs(dev, speed, width)))
            nic_parent = existing
        nic_node = next((c for c in nic_parent.children if c.tag == "nic"), None)
        if nic_node is None:
            nic_node = nic_parent.add(XNode("nic"))
        attrs = {"name": nic.name, "dev": str(dev_index)}
        net_speed = nic_speed_mbps(nic)
        if net_speed:
            attrs["speed"] = str(net_speed)
        if nic.kind == "ib":
            port = next((p for p in nic.ports if p.state == "ACTIVE"), None)
            if port is not None:
                attrs["port"] = str(port.port)
            guid = _guid_attr(nic.guid)
            if guid is not None:
                attrs["guid"] = guid
        nic_node.add(XNode("net", attrs))


def _guid_attr(guid: str | None) -> str | None:
    """An IB node GUID (sysfs `0c42:a103:00d6:3b00`) the way NCCL writes it: `0x%lx`."""
    if not guid:
        return None
    try:
        return f"0x{int(guid.replace(':', ''), 16):x}"
    except ValueError:
        return None


def nic_speed_mbps(nic: Nic) -> int | None:
    if nic.kind == "ib":
        rates = [p.rate_gbps for p in nic.ports if p.state == "ACTIVE" and p.rate_gbps]
        return int(max(rates) * 1000) if rates else None
    return nic.speed_mbps


def nccl_nics(snap: Snapshot) -> list[Nic]:
    """The network devices NCCL would pick: active RDMA devices, else up IPv4 interfaces.

    NCCL tries the IB plugin first and falls back to sockets when no IB device is usable;
    the socket transport only takes interfaces with an address (hence has_ipv4).
    """
    ib = [n for n in snap.sysfs.nics if n.kind == "ib" and any(p.state == "ACTIVE" for p in n.ports)]
    if ib:
        return ib
    return [n for n in snap.sysfs.nics
            if n.kind == "eth" and n.operstate in ("up", "unknown", None) and n.has_ipv4 is not False]


def from_snapshot(snap: Snapshot, *, with_nics: bool = True, source: str = "snapshot") -> Topology:
    """Build NCCL's view of a node from its raw readings."""
    b = _SnapshotBuilder(snap, with_nics)
    gpus_by_bus = {g.bus_id: g for g in snap.nvml.gpus}
    for gpu in sorted(snap.nvml.gpus, key=lambda g: g.bus_id):
        b.add_gpu(gpu, gpus_by_bus)
    if not b.cpus:
        b.cpu_node(-1)
    nics = nccl_nics(snap)
    if with_nics:
        for i, nic in enumerate(nics):
            b.add_nic(nic, i)
    for numa in sorted(b.cpus):
        b.system.add(b.cpus[numa])
    _sort_tree(b.system)

    infos = []
    for g in snap.nvml.gpus:
        dev = b.pci.get(g.bus_id)
        gpu_numa = dev.numa_node if dev is not None and dev.numa_node is not None else g.numa_node
        affinity = g.cpu_affinity
        if affinity is None and gpu_numa is not None:
            node = next((n for n in snap.sysfs.numa_nodes if n.id == gpu_numa), None)
            affinity = node.cpulist if node else None
        infos.append(GpuInfo(
            index=g.index, bus_id=g.bus_id, name=g.name, uuid=g.uuid, sm=g.sm, numa_node=gpu_numa,
            cpu_affinity=affinity, pcie_max_gen=g.pcie_max_gen, pcie_max_width=g.pcie_max_width,
            pcie_cur_gen=g.pcie_cur_gen, pcie_cur_width=g.pcie_cur_width,
            nvlinks_total=len(g.nvlinks), nvlinks_active=sum(1 for n in g.nvlinks if n.active),
            mig_enabled=g.mig_enabled, processes=tuple(p.pid for p in g.processes),
        ))
    nic_infos = []
    for nic in nics:
        dev = b.pci.get(nic.bus_id) if nic.bus_id else None
        nic_infos.append(NicInfo(
            name=nic.name, kind=nic.kind, bus_id=nic.bus_id, speed_mbps=nic_speed_mbps(nic),
            active=True, numa_node=dev.numa_node if dev else None, gdr=nic.gdr,
        ))
    refused = set()
    for p in snap.nvml.p2p:
        if (p.read not in (None, "ok")) or (p.write not in (None, "ok")):
            refused.add((min(p.gpu_a, p.gpu_b), max(p.gpu_a, p.gpu_b)))
    return Topology(
        system=b.system, gpus=sorted(infos, key=lambda g: g.index), nics=nic_infos, source=source,
        driver_version=snap.nvml.driver_version, cuda_driver_version=snap.nvml.cuda_driver_version,
        snapshot=snap, p2p_refused=refused,
    )


def _sort_tree(node: XNode) -> None:
    """Deterministic order: PCI children by bus id, `<nic>` after them, like NCCL's own dumps."""

    def key(child: XNode) -> tuple[int, str]:
        if child.tag == "pci":
            return (0, child.attrs.get("busid", ""))
        if child.tag == "cpu":
            return (0, f"{int(child.attrs.get('numaid', '-1')):08d}")
        return (1, child.tag)

    if node.tag in ("system", "cpu", "pci"):
        node.children.sort(key=key)
    for c in node.children:
        _sort_tree(c)


# -- building from an NCCL XML tree ----------------------------------------------------------------


def from_xml_tree(system: XNode, *, source: str) -> Topology:
    """Model of a node described only by an NCCL topology XML (a dump or a vendor file)."""
    gpus: list[GpuInfo] = []
    nics: list[NicInfo] = []
    net_devs: list[int | None] = []

    def walk(node: XNode, numa: int | None, affinity: str | None) -> None:
        for child in node.children:
            if child.tag == "cpu":
                n = parse_int(child.attrs.get("numaid"))
                walk(child, n, _cpulist_of_mask(child.attrs.get("affinity")))
            elif child.tag == "pci":
                gpu = next((c for c in child.children if c.tag == "gpu"), None)
                if gpu is not None:
                    links = [c for c in gpu.children if c.tag == "nvlink"]
                    count = sum(parse_int(c.attrs.get("count")) or 0 for c in links)
                    dev = parse_int(gpu.attrs.get("dev"))
                    gpus.append(GpuInfo(
                        index=dev if dev is not None else len(gpus),
                        bus_id=child.attrs.get("busid", "?"),
                        sm=parse_int(gpu.attrs.get("sm")),
                        numa_node=numa if numa is not None and numa >= 0 else None,
                        cpu_affinity=affinity,
                        nvlinks_total=count, nvlinks_active=count,
                    ))
                walk(child, numa, affinity)
            elif child.tag == "nic":
                bus = node.attrs.get("busid") if node.tag == "pci" else None
                for net in (c for c in child.children if c.tag == "net"):
                    net_devs.append(parse_int(net.attrs.get("dev")))
                    nics.append(NicInfo(
                        name=net.attrs.get("name", f"net{len(nics)}"), kind="ib" if bus else "eth",
                        bus_id=bus, speed_mbps=parse_int(net.attrs.get("speed")), active=True,
                        numa_node=numa if numa is not None and numa >= 0 else None,
                        gdr=(net.attrs.get("gdr") == "1") if "gdr" in net.attrs else None,
                    ))

    walk(system, None, None)
    # NIC i is the network device NCCL numbers i (`<net dev>`), as for a snapshot; tree order
    # (by NUMA node, then bus id) would renumber them.
    order = sorted(range(len(nics)), key=lambda i: (net_devs[i] is None, net_devs[i] or 0, i))
    return Topology(system=system, gpus=sorted(gpus, key=lambda g: g.index), nics=[nics[i] for i in order],
                    source=source)


def _cpulist_of_mask(mask: str | None) -> str | None:
    """A `<cpu affinity>` cpumask as a cpulist; None when absent or not a cpumask.

    NCCL skips an absent affinity, and a file that garbles it should not stop us from reading
    the rest of the topology.
    """
    if not mask:
        return None
    try:
        return cpulist_from_cpus(cpus_from_cpumask(mask))
    except ValueError:
        return None

