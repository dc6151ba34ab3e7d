"""The class profile at profile.path as the daemon watches it: has the file changed, and what
the daemon last made of it.

A file is compared by what it resolves to, not by the name configured: a Kubernetes ConfigMap
update swaps a `..data` symlink to a new directory, config management renames a new file over
the old one, a shared filesystem may only change the mtime. The stamp (the file links resolve
to, its device, inode, size and mtime) changes in every one of those cases, and is read with one
stat per poll; the file itself is read only when its stamp changed (or when the node or the
config did), and applied only when its content is not what is already published.

After an upgrade (the node's NCCL or driver differs from the profile's), the daemon serves the
profile's safe part and, on the class's canary, re-measures: the functions below find that
profile, publish its safe part, narrow the canary's sweep, and read the upgrade gate's verdict
from the history, each through fleet/upgrade.py (THE rule and the canary rule).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import with_overrides
from ..fleet import upgrade
from ..fleet.export import node_identity
from ..fleet.gate import GateReading
from ..fleet.member import fleet_node_of
from ..fleet.upgrade import Upgraded
from ..publish import publish_setting
from ..store import Store
from .actions import Config, NcclInfo, Node

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stamp:
    """What a change of the file at the configured path changes."""

    real_path: str
    device: int
    inode: int
    size: int
    mtime_ns: int


def stamp_of(path: Path) -> Stamp | None:
    """The stamp of the file `path` resolves to (symlinks followed), None when there is none."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return Stamp(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class ProfileStatus:
    """The daemon's last look at profile.path.

    state: "absent" (no file for this node there), "in_force" (applied and valid), "safe_part" (a
    profile of this node's kind under other versions: its safe part served) or "refused";
    code and reason: why it is refused (fleet.apply.REFUSAL_CODES, and the exit-78 text).
    """

    state: str
    file: str | None = None
    code: str | None = None
    reason: str | None = None


# -- after an upgrade: the profile's safe part and the canary (fleet/upgrade.py) -------------------


@dataclass(frozen=True)
class SafePart:
    """The profile at profile.path whose safe part this node serves after an upgrade, and this
    node's role: the class's canary re-measures, every other node waits for the class's profile."""

    upgraded: Upgraded
    canary: bool

    @property
    def name(self) -> str:
        return self.upgraded.loaded.path.name


def this_host(cfg: Config, node: Node) -> str:
    """This node's name as its export gives it (fleet/export.py), which the canary rule compares."""
    return node_identity(fleet_node_of(cfg, node)).hostname


def find_safe_part(path: Path, cfg: Config, node: Node, nccl: NcclInfo) -> SafePart | None:
    """The profile at `path` of this node's kind under other NCCL or driver versions, or None.

    Raises:
        ProfileRefused: a file at `path` that is not of this node's kind (its own refusal).
    """
    upgraded = upgrade.upgraded_profile(path, fleet_node_of(cfg, node), nccl.version)
    if upgraded is None:
        return None
    return SafePart(upgraded, upgraded.canary == this_host(cfg, node))


def publish_safe_part(cfg: Config, node: Node, nccl: NcclInfo, part: SafePart, created_at: _dt.datetime) -> int | None:
    """Publish the profile's safe part unless it is what is published; the generation, or None.

    Raises:
        InputError: a config pin that cannot go with it (exit 78); PublishError, BusyError.
    """
    fleet = fleet_node_of(cfg, node)
    if upgrade.safe_part_published(cfg.publish_dir, part.upgraded, fleet):
        return None
    setting = upgrade.safe_part_setting(cfg, fleet, nccl.version, part.upgraded, created_at)
    return publish_setting(cfg, setting).generation


def safe_part_in_place(cfg: Config, node: Node, part: SafePart) -> bool:
    return upgrade.safe_part_published(cfg.publish_dir, part.upgraded, fleet_node_of(cfg, node))


def canary_config(cfg: Config, part: SafePart) -> Config:
    """The canary's sweep settings: the search narrowed to the profile's values (fleet/upgrade.py)."""
    return with_overrides(cfg, **upgrade.canary_overrides(part.upgraded.loaded.doc))


def canary_gate(cfg: Config, node: Node, nccl: NcclInfo) -> tuple[int, GateReading | None] | None:
    """The canary's sweep under this node's versions (its run id) and what the upgrade gate found
    for it against the last sweep of the previous versions; None while it has not re-measured."""
    from ..compare import upgrade_check

    with Store(cfg.state_path("history.db")) as store:
        run_id = upgrade.canary_measured(store, node.fingerprint, nccl.version, node.topo.driver_version)
        run = store.run(run_id) if run_id is not None else None
        if run is None:
            return None
        return run.id, GateReading.of(upgrade_check(store, run, warn=False))
