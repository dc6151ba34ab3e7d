"""The node's class, published state and outlier verdict as a Node Feature Discovery feature file,
so that a Kubernetes cluster sees them as node labels without nccltune holding any credential.

NFD's worker reads every file of its ``features.d`` directory (on the host
``/etc/kubernetes/node-feature-discovery/features.d``; ``publish.node_features_file`` names
nccltune's file there) and its master turns each ``name=value`` line into a node label; a name
without a namespace becomes ``feature.node.kubernetes.io/<name>``, which NFD allows without any
configuration of its own. So the labels are::

    feature.node.kubernetes.io/nccltune-class=<16 hex digits>
    feature.node.kubernetes.io/nccltune-state=tuned|defaults|safe|none
    feature.node.kubernetes.io/nccltune-decision=node|class|none
    feature.node.kubernetes.io/nccltune-outlier=true|false|unknown

A scheduler or an SRE selects on them (``kubectl get nodes -l
feature.node.kubernetes.io/nccltune-outlier=true``); nothing here cordons, taints or evicts: that
stays a human's or a remediation controller's decision.

The file says when it expires (NFD's ``# +expiry-time=`` directive), an hour after it was
written: the daemon rewrites it with its metrics at every poll, so labels of a node whose daemon
is gone lapse instead of standing as if current. The file is replaced atomically: NFD may read it
at any moment. Every value is checked against Kubernetes' rule for label values before anything
is written.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Mapping
from pathlib import Path

from ..errors import InputError
from ..files.atomicfile import atomic_write
from ..files.trust import ensure_dir

DEFAULT_FILE = "/etc/kubernetes/node-feature-discovery/features.d/nccltune"
NAME_PREFIX = "nccltune-"
EXPIRY = _dt.timedelta(hours=1)
# Kubernetes' label value: at most 63 characters, alphanumerics at both ends, "-", "_", "." within.
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_LABEL_NAME = re.compile(r"^[a-z0-9](?:[-a-z0-9_.]{0,61}[a-z0-9])?$")


def node_labels(*, node_class: str, published_state: str | None, decision: str | None,
                outlier: bool | None) -> dict[str, str]:
    """The feature names (without NFD's prefix) and their values; None: nothing published, or
    no verdict yet (no class profile in force, or no verify since)."""
    return {
        f"{NAME_PREFIX}class": node_class,
        f"{NAME_PREFIX}state": published_state or "none",
        f"{NAME_PREFIX}decision": decision or "none",
        f"{NAME_PREFIX}outlier": "unknown" if outlier is None else str(outlier).lower(),
    }


def render(labels: Mapping[str, str], now: _dt.datetime) -> str:
    """The feature file's text.

    Raises:
        InputError: a name or a value that is no valid label (exit 78).
    """
    for name, value in labels.items():
        if not _LABEL_NAME.match(name):
            raise InputError("node features", f"{name!r} is not a valid label name")
        if not _LABEL_VALUE.match(value):
            raise InputError("node features", f"{name}: {value!r} is not a valid label value (at most 63 "
                             "characters, letters, digits, '-', '_', '.', alphanumeric at both ends)")
    expires = (now.astimezone(_dt.timezone.utc) + EXPIRY).replace(microsecond=0)
    lines = ["# nccltune's node features (nccltune.delivery.nodefeatures); rewritten at every poll",
             f"# +expiry-time={expires.strftime('%Y-%m-%dT%H:%M:%SZ')}"]
    lines += [f"{name}={value}" for name, value in sorted(labels.items())]
    return "\n".join(lines) + "\n"


def write_feature_file(path: Path, labels: Mapping[str, str], now: _dt.datetime) -> Path:
    """Check, then atomically replace `path` (mode 0644: NFD's worker may run as another user).

    Raises:
        InputError: a value that is no label value, or a directory that may not be trusted (exit 78).
        FileError: the OS refused the write.
    """
    text = render(labels, now)
    ensure_dir(path.parent, "node features directory")
    atomic_write(path, text, 0o644)
    return path
