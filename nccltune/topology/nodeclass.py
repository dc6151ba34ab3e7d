"""Node class: the facts that make two nodes the same kind for NCCL, and a short id over them.

Nodes of one class may share one tuning decision: a job that spans several of them runs one
communicator, and NCCL never reconciles the settings each rank was started with. The class keeps
what NCCL's choices depend on (GPU model and count, the NVLink/NVSwitch layout, the PCIe tree as a
shape, NIC models and where they attach, CPU vendor/model, NUMA layout, driver and NCCL versions)
and leaves out what differs between identical nodes (serials, UUIDs, GUIDs, MACs, hostnames, and
PCI bus numbers, as long as renumbering keeps the shape).

Unlike the topology fingerprint (which names this node's tree, bus ids included, and changes
whenever this node's tuning is invalidated), the class is meant to be equal on every node of a
rack of identical machines.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from ..hw.cpuset import cpus_from_cpumask
from .model import CLASS_NVLINK_CPU, CLASS_NVSWITCH, Topology, XNode

log = logging.getLogger(__name__)

# Bump when the set or meaning of the facts changes: ids of different versions never compare equal.
NODE_CLASS_VERSION = 1

# Attributes of NCCL's tree that describe the kind of a device or link. Everything else (busid,
# guid, name, dev index, numaid) identifies one device on one node and is left out.
_SHAPE_ATTRS = {
    "cpu": ("arch", "vendor", "familyid", "modelid"),
    "pci": ("class", "vendor", "device", "subsystem_vendor", "subsystem_device", "link_speed", "link_width"),
    "gpu": ("sm",),
    "net": ("speed", "port", "gdr", "maxconn", "latency"),
    "nic": (),
}

# Facts, in the order a refusal lists them.
FACT_ORDER = ("class_version", "gpu_model", "gpu_count", "gpu_sm", "nvlink", "pcie_tree", "gpu_placement",
              "nics", "nic_placement", "cpu", "numa", "driver_version", "nccl_version")


@dataclass(frozen=True)
class NodeClass:
    """A class id (16 hex digits) and the facts it is the hash of."""

    id: str
    facts: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "facts": self.facts}


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _nvlink_signature(gpu: XNode) -> list[list[Any]]:
    """A GPU's NVLinks as (far-end kind, links) pairs: the peer's bus id is left out, since it
    renumbers with the node; what stays is how many links go to switches, CPUs and GPUs."""
    by_kind: dict[str, int] = {}
    for link in (c for c in gpu.children if c.tag == "nvlink"):
        tclass = link.attrs.get("tclass", "")
        kind = ("nvswitch" if tclass == CLASS_NVSWITCH else "cpu" if tclass == CLASS_NVLINK_CPU
                else "gpu" if tclass.startswith("0x03") else f"class {tclass}")
        by_kind[kind] = by_kind.get(kind, 0) + int(link.attrs.get("count", "0") or 0)
    return [[k, n] for k, n in sorted(by_kind.items())]


def _shape(node: XNode) -> dict[str, Any]:
    """A node of NCCL's tree with its identity removed and its children in canonical order.

    Children are sorted by their own canonical form, not by bus id, so two nodes whose bus
    numbers differ but whose tree is the same get the same shape.
    """
    attrs = {k: node.attrs[k] for k in _SHAPE_ATTRS.get(node.tag, ()) if k in node.attrs}
    if node.tag == "cpu":
        # The affinity mask names CPU numbers; its size is the fact.
        mask = node.attrs.get("affinity")
        if mask:
            try:
                attrs["cpus"] = str(len(cpus_from_cpumask(mask)))
            except ValueError:
                attrs["cpus"] = "?"
    out: dict[str, Any] = {"tag": node.tag, **({"attrs": attrs} if attrs else {})}
    if node.tag == "gpu":
        out["nvlink"] = _nvlink_signature(node)
        return out
    kids = [_shape(c) for c in node.children if c.tag != "nvlink"]
    if kids:
        out["children"] = sorted(kids, key=_canon)
    return out


def _devices_below(node: XNode, tag: str) -> int:
    return sum(1 for n in node.iter(tag))


def _placements(system: XNode) -> tuple[list[str], list[str]]:
    """Where each GPU and NIC sits: the chain of PCIe switches above it, and what shares its
    nearest switch. "mlx ConnectX-7 under 2 switches, beside 0 GPUs" reads as a fact a person can
    check against the node, and a NIC moved to another parent changes it."""
    gpus: list[str] = []
    nics: list[str] = []

    def walk(node: XNode, chain: list[XNode]) -> None:
        for child in node.children:
            if child.tag == "pci":
                if any(c.tag == "gpu" for c in child.children) or any(c.tag == "nic" for c in child.children):
                    parent = chain[-1] if chain else node
                    depth = len(chain)
                    gpus_near = _devices_below(parent, "gpu")
                    nics_near = _devices_below(parent, "nic")
                    dev = f"{child.attrs.get('vendor', '?')}:{child.attrs.get('device', '?')}"
                    where = f"{dev} at depth {depth}, its switch holding {gpus_near} GPU(s) and {nics_near} NIC(s)"
                    if any(c.tag == "gpu" for c in child.children):
                        gpus.append(where)
                    else:
                        nics.append(where)
                walk(child, [*chain, child])
            elif child.tag == "cpu":
                walk(child, [])

    walk(system, [])
    return sorted(gpus), sorted(nics)


def class_facts(topo: Topology, *, driver_version: str | None, nccl_version: str | None,
                image_digest: str | None = None) -> dict[str, Any]:
    """The facts of a node's class, JSON-ready. Driver and NCCL versions are inputs: the first
    comes from NVML, the second from whatever NCCL the node's jobs load (a probe or a sweep).
    `image_digest`: the job's image the NCCL is in (bench.image); a fact only when set, so that
    the classes of nodes that measure on the host keep their ids."""
    names = sorted({g.name or "unknown" for g in topo.gpus})
    sms = sorted({g.sm for g in topo.gpus if g.sm is not None})
    nvlink = sorted((_nvlink_signature(g) for g in topo.system.iter("gpu")), key=_canon)
    gpu_place, nic_place = _placements(topo.system)
    cpu_nodes = [c for c in topo.system.children if c.tag == "cpu"]
    cpu: dict[str, Any] = {}
    if cpu_nodes:
        cpu = {k: cpu_nodes[0].attrs.get(k) for k in ("arch", "vendor", "familyid", "modelid")}
    snap = topo.snapshot
    if snap is not None:
        cpu["model_name"] = snap.sysfs.cpu.model_name
        cpu["sockets"] = snap.sysfs.cpu.sockets
        cpu["logical_cpus"] = snap.sysfs.cpu.logical_cpus
    numa = sorted(_shape(c).get("attrs", {}).get("cpus", "unknown") for c in cpu_nodes)
    models = {p.attrs.get("busid"): f"{p.attrs.get('vendor', '?')}:{p.attrs.get('device', '?')}"
              for p in topo.system.iter("pci")}
    nics = sorted(f"{n.kind} {models.get(n.bus_id, 'virtual') if n.bus_id else 'virtual'} "
                  f"{n.speed_mbps or '?'} Mb/s" + (" gdr" if n.gdr else "") for n in topo.nics)
    return {
        "class_version": NODE_CLASS_VERSION,
        "gpu_model": ", ".join(names),
        "gpu_count": len(topo.gpus),
        "gpu_sm": sms,
        "nvlink": nvlink,
        "pcie_tree": _shape(topo.system),
        "gpu_placement": gpu_place,
        "nics": nics,
        "nic_placement": nic_place,
        "cpu": cpu,
        "numa": {"nodes": len(cpu_nodes), "cpus_per_node": numa},
        "driver_version": driver_version,
        "nccl_version": nccl_version,
        **({"image_digest": image_digest} if image_digest else {}),
    }


def class_id_of(facts: dict[str, Any]) -> str:
    return hashlib.sha256(_canon(facts).encode()).hexdigest()[:16]


def node_class(topo: Topology, *, nccl_version: str | None = None, driver_version: str | None = None,
               image_digest: str | None = None) -> NodeClass:
    """The class of a node. The driver version defaults to the one NVML reported for `topo`."""
    driver = driver_version if driver_version is not None else topo.driver_version
    facts = class_facts(topo, driver_version=driver, nccl_version=nccl_version, image_digest=image_digest)
    return NodeClass(class_id_of(facts), facts)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else _canon(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differing_facts(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the facts that differ, in FACT_ORDER (then any others, sorted)."""
    keys = [k for k in FACT_ORDER if k in a or k in b]
    keys += sorted((set(a) | set(b)) - set(FACT_ORDER))
    return [k for k in keys if _canon(a.get(k)) != _canon(b.get(k))]


def describe_difference(a: dict[str, Any], b: dict[str, Any], *, a_name: str = "A", b_name: str = "B") -> str:
    """One line per differing fact, e.g. "gpu_count: 8 (profile) vs 7 (this node)". Long
    structures (the PCIe tree) are named and abbreviated, not printed whole."""
    parts = []
    for key in differing_facts(a, b):
        if key == "pcie_tree":
            parts.append(f"{key}: the PCIe tree has another shape")
        else:
            parts.append(f"{key}: {_short(a.get(key))} ({a_name}) vs {_short(b.get(key))} ({b_name})")
    return "; ".join(parts) if parts else "no differing fact"


def with_class_line(text: str, topo: Topology, cls: NodeClass, note: str | None = None) -> str:
    """`nccltune topo`'s text with a "Node class:" line right after the "Fingerprint:" line
    (at the end when there is none); `note` says where the class's NCCL version came from."""
    from .fingerprint import topology_fingerprint

    fp_line = f"Fingerprint: {topology_fingerprint(topo)}"
    line = f"Node class: {cls.id}" + (f" ({note})" if note else "")
    if fp_line in text:
        return text.replace(fp_line, f"{fp_line}\n{line}", 1)
    return f"{text}\n{line}"
