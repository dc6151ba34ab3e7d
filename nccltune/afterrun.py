"""What follows a sweep or a verification on every path that runs one (`nccltune sweep`,
`nccltune verify`, the daemon): the upgrade gate and the node_exporter textfile.

Both read the history, and neither may undo a run that went well: a step that cannot be done is
a warning in the log (stderr, the journal under systemd), and what the run published stays.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from .errors import NccltuneError
from .store import Store

if TYPE_CHECKING:
    from .config import Config
    from .metrics import LiveState
    from .node import Node

log = logging.getLogger(__name__)


def upgrade_check(cfg: Config, run_id: int | None) -> None:
    """After a sweep: a warning per size where it is slower beyond noise than the last sweep of the
    previous NCCL/driver/torch versions (compare.upgrade_gate; nothing unless the run finished ok)."""
    from .compare import upgrade_gate

    try:
        with Store(cfg.state_path("history.db")) as store:
            upgrade_gate(store, run_id)
    except (OSError, NccltuneError) as exc:
        log.warning("cannot run the upgrade check: %s", exc)


def write_metrics(cfg: Config, node: Node, *, nccl_version: str | None, live: LiveState | None = None) -> None:
    """Rewrite the textfile in cfg.metrics_dir (when set) from the history, with the node's class
    (as `nccltune topo` shows it) on every series.

    `nccl_version` is what the run's worker reported; without one, the newest run of this topology
    that recorded one. `live` is what only a running daemon knows; its file also counts doctor's
    findings, so that after a restart it has every series it had before.
    """
    directory = cfg.metrics_dir
    if directory is None:
        return
    from .fleet.node import fleet_node_of
    from .metrics import write_metrics_from_store

    try:
        with Store(cfg.state_path("history.db")) as store:
            if nccl_version is None and not node.demo:
                recorded = [r.nccl_version for r in store.runs(limit=None) if r.fingerprint == node.fingerprint
                            and r.nccl_version]
                nccl_version = recorded[0] if recorded else None
            if live is not None:
                live = dataclasses.replace(live, doctor=_doctor_counts(cfg, node, store))
            write_metrics_from_store(directory, store, fingerprint=node.fingerprint,
                                     node_class=fleet_node_of(cfg, node).node_class(nccl_version).id,
                                     live=live, publish_dir=cfg.publish_dir)
    except (OSError, NccltuneError) as exc:
        log.warning("cannot write metrics to %s: %s", directory, exc)


def _doctor_counts(cfg: Config, node: Node, store: Store) -> dict[str, int]:
    """What `nccltune doctor` would find now, counted by severity."""
    from .checks.doctor import diagnose, history_findings
    from .nccl.sitetuner import default_conf_files

    findings = diagnose(node.topo, node.paths, env=dict(os.environ), publish_dir=cfg.publish_dir,
                        conf_files=default_conf_files(os.environ), tuner_mode=cfg.tuner.plugin)
    findings += history_findings(store, node.fingerprint)
    return {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
