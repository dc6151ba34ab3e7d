"""What of a class profile stays safe after NCCL, the driver or torch changed (docs/upgrades.md).

An allow-list, not a deny-list: a variable stays only when it names the node's hardware and
wiring (which interfaces, which HCAs, which topology file) or the job's error handling, none of
which an NCCL release re-decides. Everything else a profile carries (algorithm, protocol and
channel pins, buffer sizes, the tuner's table, any name this list does not know) was chosen
against the old version's defaults and is left out until the class's canary has re-measured.
"""

from __future__ import annotations

from collections.abc import Mapping

SAFE_AFTER_UPGRADE = frozenset({
    "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_SL", "NCCL_IB_TC", "NCCL_TOPO_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
})


def safe_part(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """`env` split into what stays under a new version (in its order) and the names left out (sorted)."""
    kept = {name: value for name, value in env.items() if name in SAFE_AFTER_UPGRADE}
    return kept, sorted(set(env) - set(kept))
