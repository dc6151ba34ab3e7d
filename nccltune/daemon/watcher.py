"""What changed on the node since the last look: polls in, events out.

The watcher keeps the last node, its topology facts and the NCCL the worker loads, and turns
each poll into events by comparing the new readings with them: the node became unreadable or
readable again, the GPUs are busy or idle, the topology changed (with what changed), the NCCL
library changed. Reloading the configuration is one more event. How the node is loaded, how
NCCL is probed and who uses the GPUs are injected callables, so that the comparisons can be
exercised with any readings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import NccltuneError
from ..hw.nvml import compute_pids
from ..hw.procfs import descendants
from ..topology.fingerprint import topology_facts
from ..topology.snapshot import load_snapshot
from ..topology.source import resolve_snapshot
from .actions import Config, NcclInfo, Node

log = logging.getLogger(__name__)

# Demo only: while this file exists in the state directory, the (simulated) GPUs count as busy,
# so that start/stop of jobs can be exercised without GPUs.
DEMO_BUSY_FILE = "demo-busy"


# -- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeUnreadable:
    why: str


@dataclass(frozen=True)
class NodeReadable:
    """The node reads again after NodeUnreadable."""


@dataclass(frozen=True)
class GpusBusy:
    pids: tuple[int, ...]  # compute processes that are not the daemon's own


@dataclass(frozen=True)
class GpusIdle:
    pass


@dataclass(frozen=True)
class TopologyChanged:
    old_fingerprint: str
    new_fingerprint: str
    changes: tuple[str, ...]  # describe_change() of the two sets of facts


@dataclass(frozen=True)
class NcclChanged:
    library: str
    old_version: str | None
    new_version: str | None


@dataclass(frozen=True)
class ConfigReloaded:
    cfg: Config


@dataclass(frozen=True)
class ConfigRejected:
    why: str


Event = NodeUnreadable | NodeReadable | GpusBusy | GpusIdle | TopologyChanged | NcclChanged
ConfigEvent = ConfigReloaded | ConfigRejected


# -- the watcher ----------------------------------------------------------------------------------


def library_stat(path: str) -> tuple[int, int] | None:
    """(size in bytes, mtime in whole seconds) of a file, None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, int(st.st_mtime)


class Watcher:
    """Polls the node and reports what changed. start() must succeed before poll().

    load_node: the whole node (raises when it cannot be read). probe_nccl: the worker's NCCL.
    gpu_users: pids of compute processes on a node's GPUs that are not the daemon's own.
    load_config: the configuration as it is on disk now (raises NccltuneError when invalid).
    """

    def __init__(self, load_node: Callable[[], Node], probe_nccl: Callable[[], NcclInfo],
                 gpu_users: Callable[[Node], list[int]], load_config: Callable[[], Config], *,
                 stat_library: Callable[[str], tuple[int, int] | None] = library_stat) -> None:
        self._load_node = load_node
        self._probe_nccl = probe_nccl
        self._gpu_users = gpu_users
        self._load_config = load_config
        self._stat_library = stat_library
        self._node: Node | None = None
        self.facts: dict[str, Any] = {}
        self.nccl = NcclInfo()
        self.unreadable = False

    @property
    def started(self) -> bool:
        return self._node is not None

    @property
    def node(self) -> Node:
        if self._node is None:
            raise RuntimeError("Watcher.start() was not called")
        return self._node

    def start(self) -> None:
        """First readings. Errors propagate: a node that cannot be read at start-up stops the start."""
        self._node = self._load_node()
        self.facts = topology_facts(self._node.topo)
        self.nccl = self._probe_nccl()

    def poll(self) -> list[Event]:
        """Read the node again and report, in order: readability, GPU use, topology, NCCL."""
        try:
            node = self._load_node()
            pids = self._gpu_users(node)
        except NccltuneError as exc:
            return self._unreadable(f"cannot read the node: {exc.message}")
        except Exception as exc:  # NVML errors (GPU lost, driver unloaded) are not NccltuneErrors
            return self._unreadable(f"NVML error: {exc}")
        events: list[Event] = []
        if self.unreadable:
            self.unreadable = False
            events.append(NodeReadable())
        events.append(GpusBusy(tuple(pids)) if pids else GpusIdle())
        facts = topology_facts(node.topo)
        old = self.node
        if node.fingerprint != old.fingerprint:
            events.append(TopologyChanged(old.fingerprint, node.fingerprint, tuple(describe_change(self.facts, facts))))
        self._node, self.facts = node, facts
        changed = self._nccl_change()
        if changed is not None:
            events.append(changed)
        return events

    def _unreadable(self, why: str) -> list[Event]:
        self.unreadable = True
        return [NodeUnreadable(why)]

    def _nccl_change(self) -> NcclChanged | None:
        lib = self.nccl.library
        if not lib:
            return None
        if self._stat_library(lib) == self.nccl.library_stat:
            return None
        old = self.nccl.version
        self.nccl = self._probe_nccl()
        return NcclChanged(lib, old, self.nccl.version)

    def check_busy(self) -> GpusBusy | GpusIdle | None:
        """Who uses the GPUs of the node as last polled: the cheap check made while trials run.
        None when it cannot tell (the next poll judges the node)."""
        try:
            pids = self._gpu_users(self.node)
        except Exception as exc:  # NVML errors included: the poll reports them as degraded
            log.debug("busy check failed: %s", exc)
            return None
        return GpusBusy(tuple(pids)) if pids else GpusIdle()

    def reload_config(self) -> ConfigEvent:
        try:
            return ConfigReloaded(self._load_config())
        except NccltuneError as exc:
            return ConfigRejected(str(exc))


