"""One rank of the rig's torch job: all_reduce and all_gather at the rig's sizes, a few calls each,
checked. NCCL_HOSTID comes from the caller (one per rank: each rank its own NCCL host on one GPU).
Run by bench/gpu_nccl_hosts_rig.sh through `nccltune exec` and through launchers/nccltune-torchrun."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

SIZES = [int(s) for s in os.environ.get("RIG_SIZES", "65536,1048576,16777216,67108864").split(",")]


def main() -> int:
    backend = os.environ.get("RIG_BACKEND", "nccl")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    for size in SIZES:
        n = size // 4
        x = torch.full((n,), float(rank + 1), device=device)
        for _ in range(3):
            y = x.clone()
            dist.all_reduce(y)
        ok = bool(torch.all(y == world * (world + 1) / 2).item())
        part = torch.full((n // world,), float(rank), device=device)
        out = torch.empty(n // world * world, device=device)
        for _ in range(3):
            dist.all_gather_into_tensor(out, part)
        ok = ok and bool(out[-1].item() == world - 1)
        if not ok:
            print(f"rank {rank}: wrong result at {size} B", file=sys.stderr)
            return 1
    if backend == "nccl":
        torch.cuda.synchronize()
    dist.destroy_process_group()
    print(f"rank {rank}/{world} host {os.environ.get('NCCL_HOSTID', '-')}: all_reduce and all_gather correct at "
          f"{len(SIZES)} sizes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
