"""One process per rank on this node: the single-node launch, and NIC loopback."""

from __future__ import annotations

from collections.abc import Mapping

from .base import Launch, LaunchRequest, LaunchShape, ProcSpec, TrialSpec, free_port, loopback_shape

LOOPBACK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
LOOPBACK_UNSET = ("NCCL_NET_DISABLE_INTRA",)


class LocalLaunch(Launch):
    """Today's launch: one process per rank on this node, rendezvous at 127.0.0.1:port."""

    def __init__(self, nranks: int, *, loopback: bool = False, node_class: str | None = None) -> None:
        super().__init__(loopback_shape(nranks) if loopback else LaunchShape(1, nranks), node_class)

    def rank_env(self, env: Mapping[str, str], rank: int, port: int) -> dict[str, str]:
        out = dict(env)
        if self.shape.loopback:
            for name in LOOPBACK_UNSET:
                out.pop(name, None)
            out.update(LOOPBACK_ENV)
        n = self.shape.nranks
        out.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return out

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        port = free_port()
        return [ProcSpec(f"rank{r}", list(trial.worker), self.rank_env(trial.env, r, port), f"rank {r}")
                for r in range(self.shape.nranks)]


def from_request(request: LaunchRequest, shape: LaunchShape, *, node_class: str | None = None,
                 gpus: bool = False) -> LocalLaunch:
    """The registry's factory: this node's ranks, or `shape`'s NIC loopback."""
    if shape.loopback:
        return LocalLaunch(shape.nranks, loopback=True, node_class=node_class)
    return LocalLaunch(shape.ranks_per_node, node_class=node_class)
