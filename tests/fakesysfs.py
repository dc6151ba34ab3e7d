"""Build a fake sysfs/procfs tree from a SysfsSnapshot, laid out the way the kernel lays it out.

The tree has real directories under `sys/devices/pci.../` and the same relative symlinks the
kernel creates (`sys/bus/pci/devices/<bdf>`, `sys/class/infiniband/<dev>`, `sys/class/net/<if>`
and their `device` links), so SysfsReader resolves paths exactly as it does on a node.
"""

from __future__ import annotations

import os
from pathlib import Path

from nccltune.hw.cpuset import cpus_from_cpulist, cpus_from_cpumask
from nccltune.hw.types import Nic, PciDevice, SysfsSnapshot

# A module NCCL never cares about, so proc/modules is never empty and the peer-memory lookup
# has to find its line among others.
_OTHER_MODULES = (
    "nvidia_uvm 4882432 0 - Live 0x0000000000000000 (POE)",
    "nvidia 54284288 1 nvidia_uvm, Live 0x0000000000000000 (POE)",
    "mlx5_ib 479232 0 - Live 0x0000000000000000 (OE)",
)


# ib_port_state numbers, printed before the name in ports/N/state ("4: ACTIVE").
_PORT_STATES = {"DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4, "ACTIVE_DEFER": 5}
# The suffix the kernel prints after the rate (ib_rate_to_mbps names), for 4x links.
_RATE_NAMES = {100.0: "4X EDR", 200.0: "4X HDR", 400.0: "4X NDR", 800.0: "4X XDR"}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _symlink(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs uses, so the tree stays valid wherever it is copied."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _device_dir(root: Path, dev: PciDevice) -> Path:
    return root / "sys/devices" / Path(*dev.path)


def _write_pci(root: Path, pci: tuple[PciDevice, ...]) -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    for dev in pci:
        d = _device_dir(root, dev)
        d.mkdir(parents=True, exist_ok=True)
        _write(d / "class", dev.class_code)
        # The kernel writes -1 when firmware gives no proximity information (VMs, 1-node boxes).
        _write(d / "numa_node", str(dev.numa_node if dev.numa_node is not None else -1))
        for name in ("vendor", "device", "subsystem_vendor", "subsystem_device",
                     "max_link_speed", "current_link_speed"):
            value = getattr(dev, name)
            if value is not None:
                _write(d / name, value)
        for name in ("max_link_width", "current_link_width"):
            value = getattr(dev, name)
            if value is not None:
                _write(d / name, str(value))
        _symlink(root / "sys/bus/pci/devices" / dev.bus_id, d)
        dirs[dev.bus_id] = d
    return dirs


def _write_numa(root: Path, snap: SysfsSnapshot) -> None:
    base = root / "sys/devices/system/node"
    base.mkdir(parents=True, exist_ok=True)
    for node in snap.numa_nodes:
        _write(base / f"node{node.id}" / "cpumap", node.cpumap)
        _write(base / f"node{node.id}" / "cpulist", node.cpulist)
    # Siblings of nodeN in the real directory; the reader must skip them.
    ids = [n.id for n in snap.numa_nodes]
    if ids:
        span = f"{min(ids)}-{max(ids)}" if len(ids) > 1 else str(ids[0])
        _write(base / "online", span)
        _write(base / "possible", span)


def _socket_of_cpu(snap: SysfsSnapshot) -> dict[int, int]:
    """Spread NUMA nodes over sockets in order (node ids grow within a socket on x86)."""
    sockets = snap.cpu.sockets or 1
    nodes = sorted(snap.numa_nodes, key=lambda n: n.id)
    out: dict[int, int] = {}
    per_socket = max(1, len(nodes) // sockets) if nodes else 1
    for i, node in enumerate(nodes):
        cpus = cpus_from_cpulist(node.cpulist) if node.cpulist else cpus_from_cpumask(node.cpumap)
        for c in cpus:
            out[c] = min(i // per_socket, sockets - 1)
    total = snap.cpu.logical_cpus or (max(out) + 1 if out else 1)
    for c in range(total):
        out.setdefault(c, c * sockets // total)
    return out


def _write_cpuinfo(root: Path, snap: SysfsSnapshot) -> None:
    cpu = snap.cpu
    socket_of = _socket_of_cpu(snap)
    blocks = []
    for c in sorted(socket_of):
        lines = [f"processor\t: {c}"]
        if cpu.vendor is not None:
            lines.append(f"vendor_id\t: {cpu.vendor}")
        if cpu.family is not None:
            lines.append(f"cpu family\t: {cpu.family}")
        if cpu.model is not None:
            lines.append(f"model\t\t: {cpu.model}")
        if cpu.model_name is not None:
            lines.append(f"model name\t: {cpu.model_name}")
        lines.append("stepping\t: 1")
        lines.append(f"physical id\t: {socket_of[c]}")
        lines.append("flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep")
        blocks.append("\n".join(lines))
    _write(root / "proc/cpuinfo", "\n\n".join(blocks) + "\n")


def _write_modules(root: Path, snap: SysfsSnapshot) -> None:
    lines = list(_OTHER_MODULES)
    if snap.gdr_module:
        lines.insert(0, f"{snap.gdr_module} 16384 0 - Live 0x0000000000000000 (OE)")
    _write(root / "proc/modules", "\n".join(lines))


def _class_dir(root: Path, nic: Nic, subsystem: str, dirs: dict[str, Path]) -> Path:
    """Where the kernel keeps the class device: under its PCI function, else under virtual/."""
    if nic.bus_id is not None and nic.bus_id in dirs:
        return dirs[nic.bus_id] / subsystem / nic.name
    return root / "sys/devices/virtual" / subsystem / nic.name


def _write_nics(root: Path, snap: SysfsSnapshot, dirs: dict[str, Path]) -> None:
    (root / "sys/class/infiniband").mkdir(parents=True, exist_ok=True)
    (root / "sys/class/net").mkdir(parents=True, exist_ok=True)
    for nic in snap.nics:
        if nic.kind == "ib":
            d = _class_dir(root, nic, "infiniband", dirs)
            d.mkdir(parents=True, exist_ok=True)
            if nic.guid is not None:
                _write(d / "node_guid", nic.guid)
            for port in nic.ports:
                p = d / "ports" / str(port.port)
                p.mkdir(parents=True, exist_ok=True)
                if port.state is not None:
                    _write(p / "state", f"{_PORT_STATES.get(port.state, 0)}: {port.state}")
                if port.rate_gbps is not None:
                    width = _RATE_NAMES.get(port.rate_gbps, "4X")
                    _write(p / "rate", f"{port.rate_gbps:g} Gb/sec ({width})")
                if port.link_layer is not None:
                    _write(p / "link_layer", port.link_layer)
            link = root / "sys/class/infiniband" / nic.name
        else:
            d = _class_dir(root, nic, "net", dirs)
            d.mkdir(parents=True, exist_ok=True)
            # A link that is down answers EINVAL for speed; the kernel still lists the file.
            if nic.speed_mbps is not None:
                _write(d / "speed", str(nic.speed_mbps))
            if nic.operstate is not None:
                _write(d / "operstate", nic.operstate)
            link = root / "sys/class/net" / nic.name
        if nic.bus_id is not None and nic.bus_id in dirs:
            _symlink(d / "device", dirs[nic.bus_id])
        _symlink(link, d)
    # Interfaces the reader must leave out, as NCCL's socket transport does.
    lo = root / "sys/devices/virtual/net/lo"
    if not (root / "sys/class/net/lo").exists():
        _write(lo / "operstate", "unknown")
        _symlink(root / "sys/class/net/lo", lo)


def build_fake_sysfs(root: Path, snap: SysfsSnapshot) -> Path:
    """Write `snap` as a sysfs/procfs tree below `root`; returns `root` for SysfsReader(root).

    Fields the reader cannot take from a tree are not written: `cpu.arch` (the reader asks the
    running interpreter on a live node) and `has_ipv4` (it asks the kernel's address list).
    """
    root.mkdir(parents=True, exist_ok=True)
    dirs = _write_pci(root, snap.pci)
    _write_numa(root, snap)
    _write_cpuinfo(root, snap)
    _write_modules(root, snap)
    _write_nics(root, snap, dirs)
    return root
