"""`nccltune daemon`: the node service that keeps NCCL settings right as the node changes.

Three parts: `scheduler` decides (sweep now, verify now, or wait, with the reason) from an
immutable state and the time; `watcher` turns polls of the node into events (topology or
NCCL changed, GPUs busy or idle, node unreadable, config reloaded); `profile` watches the
class profile at profile.path; `service` is the loop around them (signals, watchdog, sd_notify,
the daemon lock, the heartbeat file, metrics, the class profile kept applied) and carries out
the decisions. `actions` is the one module that calls the sweep, verify, publish, fleet,
history, lock and metrics code.
"""

from __future__ import annotations

from .service import ABORT_CHECK_EVERY_S, Daemon, DaemonOptions
from .watcher import DEMO_BUSY_FILE, describe_change

__all__ = ["ABORT_CHECK_EVERY_S", "DEMO_BUSY_FILE", "Daemon", "DaemonOptions", "describe_change"]
