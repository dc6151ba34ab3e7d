"""Semantic differences between two topologies (snapshots or NCCL XML files).

Attribute order, NCCL's volatile attributes (host_hash, rank, keep) and spellings NCCL treats
alike (link_width 0 = 16, "0x6" = "6", any number of NVSwitch targets = one NVS node) are not
differences. Attributes present on one side only that NCCL fills in by itself are reported
apart, as "filled", since a re-dump of a file always carries them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .links import pci_lane_rate
from .model import CLASS_NVSWITCH, Topology, XNode
from .ncclxml import FILLED_ATTRS, VOLATILE_ATTRS


@dataclass(frozen=True)
class Change:
    """One attribute of one element that differs: its value in A and in B (None: absent there).

    `str()` is the line `topo diff` prints; JSON documents carry `as_dict()`, never that line.
    An empty `attribute` is a problem of the whole file (`path` says it), not of one attribute.
    """

    path: str
    attribute: str
    a: str | None
    b: str | None

    def __str__(self) -> str:
        if not self.attribute:
            return self.path
        if self.a is not None and self.b is not None:
            return f"{self.path} {self.attribute}: {self.a!r} -> {self.b!r}"
        side, value = ("a", self.a) if self.a is not None else ("b", self.b)
        return f"{self.path} {self.attribute}={value!r} only in {side}"

    def as_dict(self) -> dict[str, str | None]:
        return {"path": self.path, "attribute": self.attribute, "a": self.a, "b": self.b}


@dataclass
class TopoDiff:
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    filled: list[Change] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not (self.only_a or self.only_b or self.changed)

    def as_dict(self) -> dict[str, object]:
        return {"same": self.same, "only_a": self.only_a, "only_b": self.only_b,
                "changed": [c.as_dict() for c in self.changed], "filled": [c.as_dict() for c in self.filled]}


def node_type(topo: Topology) -> str:
    """What kind of node a topology is, in a few words: GPU count and model, NVLink, NICs. Two
    files of the same kind of node (a snapshot and its XML) say the same words."""
    names = sorted({g.name or "GPU" for g in topo.gpus})
    nvlink = bool(topo.system.iter("nvlink"))
    return (f"{len(topo.gpus)}x {'/'.join(names)}" + (", NVLink" if nvlink else ", PCIe only")
            + f", {len(topo.nics)} NIC(s)")


def summary_line(d: TopoDiff, a: Topology, b: Topology, name_a: str, name_b: str) -> str | None:
    """The line `topo diff` starts with when A and B are different kinds of node (None otherwise):
    what each is and how much differs, before the element-by-element list."""
    type_a, type_b = node_type(a), node_type(b)
    if type_a == type_b:
        return None
    return (f"Different node types: {name_a} is {type_a}, {name_b} is {type_b}; "
            f"{len(d.only_a)} element(s) only in {name_a}, {len(d.only_b)} only in {name_b}, "
            f"{len(d.changed)} attribute(s) differ.")


def _identity(node: XNode) -> str:
    a = node.attrs
    if node.tag == "cpu":
        return f"cpu[numaid={_num(a.get('numaid'))}]"
    if node.tag == "pci":
        return f"pci[{a.get('busid', '?')}]"
    if node.tag == "gpu":
        return "gpu"
    if node.tag == "nvlink":
        if a.get("tclass", CLASS_NVSWITCH) == CLASS_NVSWITCH:
            return "nvlink[NVS]"
        return f"nvlink[{a.get('target', '?')}]"
    if node.tag == "net":
        return f"net[{a.get('name', '?')}]"
    return node.tag


def _num(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return str(int(value, 0))
    except ValueError:
        return value


def _normal_value(key: str, value: str) -> str:
    if key == "link_width":
        n = _num(value) if value else "0"
        return "16" if n in ("0", None) else str(n)
    if key == "link_speed":
        return str(pci_lane_rate(value))
    if key in ("familyid", "modelid", "numaid", "count", "dev", "sm", "speed", "port", "gdr"):
        return _num(value) or value
    if key in ("class", "tclass", "vendor", "device", "subsystem_vendor", "subsystem_device", "busid",
               "target", "guid"):
        return value.lower()
    return value


def _canonical(node: XNode) -> dict[str, tuple[dict[str, str], XNode]]:
    """Flatten the tree to {path: (normalised attributes, node)}, merging NVSwitch links."""
    out: dict[str, tuple[dict[str, str], XNode]] = {}

    def walk(n: XNode, prefix: str) -> None:
        merged_nvs = 0
        for child in n.children:
            ident = _identity(child)
            path = f"{prefix}/{ident}"
            if ident == "nvlink[NVS]":
                merged_nvs += int(_num(child.attrs.get("count", "0")) or 0)
                continue
            attrs = {k: _normal_value(k, v) for k, v in child.attrs.items() if k not in VOLATILE_ATTRS}
            if child.tag == "nic" and path in out:
                walk(child, path)
                continue
            out[path] = (attrs, child)
            walk(child, path)
        if merged_nvs:
            # A stand-in element carrying the summed count, so a report shows the two totals.
            merged = XNode("nvlink", {"count": str(merged_nvs), "tclass": CLASS_NVSWITCH}, line=n.line)
            out[f"{prefix}/nvlink[NVS]"] = (dict(merged.attrs), merged)

    attrs = {k: _normal_value(k, v) for k, v in node.attrs.items() if k not in VOLATILE_ATTRS}
    out["system"] = (attrs, node)
    walk(node, "system")
    return out


def diff_trees(a: XNode, b: XNode) -> TopoDiff:
    ca, cb = _canonical(a), _canonical(b)
    d = TopoDiff()
    for path in sorted(set(ca) - set(cb)):
        d.only_a.append(path)
    for path in sorted(set(cb) - set(ca)):
        d.only_b.append(path)
    for path in sorted(set(ca) & set(cb)):
        aa, ab = ca[path][0], cb[path][0]
        for key in sorted(set(aa) | set(ab)):
            if key in aa and key in ab:
                if aa[key] != ab[key]:
                    d.changed.append(Change(path, key, ca[path][1].attrs.get(key), cb[path][1].attrs.get(key)))
            else:
                entry = Change(path, key, ca[path][1].attrs.get(key) if key in aa else None,
                               cb[path][1].attrs.get(key) if key in ab else None)
                (d.filled if key in FILLED_ATTRS else d.changed).append(entry)
    return d
