"""What follows a sweep or a verification on every path that runs one (`nccltune sweep`,
`nccltune verify`, the daemon): the upgrade gate and the node_exporter textfile.

Both read the history, and neither may undo a run that went well: a step that cannot be done is
a warning in the log (stderr, the journal under systemd), and what the run published stays.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
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


def write_metrics(cfg: Config, node: Node, *, nccl_version: str | None, live: LiveState | None = None,
                  now: _dt.datetime | None = None) -> None:
    """Rewrite the textfile in cfg.metrics_dir (when set) from the history, with the node's class
    (as `nccltune topo` shows it) on every series, and from the same snapshot the node feature file
    (cfg.node_features_file, when set): class, published state and outlier verdict for NFD's labels.

    `nccl_version` is what the run's worker reported; without one, the newest run of this topology
    that recorded one. `live` is what only a running daemon knows; its file also counts doctor's
    findings, so that after a restart it has every series it had before. `now` dates the feature
    file's expiry (default: the clock).
    """
    directory, features = cfg.metrics_dir, cfg.node_features_file
    if directory is None and features is None:
        return
    from .delivery.nodefeatures import node_labels, write_feature_file
    from .fleet.member import fleet_node_of
    from .metrics import snapshot_from_store, write_snapshot

    try:
        with Store(cfg.state_path("history.db")) as store:
            if nccl_version is None and not node.demo:
                recorded = [r.nccl_version for r in store.runs(limit=None) if r.fingerprint == node.fingerprint
                            and r.nccl_version]
                nccl_version = recorded[0] if recorded else None
            if live is not None and directory is not None:
                live = dataclasses.replace(live, doctor=_doctor_counts(cfg, node, store))
            snap = snapshot_from_store(store, fingerprint=node.fingerprint,
                                       node_class=fleet_node_of(cfg, node).node_class(nccl_version).id,
                                       live=live, publish_dir=cfg.publish_dir)
    except (OSError, NccltuneError) as exc:
        what = " and ".join(w for w, t in (("metrics", directory), ("node features", features)) if t is not None)
        where = ", ".join(str(t) for t in (directory, features) if t is not None)
        log.warning("cannot write %s to %s: %s", what, where, exc)
        return
    if directory is not None:
        try:
            write_snapshot(directory, snap)
        except (OSError, NccltuneError) as exc:
            log.warning("cannot write metrics to %s: %s", directory, exc)
    if features is not None:
        published = snap.published
        labels = node_labels(node_class=snap.node_class, published_state=published.state if published else None,
                             decision=published.decision if published else None, outlier=snap.class_outlier)
        try:
            write_feature_file(features, labels, now or _dt.datetime.now(_dt.timezone.utc))
        except (OSError, NccltuneError) as exc:
            log.warning("cannot write the node features to %s: %s", features, exc)


def _doctor_counts(cfg: Config, node: Node, store: Store) -> dict[str, int]:
    """What `nccltune doctor` would find now, counted by severity."""
    from .checks.doctor import diagnose, history_findings
    from .nccl.sitetuner import default_conf_files

    findings = diagnose(node.topo, node.paths, env=dict(os.environ), publish_dir=cfg.publish_dir,
                        conf_files=default_conf_files(os.environ), tuner_mode=cfg.tuner.plugin)
    findings += history_findings(store, node.fingerprint)
    return {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
