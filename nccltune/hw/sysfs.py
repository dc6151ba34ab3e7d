"""sysfs reader: the only module that reads /sys, and the node facts in /proc. The root is injected.

Process facts (who descends from whom) are read by hw/procfs.py.

It records what NCCL's own topology detection reads: the PCI ancestry of every GPU and NIC
(bridges with class, ids and max link speed/width), NUMA nodes and their cpumaps, the CPU
vendor/family/model, RDMA devices and network interfaces.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from pathlib import Path

from ..files.inputfile import read_bounded
from .cpuset import cpulist_from_cpus, cpus_from_cpumask
from .types import CpuInfo, IbPort, Nic, NumaNode, PciDevice, SysfsSnapshot, normalize_bus_id, parse_int

log = logging.getLogger(__name__)

_BDF_RE = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_NVIDIA_VENDOR = "0x10de"
_GDR_MODULES = ("nvidia_peermem", "nv_peer_mem")
# Interfaces NCCL's socket transport skips by default (NCCL_SOCKET_IFNAME auto rules).
_SKIPPED_IFACES = ("lo", "docker", "virbr")
# Far above any file read here: /proc/cpuinfo of a node of a thousand CPUs is a few MiB.
MAX_FILE_BYTES = 16 << 20


class SysfsReader:
    """Reads a SysfsSnapshot below `root` ("/" on a live node, a fixture tree in tests)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)

    def _is_live(self) -> bool:
        """Whether the root is this node's own "/" (however it is spelled: "/.", a symlink).

        Only then may the interpreter (platform.machine()) and the kernel's address list speak
        for the tree; a fixture tree must be read from its files alone.
        """
        return os.path.realpath(self.root) == os.path.realpath("/")

    def _read(self, rel: str | Path) -> str | None:
        """A file's text, stripped, read within MAX_FILE_BYTES (files.inputfile.read_bounded: a
        regular file only, so that a tree holding a FIFO or a link to /dev/zero cannot hang the
        reader); None where it cannot be read, and (with a warning) where it goes on past the bound."""
        path = self.root / str(rel).lstrip("/")
        try:
            got = read_bounded(path, MAX_FILE_BYTES)
        except OSError:
            return None
        if got.cut:
            log.warning("%s: longer than %d bytes; read as unreadable", path, MAX_FILE_BYTES)
            return None
        return got.text().strip()

    def _read_int(self, rel: str | Path) -> int | None:
        return parse_int(self._read(rel))

    def read(self, gpu_bus_ids: list[str] | tuple[str, ...] = ()) -> SysfsSnapshot:
        """Read the node. `gpu_bus_ids` (from NVML) are added to the NVIDIA devices found in sysfs."""
        nics = self._read_nics()
        wanted = {normalize_bus_id(b) for b in gpu_bus_ids}
        wanted |= self._nvidia_devices()
        wanted |= {n.bus_id for n in nics if n.bus_id}
        pci: dict[str, PciDevice] = {}
        for bus_id in sorted(wanted):
            for dev in self._ancestry(bus_id):
                pci.setdefault(dev.bus_id, dev)
        return SysfsSnapshot(
            cpu=self._read_cpu(),
            numa_nodes=self._read_numa(),
            pci=tuple(sorted(pci.values(), key=lambda d: d.bus_id)),
            nics=nics,
            gdr_module=self._gdr_module(),
        )

    # -- PCI ---------------------------------------------------------------------------------

    def _pci_dir(self) -> Path:
        return self.root / "sys/bus/pci/devices"

    def _nvidia_devices(self) -> set[str]:
        """NVIDIA GPUs (class 0x03xxxx) and NVSwitches (0x0680xx) visible in sysfs."""
        found: set[str] = set()
        try:
            entries = sorted(os.listdir(self._pci_dir()))
        except OSError:
            return found
        for name in entries:
            vendor = self._read(f"sys/bus/pci/devices/{name}/vendor")
            cls = self._read(f"sys/bus/pci/devices/{name}/class") or ""
            if vendor == _NVIDIA_VENDOR and (cls.startswith("0x03") or cls.startswith("0x0680")):
                found.add(normalize_bus_id(name))
        return found

    def _device_path(self, bus_id: str) -> tuple[str, ...] | None:
        """The sysfs ancestry (`pci0000:00`, bridges..., device) of a PCI function."""
        link = self._pci_dir() / bus_id
        if not link.exists():
            return None
        real = Path(os.path.realpath(link))
        devices = Path(os.path.realpath(self.root / "sys/devices"))
        try:
            parts = real.relative_to(devices).parts
        except ValueError:
            return None
        # The path may pass through non-PCI components (e.g. a virtio bus); keep the PCI chain.
        chain = [p for p in parts if _BDF_RE.match(p) or p.startswith("pci")]
        return tuple(chain)

    def _ancestry(self, bus_id: str) -> list[PciDevice]:
        path = self._device_path(bus_id)
        if path is None:
            log.debug("%s is not in sysfs", bus_id)
            return []
        devices = []
        for i, part in enumerate(path):
            if not _BDF_RE.match(part):
                continue
            devices.append(self._pci_device(part, path[: i + 1]))
        return devices

    def _pci_device(self, name: str, path: tuple[str, ...]) -> PciDevice:
        d = f"sys/bus/pci/devices/{name}"
        numa = self._read_int(f"{d}/numa_node")
        return PciDevice(
            bus_id=normalize_bus_id(name),
            class_code=self._read(f"{d}/class") or "0x000000",
            path=tuple(normalize_bus_id(p) if _BDF_RE.match(p) else p for p in path),
            vendor=self._read(f"{d}/vendor"),
            device=self._read(f"{d}/device"),
            subsystem_vendor=self._read(f"{d}/subsystem_vendor"),
            subsystem_device=self._read(f"{d}/subsystem_device"),
            max_link_speed=self._read(f"{d}/max_link_speed"),
            max_link_width=self._read_int(f"{d}/max_link_width"),
            current_link_speed=self._read(f"{d}/current_link_speed"),
            current_link_width=self._read_int(f"{d}/current_link_width"),
            numa_node=numa if numa is not None and numa >= 0 else None,
        )

    # -- CPU and NUMA --------------------------------------------------------------------------

    def _read_cpu(self) -> CpuInfo:
        text = self._read("proc/cpuinfo") or ""
        fields: dict[str, str] = {}
        sockets: set[str] = set()
        logical = 0
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "processor":
                logical += 1
            elif key == "physical id":
                sockets.add(value)
            elif key and key not in fields:
                fields[key] = value

        def as_int(key: str) -> int | None:
            try:
                return int(fields[key], 0)
            except (KeyError, ValueError):
                return None

        return CpuInfo(
            arch=platform.machine() if self._is_live() else _arch_from_cpuinfo(fields),
            vendor=fields.get("vendor_id"),
            family=as_int("cpu family"),
            model=as_int("model"),
            model_name=fields.get("model name"),
            sockets=len(sockets) or None,
            logical_cpus=logical or None,
        )

    def _read_numa(self) -> tuple[NumaNode, ...]:
        base = self.root / "sys/devices/system/node"
        try:
            names = sorted(n for n in os.listdir(base) if re.fullmatch(r"node\d+", n))
        except OSError:
            return ()
        nodes = []
        for name in sorted(names, key=lambda n: int(n[4:])):
            cpumap = self._read(f"sys/devices/system/node/{name}/cpumap") or ""
            cpulist = self._read(f"sys/devices/system/node/{name}/cpulist")
            if cpulist is None:
                cpulist = cpulist_from_cpus(cpus_from_cpumask(cpumap)) if cpumap else ""
            nodes.append(NumaNode(id=int(name[4:]), cpumap=cpumap, cpulist=cpulist))
        return tuple(nodes)

    # -- NICs ------------------------------------------------------------------------------------

    def _gdr_module(self) -> str | None:
        modules = self._read("proc/modules") or ""
        loaded = {line.split()[0] for line in modules.splitlines() if line.strip()}
        for name in _GDR_MODULES:
            if name in loaded or (self.root / "sys/module" / name).exists():
                return name
        return None

    def _pci_of(self, device_link: Path) -> str | None:
        """Bus id of the PCI function behind a `device` link, None for virtio and other buses."""
        if not device_link.exists():
            return None
        real = Path(os.path.realpath(device_link))
        return normalize_bus_id(real.name) if _BDF_RE.match(real.name) else None

    def _read_nics(self) -> tuple[Nic, ...]:
        nics: list[Nic] = []
        gdr = self._gdr_module() is not None
        ib = self.root / "sys/class/infiniband"
        for name in sorted(os.listdir(ib)) if ib.is_dir() else []:
            ports = []
            ports_dir = ib / name / "ports"
            for port in sorted(os.listdir(ports_dir), key=int) if ports_dir.is_dir() else []:
                p = f"sys/class/infiniband/{name}/ports/{port}"
                state = self._read(f"{p}/state")
                rate = self._read(f"{p}/rate")
                m = re.match(r"([\d.]+)\s*Gb/sec", rate or "")
                ports.append(IbPort(
                    port=int(port),
                    state=state.split(":")[-1].strip() if state else None,
                    rate_gbps=float(m.group(1)) if m else None,
                    link_layer=self._read(f"{p}/link_layer"),
                ))
            nics.append(Nic(
                name=name,
                kind="ib",
                bus_id=self._pci_of(ib / name / "device"),
                ports=tuple(ports),
                guid=self._read(f"sys/class/infiniband/{name}/node_guid"),
                gdr=gdr,
            ))
        net = self.root / "sys/class/net"
        addrs = _ipv4_interfaces() if self._is_live() else None
        for name in sorted(os.listdir(net)) if net.is_dir() else []:
            if name.startswith(_SKIPPED_IFACES):
                continue
            speed = self._read_int(f"sys/class/net/{name}/speed")
            nics.append(Nic(
                name=name,
                kind="eth",
                bus_id=self._pci_of(net / name / "device"),
                speed_mbps=speed if speed is not None and speed > 0 else None,
                operstate=self._read(f"sys/class/net/{name}/operstate"),
                has_ipv4=(name in addrs) if addrs is not None else None,
            ))
        return tuple(nics)


