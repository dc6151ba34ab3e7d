"""Frozen snapshots of what the hardware readers saw.

Every reader returns these types and nothing live, so that a node's readings can be written
to a file (`nccltune topo record`), replayed (`--input`), and kept as a test fixture. A field
the hardware does not report (NVML's NotSupported, a missing sysfs file) is None.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

SNAPSHOT_SCHEMA_VERSION = 1

_BUS_ID_RE = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def parse_int(text: str | None) -> int | None:
    """An integer as sysfs and NCCL's XML write them (decimal, or 0x-prefixed hex); None if absent
    or not a number."""
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def normalize_bus_id(bus_id: str) -> str:
    """Return a PCI bus id in NCCL's form, lowercase `dddd:bb:dd.f`.

    NVML reports `00000000:00:06.0` (32-bit domain, upper case); NCCL's topology code compares
    bus ids as strings in `%04lx:%02lx:%02lx.%01lx` form, so any other spelling would create a
    second node. An NVSwitch invisible to a VM comes back as `ffffffff:ff:ff.0`.

    Raises:
        ValueError: the text is not a PCI bus id.
    """
    m = _BUS_ID_RE.match(bus_id.strip())
    if not m:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{int(m.group(4), 16):x}"


@dataclass(frozen=True)
class NvLink:
    """One NVLink of a GPU as NVML reports it."""

    link: int
    active: bool
    version: int | None = None
    remote_bus_id: str | None = None
    # "gpu", "switch", "cpu" (IBM NPU) or None when NVML does not say.
    remote_type: str | None = None


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None = None


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    bus_id: str
    pci_vendor_id: str | None = None
    pci_device_id: str | None = None
    pci_subsystem_vendor_id: str | None = None
    pci_subsystem_device_id: str | None = None
    compute_capability: tuple[int, ...] | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    pcie_cur_gen: int | None = None
    pcie_cur_width: int | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None  # kernel cpulist, e.g. "0-55,112-167"
    mig_enabled: bool | None = None
    memory_total_bytes: int | None = None
    nvlinks: tuple[NvLink, ...] = ()
    processes: tuple[GpuProcess, ...] = ()

    @property
    def sm(self) -> int | None:
        """Compute capability as NCCL writes it (major*10+minor, 90 for Hopper)."""
        if not self.compute_capability:
            return None
        major, minor = (*self.compute_capability, 0)[:2]
        return major * 10 + minor


@dataclass(frozen=True)
class P2PStatus:
    """NVML P2P capability between two GPUs (by NVML index): "ok" or NVML's reason."""

    gpu_a: int
    gpu_b: int
    read: str | None = None
    write: str | None = None
    nvlink: str | None = None
    atomics: str | None = None


@dataclass(frozen=True)
class NvmlSnapshot:
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    nvml_version: str | None = None
    gpus: tuple[Gpu, ...] = ()
    p2p: tuple[P2PStatus, ...] = ()


@dataclass(frozen=True)
class PciDevice:
    """A PCI function and what sysfs says of its link. `path` is its sysfs ancestry.

    `path` runs from the root complex (`pci0000:00`) down to the device itself, as in
    `/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0`. NCCL derives its switch tree from it.
    """

    bus_id: str
    class_code: str
    path: tuple[str, ...]
    vendor: str | None = None
    device: str | None = None
    subsystem_vendor: str | None = None
    subsystem_device: str | None = None
    max_link_speed: str | None = None  # sysfs text, e.g. "32.0 GT/s PCIe"
    max_link_width: int | None = None
    current_link_speed: str | None = None
    current_link_width: int | None = None
    numa_node: int | None = None


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpumap: str  # kernel cpumask hex, most significant 32-bit word first
    cpulist: str


@dataclass(frozen=True)
class CpuInfo:
    arch: str = "x86_64"
    vendor: str | None = None  # cpuid vendor string: GenuineIntel, AuthenticAMD, ...
    family: int | None = None
    model: int | None = None
    model_name: str | None = None
    sockets: int | None = None
    logical_cpus: int | None = None


@dataclass(frozen=True)
class IbPort:
    port: int
    state: str | None = None  # "ACTIVE", "DOWN", ...
    rate_gbps: float | None = None
    link_layer: str | None = None  # "InfiniBand" or "Ethernet" (RoCE)


@dataclass(frozen=True)
class Nic:
    """A network device NCCL could use: an RDMA device ("ib") or a plain interface ("eth")."""

    name: str
    kind: str  # "ib" or "eth"
    bus_id: str | None = None  # None for devices that are not PCI functions (virtio, usb)
    ports: tuple[IbPort, ...] = ()
    guid: str | None = None
    speed_mbps: int | None = None
    operstate: str | None = None
    has_ipv4: bool | None = None
    gdr: bool | None = None  # GPUDirect RDMA possible (peer-memory module loaded), if known


@dataclass(frozen=True)
class SysfsSnapshot:
    cpu: CpuInfo = field(default_factory=CpuInfo)
    numa_nodes: tuple[NumaNode, ...] = ()
    pci: tuple[PciDevice, ...] = ()
    nics: tuple[Nic, ...] = ()
    gdr_module: str | None = None  # "nvidia_peermem" / "nv_peer_mem" when loaded


@dataclass(frozen=True)
class Snapshot:
    """Everything nccltune read from one node: NVML answers plus the relevant sysfs subset."""

    nvml: NvmlSnapshot
    sysfs: SysfsSnapshot
    schema_version: int = SNAPSHOT_SCHEMA_VERSION
    hostname: str | None = None
    recorded_at: str | None = None
    description: str | None = None


T = TypeVar("T")


class SnapshotFormatError(ValueError):
    """A snapshot document does not match the schema; `where` is the JSON path of the fault."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


def to_dict(obj: Any) -> Any:
    """Turn a snapshot (or any value inside one) into plain JSON-able data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    return obj


def from_dict(cls: type[T], data: Any, where: str = "$") -> T:
    """Build dataclass `cls` from plain data, strictly: unknown keys and wrong types are errors.

    Raises:
        SnapshotFormatError: naming the JSON path of the first fault.
    """
    return typing.cast(T, _convert(cls, data, where))


def _convert(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, data, where)
            except SnapshotFormatError as exc:
                errors.append(exc)
        raise errors[0] if errors else SnapshotFormatError(where, "unexpected null")
    if origin is tuple:
        if not isinstance(data, list):
            raise SnapshotFormatError(where, f"expected a list, got {type(data).__name__}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(data))
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise SnapshotFormatError(where, f"expected an object, got {type(data).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SnapshotFormatError(where, f"unknown key {unknown[0]!r}")
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SnapshotFormatError(where, f"missing key {f.name!r}")
        factory: Any = tp  # is_dataclass() narrows tp to an instance type mypy cannot call
        return factory(**kwargs)
    if tp is bool:
        if not isinstance(data, bool):
            raise SnapshotFormatError(where, f"expected true/false, got {data!r}")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise SnapshotFormatError(where, f"expected an integer, got {data!r}")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise SnapshotFormatError(where, f"expected a number, got {data!r}")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise SnapshotFormatError(where, f"expected a string, got {data!r}")
        return data
    raise SnapshotFormatError(where, f"unsupported type {tp!r}")
