"""NCCL's link tables: path types in rank order, and the bandwidths NCCL models for PCIe lanes,
NVLinks and the links between CPU sockets (topo.h, topo.cc).

A leaf of the topology package: the model, the path search and the differ read these tables,
and this module reads none of them. `cpu` arguments are a <cpu> element's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping

# Names are stable across NCCL versions, numbers are not (2.28+ numbering; graph.h).
PATH_TYPES = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET", "DIS")
RANK = {name: i for i, name in enumerate(PATH_TYPES)}

LOC_BW = 5000.0
# Per-lane rate in units of 100 Mbps (topo.h kvDictPciGen); "GB/s = width * rate / 80".
_PCI_LANE = [("2.5 GT/s", 15), ("5 GT/s", 30), ("5.0 GT/s", 30), ("8.0 GT/s", 60), ("8 GT/s", 60),
             ("16.0 GT/s", 120), ("16 GT/s", 120), ("32.0 GT/s", 240), ("32 GT/s", 240),
             ("64.0 GT/s", 480), ("64 GT/s", 480)]


def pci_lane_rate(speed: str) -> float:
    """NCCL's per-lane value for a link_speed string; anything unknown falls back to Gen3 (60)."""
    s = speed.strip()
    for prefix, rate in _PCI_LANE:
        if s == prefix or s == prefix + " PCIe":
            return float(rate)
    return 60.0


def pci_bw_gbps(speed: str | None, width: str | int | None) -> float:
    try:
        w = int(width) if width not in (None, "") else 0
    except (TypeError, ValueError):
        w = 0
    if w <= 0:
        w = 16  # NCCL treats 0 or empty as x16
    return w * pci_lane_rate(speed or "") / 80.0


def nvlink_bw_per_link(sm: int | None) -> float:
    """GB/s per NVLink as NCCL models it (topo.h ncclTopoNVLinkBw)."""
    if sm is None:
        return 20.0
    if sm >= 100:
        return 40.1
    if sm >= 90:
        return 20.6
    if sm == 86:
        return 12.0
    if sm >= 70:
        return 20.0
    if sm >= 60:
        return 18.0
    return 20.0


def attr_int(attrs: Mapping[str, str], key: str) -> int | None:
    """An integer attribute of an XML element as NCCL reads it (0x... allowed); None if absent or bad."""
    try:
        return int(attrs.get(key, ""), 0)
    except ValueError:
        return None


def inter_cpu_bw(cpu: Mapping[str, str]) -> float:
    """Bandwidth NCCL models between two CPU sockets (topo.cc ncclTopoGetInterCpuBw).

    The Intel generations count only for family 6 and the Zhaoxin Yongfeng only for family 7
    model 0x5B (topo.cc ncclTopoAddCpu); any other family gets the oldest generation's figure.
    """
    arch = cpu.get("arch", "x86_64")
    vendor = cpu.get("vendor", "")
    if arch in ("arm64", "aarch64"):
        return 6.0
    if arch in ("ppc64", "ppc64le"):
        return 32.0
    family, model = attr_int(cpu, "familyid"), attr_int(cpu, "modelid") or 0
    if vendor == "GenuineIntel":
        if family != 6:
            return 6.0
        if model >= 0xCF:
            return 40.0
        if model >= 0x8F:
            return 22.0
        if model >= 0x55:
            return 10.0
        return 6.0
    if vendor == "AuthenticAMD":
        return 16.0
    if vendor in ("CentaurHauls", "  Shanghai  "):
        return 9.0 if (family, model) == (7, 0x5B) else 6.0
    # Any other vendor string leaves NCCL's default, which makes cross-socket links look free.
    return LOC_BW