# -- who uses the GPUs ----------------------------------------------------------------------------


def gpu_users(node: Node, *, state_dir: Path, snapshot: str | None,
              nvml_pids: Callable[[Iterable[int]], dict[int, tuple[int, ...]]] = compute_pids,
              own: Callable[[], set[int]] = descendants) -> list[int]:
    """Compute processes on the node's GPUs that are not this process's own (its trial ranks).

    One process query per GPU through NVML; a recorded snapshot that stands in for NVML
    (topology.snapshot) is read again for its processes; in the CPU demo, the GPUs are busy
    while DEMO_BUSY_FILE exists in the state directory.
    """
    if node.demo:
        return [0] if (state_dir / DEMO_BUSY_FILE).exists() else []
    if snapshot:
        by_gpu = {g.index: tuple(p.pid for p in g.processes)
                  for g in load_snapshot(resolve_snapshot(snapshot)).nvml.gpus}
    else:
        by_gpu = nvml_pids([g.index for g in node.snapshot.nvml.gpus])
    pids = {pid for on_gpu in by_gpu.values() for pid in on_gpu}
    if not pids:
        return []
    return sorted(pids - own())


# -- describing a topology change -----------------------------------------------------------------


def describe_change(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two sets of topology facts (fingerprint inputs)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            ident = _identity_key(key, a, b)
            if ident is None:
                out.append(f"{key} changed")
                continue
            before = {ident(x): x for x in a}
            after = {ident(x): x for x in b}
            for k in sorted(set(before) - set(after)):
                out.append(f"{key} {k} is gone")
            for k in sorted(set(after) - set(before)):
                out.append(f"{key} {k} is new")
            for k in sorted(set(before) & set(after)):
                for field_name in sorted(set(before[k]) | set(after[k])):
                    va, vb = before[k].get(field_name), after[k].get(field_name)
                    if va != vb:
                        out.append(f"{key} {k}: {field_name} {va} -> {vb}")
        else:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def _identity_key(key: str, a: list[Any], b: list[Any]) -> Callable[[dict[str, Any]], str] | None:
    """What names one entry of a facts list, or None when no field tells the entries apart.

    The field must be set and unique on both sides: NICs without a PCI address (virtio in VMs)
    all have bus_id None, and keying on it would fold them into one entry and hide changes.
    """
    if not all(isinstance(x, dict) for x in a + b):
        return None
    for k in ("bus_id", "busid", "gpu", "name", "numaid"):
        def ident(x: dict[str, Any], k: str = k) -> str:
            return str(x[k]) + (f"->{x.get('target')}" if key == "nvlinks" else "")

        if not all(x.get(k) is not None for x in a + b):
            continue
        if len({ident(x) for x in a}) == len(a) and len({ident(x) for x in b}) == len(b):
            return ident
    return None