def _arch_from_cpuinfo(fields: dict[str, str]) -> str:
    """The machine architecture a recorded /proc/cpuinfo belongs to.

    /proc/cpuinfo has no "arch" line; each architecture has its own keys instead: arm64 prints
    "CPU architecture: 8", POWER prints "cpu : POWER9 ...", x86 prints "vendor_id" (as does
    s390x, with "IBM/S390"). Without any of them the tree is taken to be x86_64, the default.
    """
    if "CPU architecture" in fields:
        return "aarch64"
    if fields.get("cpu", "").upper().startswith("POWER"):
        return "ppc64le"
    vendor = fields.get("vendor_id")
    if vendor is not None:
        return "s390x" if vendor.startswith("IBM/S390") else "x86_64"
    return CpuInfo().arch


def _ipv4_interfaces() -> set[str]:
    """Interfaces with an IPv4 address: NCCL's socket transport only picks those."""
    import socket

    import psutil

    return {
        name for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET for a in addrs)
    }


def read_sysfs(
    root: str | os.PathLike[str] = "/", gpu_bus_ids: list[str] | tuple[str, ...] = ()
) -> SysfsSnapshot:
    """Read this node's sysfs below `root`. See SysfsReader."""
    return SysfsReader(root).read(gpu_bus_ids)
