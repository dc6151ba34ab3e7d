"""Snapshot rewrites shared by the fleet tests: the same node with other serials and bus numbers,
and the same node with one thing changed (a lost NVLink, a GPU fewer, a NIC moved, a driver)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from nccltune.topology.source import bundled_topologies_dir

_BUS_RE = re.compile(r"^([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
_ROOT_RE = re.compile(r"^pci([0-9a-f]{4}):([0-9a-f]{2})$")


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((bundled_topologies_dir() / f"{name}.json").read_text())
    return doc


def _bus(value: str, seed: int) -> str:
    """Bus numbers mirrored (0x18 becomes 0xd8 + seed): the order of devices by bus id reverses,
    as on a board whose firmware enumerates the other way round."""
    m = _BUS_RE.match(value)
    if m:
        return f"{m[1]}:{(0xf0 - int(m[2], 16) + seed) % 256:02x}:{m[3]}.{m[4]}"
    m = _ROOT_RE.match(value)
    if m:
        return f"pci{m[1]}:{(0xf0 - int(m[2], 16) + seed) % 256:02x}"
    return value


def sibling(doc: dict[str, Any], seed: int = 1) -> dict[str, Any]:
    """The same machine as another unit of it: new UUIDs, GUIDs, MACs, serials, hostname, and
    every PCI bus number renumbered (consistently, so the tree keeps its shape)."""
    out = copy.deepcopy(doc)

    def walk(node: Any, key: str | None = None) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, key) for v in node]
        if isinstance(node, str):
            if key == "uuid":
                return f"GPU-{seed:08x}-0000-4000-8000-{abs(hash(node)) % (1 << 48):012x}"
            if key == "guid":
                return f"{seed:04x}:{node[5:]}"
            if key in ("mac", "address", "serial", "hostname"):
                return f"{node}-unit{seed}"
            if key in ("bus_id", "remote_bus_id", "path"):
                return _bus(node, seed)
        return node

    out = walk(out)
    out["hostname"] = f"gpu-node-{seed:03d}"
    out["description"] = f"{doc.get('description')} (unit {seed})"
    return out


def write(doc: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(doc, indent=1))
    return path


def demo_profile(state: Path, snapshot: Path, out: Path, *, scale: float = 0.97) -> dict[str, Any]:
    """A class profile of two demo nodes made from one demo sweep's history (in `state`, over
    `snapshot`): the node itself and a twin (another hostname) whose every bus bandwidth is
    `scale` times the node's; written to `out` as `fleet decide` writes it."""
    from nccltune.config import Config
    from nccltune.fleet.decide import Rules, decide, dumps_profile, load_exports
    from nccltune.fleet.export import build_export, dumps_export, node_identity
    from nccltune.fleet.member import load_fleet_node
    from nccltune.store import Store

    node = load_fleet_node(Config(state_dir=str(state)), str(snapshot))
    with Store(state / "history.db") as store:
        doc = build_export(store, node_identity(node))
    twin = copy.deepcopy(doc)
    twin["hostname"] = f"{doc['hostname']}-twin"
    for run in twin["runs"]:
        for trial in run["trials"]:
            for m in trial["measurements"]:
                m["busbw_gbps"] = m["busbw_gbps"] * scale
                m["algbw_gbps"] = m["algbw_gbps"] * scale
    paths = [out.parent / f"{out.stem}.export-{i}.json" for i in (1, 2)]
    for path, export in zip(paths, (doc, twin), strict=True):
        path.write_text(dumps_export(export))
    profile = decide(load_exports(paths), Rules("balanced", min_gain_pct=1.0, max_regression_pct=2.0))
    out.write_text(dumps_profile(profile))
    return profile


def h200x2_export(host: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    """A GPU node's export of one sweep of `trials` on the recorded 2x H200 node (a class of its
    own), without the store: for the choice rules on hand-made numbers."""
    from nccltune.topology.model import from_snapshot
    from nccltune.topology.nodeclass import node_class
    from nccltune.topology.snapshot import load_snapshot

    facts = node_class(from_snapshot(load_snapshot(bundled_topologies_dir() / "h200x2-nvswitch-vm.json")))
    return {"kind": "nccltune-export", "schema_version": 1, "hostname": host, "demo": False,
            "topology_fingerprint": hashlib.sha256(host.encode()).hexdigest()[:16], "node_class": facts.as_dict(),
            "versions": {"nccltune": "0.2.0", "nccl": None, "driver": "580.159.04", "torch": None},
            "runs": [{"id": 1, "nranks": 2, "kind": "sweep", "status": "ok", "started_at": "t", "finished_at": "t",
                      "backend": "nccl", "demo": False, "profile": "balanced", "nccl_version": None,
                      "driver_version": "580.159.04", "torch_version": None, "nccltune_version": "0.2.0",
                      "hostname": host, "chosen_env": {}, "published_generation": 1, "trials": trials}]}


def shaped_runs_export(host: str, shapes: dict[int, tuple[list[float], list[float], dict[str, str]]], *,
                       nccl: str | None = None, demo: bool = False) -> dict[str, Any]:
    """h200x2_export with one sweep per node count (1: the node's own two ranks; N: a sweep over
    N nodes, its coordinator's run), each of (baseline bus bandwidths, finalist bus bandwidths,
    the finalist's env), measured with NCCL `nccl`: the class facts, id and runs say so."""
    from nccltune.topology.nodeclass import class_id_of

    runs = []
    for i, (nnodes, (base, cand, env)) in enumerate(sorted(shapes.items())):
        trials = [_trial(j + 1, "baseline", {}, b) for j, b in enumerate(base)]
        trials += [_trial(10 + j, "final", env, c) for j, c in enumerate(cand)]
        run = copy.deepcopy(h200x2_export(host, trials)["runs"][0])
        run.update(id=i + 1, nccl_version=nccl, demo=demo, backend="gloo" if demo else "nccl")
        if nnodes > 1:
            run["job"] = {"label": f"{nnodes}x2", "nnodes": nnodes, "ranks_per_node": 2, "loopback": False,
                          "launcher": "torchrun"}
        runs.append(run)
    doc = h200x2_export(host, [])
    facts = {**doc["node_class"]["facts"], "nccl_version": nccl}
    doc.update(runs=runs, demo=demo, node_class={"id": class_id_of(facts), "facts": facts})
    doc["versions"]["nccl"] = nccl
    return doc


def _trial(seq: int, phase: str, env: dict[str, str], busbw: float) -> dict[str, Any]:
    return {"seq": seq, "phase": phase, "label": "x", "env": env, "status": "ok", "reason": None, "wall_s": 1.0,
            "measurements": [{"size_bytes": s, "time_us": 1.0, "algbw_gbps": busbw, "busbw_gbps": busbw,
                              "algo": None, "proto": None, "correct": True} for s in (1 << 20, 1 << 24)]}
