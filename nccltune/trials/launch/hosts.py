"""N NCCL hosts on a node with one GPU: one process per rank here, each with its own NCCL_HOSTID.

NCCL takes ranks whose NCCL_HOSTID differ for ranks on different hosts, so N processes on the one
GPU form a communicator of N nodes x 1 rank over NCCL's socket transport: the shape of every job
that spans one-GPU nodes. `verify` on such a node (checks/onegpu.py) starts its check ranks with
this launch to prove what NCCL runs for the published table's shapes. The ranks time-share the
GPU: their timing proves nothing about speed, and nothing reads it.

NCCL_HOSTID is set here alone, in these check processes: it is never swept, pinned or published
(a real job's ranks each keep their own host's). The runner starts the processes, keeps the
timeout and the kill, as for every other launch; this class only says what each rank gets.
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import Launch, LaunchShape
from .local import LocalLaunch

HOSTID_VAR = "NCCL_HOSTID"
HOSTID_PREFIX = "nccltune-check-host"


class HostsOnOneGpuLaunch(LocalLaunch):
    """`nhosts` ranks on this node's one GPU, each its own NCCL host: the shape nhosts x 1."""

    def __init__(self, nhosts: int, *, node_class: str | None = None) -> None:
        if nhosts < 2:
            raise ValueError(f"{nhosts} host(s): a communicator of several nodes needs 2 or more")
        Launch.__init__(self, LaunchShape(nhosts, 1), node_class)

    def rank_env(self, env: Mapping[str, str], rank: int, port: int) -> dict[str, str]:
        out = super().rank_env(env, rank, port)
        # Each rank is alone on its "host": local rank 0 of 1, on the one GPU the node has.
        out.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        out[HOSTID_VAR] = f"{HOSTID_PREFIX}{rank}"
        return out
