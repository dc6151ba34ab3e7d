"""Topology fingerprint: a stable hash of the facts that, when they change, invalidate a tuning.

In: GPU set (bus ids, model, compute capability), NVLink counts per target, PCIe maximum
generation/width and whether a link runs narrower than its maximum, switch tree, NUMA layout,
NIC set and speeds, driver version. Out: anything volatile (current PCIe generation, which
drops at idle; processes; temperatures; order of enumeration).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .model import CLASS_NVSWITCH, Topology, XNode


def topology_facts(topo: Topology) -> dict[str, Any]:
    gpus = []
    for g in topo.gpus:
        gpus.append({"bus_id": g.bus_id, "name": g.name, "sm": g.sm, "numa": g.numa_node,
                     "pcie_max_gen": g.pcie_max_gen, "pcie_max_width": g.pcie_max_width,
                     "nvlinks_active": g.nvlinks_active,
                     # A link trained to fewer lanes than it has is a fault (a bad riser or slot);
                     # the current *generation* is left out, since GPUs drop it whenever idle.
                     "pcie_width_degraded": bool(g.pcie_cur_width and g.pcie_max_width
                                                 and g.pcie_cur_width < g.pcie_max_width)})
    pci = []
    nvlinks = []
    cpus = []

    def walk(node: XNode, numa: str) -> None:
        for child in node.children:
            if child.tag == "cpu":
                cpus.append({k: child.attrs.get(k) for k in ("numaid", "affinity", "vendor", "familyid", "modelid")})
                walk(child, child.attrs.get("numaid", "-1"))
            elif child.tag == "pci":
                pci.append({"busid": child.attrs.get("busid"), "class": child.attrs.get("class"),
                            "link_speed": child.attrs.get("link_speed"),
                            "link_width": child.attrs.get("link_width"), "numa": numa})
                for gpu in (c for c in child.children if c.tag == "gpu"):
                    nvs = 0
                    for link in (c for c in gpu.children if c.tag == "nvlink"):
                        if link.attrs.get("tclass") == CLASS_NVSWITCH:
                            nvs += int(link.attrs.get("count", "0") or 0)
                        else:
                            nvlinks.append({"gpu": child.attrs.get("busid"), "target": link.attrs.get("target"),
                                            "count": link.attrs.get("count")})
                    if nvs:
                        nvlinks.append({"gpu": child.attrs.get("busid"), "target": "NVS", "count": str(nvs)})
                walk(child, numa)

    walk(topo.system, "-1")
    nics = [{"name": n.name, "bus_id": n.bus_id, "speed_mbps": n.speed_mbps, "kind": n.kind} for n in topo.nics]

    def ordered(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(items, key=lambda d: json.dumps(d, sort_keys=True))

    return {
        "gpus": ordered(gpus), "pci": ordered(pci), "nvlinks": ordered(nvlinks), "cpus": ordered(cpus),
        "nics": ordered(nics), "driver_version": topo.driver_version,
    }


def fingerprint_of(facts: dict[str, Any]) -> str:
    blob = json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def topology_fingerprint(topo: Topology) -> str:
    return fingerprint_of(topology_facts(topo))
