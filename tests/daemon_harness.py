"""In-process daemons over the demo snapshot, shared by the service tests: the clocks, the node
loader and the NCCL probe injected, started on a fresh or a seeded (copied) state directory."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from demo_state import BASE_CONFIG, SNAPSHOT, copy_state

from nccltune.config import Config
from nccltune.daemon import Daemon, DaemonOptions, actions
from nccltune.daemon.actions import NcclInfo, Node
from nccltune.daemon.sdnotify import Notifier

PUBLISHED = ("nccl.sh", "nccl.env", "nccl.json", "ncclTopology.xml")
# The published tuning depends on this setting (see test_daemon.py).
RETUNE = {"sweep": {"min_gain_pct": 2.5}}


def config_text(**changes: dict[str, Any]) -> str:
    doc = json.loads(json.dumps(BASE_CONFIG))
    for section, values in changes.items():
        doc.setdefault(section, {}).update(values)
    return yaml.safe_dump(doc, sort_keys=False)


def published_bytes(state: Path) -> dict[str, bytes]:
    return {name: (state / name).read_bytes() for name in PUBLISHED if (state / name).exists()}


def seeded_nccl_version(state: Path) -> str | None:
    version = json.loads((state / "nccl.json").read_text())["provenance"].get("nccl_version")
    assert version is None or isinstance(version, str)
    return version


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """Builds started daemons and releases their locks at the end of the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.daemons: list[Daemon] = []

    def daemon(self, *, clock: Callable[[], float] | None = None, wall: dt.datetime | None = None,
               seeded: Path | None = None, node_loader: Callable[[Config, str | bool | None], Node] = actions.read_node,
               nccl: Callable[[], str | None] | None = None, **overrides: object) -> Daemon:
        """`nccl`: what the probe answers each time it is asked (default: the seeded state's NCCL)."""
        state = self.tmp_path / "state"
        nccl_version = None
        if seeded is not None:
            copy_state(seeded, state)
            nccl_version = seeded_nccl_version(state)
        cfg = self.tmp_path / "config.yaml"
        if not cfg.exists():
            cfg.write_text(config_text())
        opts = DaemonOptions(config_path=cfg, overrides={"state_dir": str(state), **overrides}, demo=str(SNAPSHOT))
        probe = nccl or (lambda: nccl_version)
        d = Daemon(opts, notifier=Notifier(env={}), clock=clock or FakeClock(),
                   wall_clock=(lambda: wall) if wall is not None else dt.datetime.now,
                   node_loader=node_loader, nccl_probe=lambda cfg, python: NcclInfo(version=probe()))
        self.daemons.append(d)
        d.start()
        return d

    def close(self) -> None:
        for d in self.daemons:
            d.close()
