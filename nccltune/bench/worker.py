"""All-reduce benchmark worker: one process per rank, torch.distributed, JSON lines on stdout.

This file is executed by path with the interpreter configured as `bench.python`, which may be
a cluster's own training environment without nccltune installed: it imports only the standard
library and torch, and is the only module of nccltune that imports torch.

Per message size it runs warm-up and timed iterations of a float32 sum all-reduce, times them
(CUDA events on GPUs, the host clock on CPU), and reports time, algbw and busbw with
nccl-tests' formulas (busbw = algbw * 2(n-1)/n, time averaged over ranks), then checks the
result of a fresh all-reduce element by element. torch.distributed's all_reduce is in place, so
the numbers compare with nccl-tests' in-place column.

Rank 0 prints: {"event": "start", ...}, one {"event": "size", ...} per size, {"event": "done"}.
Exit status: 0 ok, 3 wrong result, 4 setup error; anything else is a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

EXIT_WRONG_RESULT = 3
EXIT_SETUP = 4
# Fault injection for the runner's tests: NCCLTUNE_WORKER_FAULT=hang|crash|garbage|wrong_sum,
# optionally "@rank" to hit one rank only. Unset in real use.
FAULT_VAR = "NCCLTUNE_WORKER_FAULT"


def emit(doc: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def _significant(x: float) -> float:
    """Six significant digits. A fixed number of decimals would quantise small bandwidths (gloo
    moves 4 KiB at a few MB/s, 0.003 GB/s at 3 decimals, a 30% step) into fake noise and gains."""
    return float(f"{x:.6g}")


def fault_for(rank: int) -> str | None:
    spec = os.environ.get(FAULT_VAR, "")
    if not spec:
        return None
    kind, _, who = spec.partition("@")
    if who and int(who) != rank:
        return None
    return kind


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--no-prequeue", action="store_true",
                    help="do not hold the GPU while the host enqueues the timed iterations")
    args = ap.parse_args(argv)

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    fault = fault_for(rank)
    if fault == "crash":
        os.abort()
    if fault == "garbage" and rank == 0:
        sys.stdout.write("this is not json\n{\"event\": \n")
        sys.stdout.flush()

    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        emit({"event": "error", "rank": rank, "kind": "no_torch", "message": str(exc)})
        return EXIT_SETUP

    sizes = [int(s) for s in args.sizes.split(",") if s]
    gpu = args.backend == "nccl"
    if gpu:
        if not torch.cuda.is_available():
            emit({"event": "error", "rank": rank, "kind": "no_cuda", "message": "torch sees no CUDA device"})
            return EXIT_SETUP
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    init_kwargs = {"backend": args.backend, "rank": rank, "world_size": world,
                   "timeout": timedelta(seconds=args.timeout_s)}
    if gpu:
        # Eager communicator creation: NCCL's init (and its log) happens here, not at the first op.
        init_kwargs["device_id"] = device
    try:
        dist.init_process_group(**init_kwargs)
    except TypeError:  # torch without device_id
        init_kwargs.pop("device_id", None)
        dist.init_process_group(**init_kwargs)

    nccl_version = None
    if gpu:
        try:
            v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            nccl_version = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:  # best effort, reported as unknown
            nccl_version = None
    if rank == 0:
        emit({
            "event": "start", "backend": args.backend, "world_size": world,
            "torch_version": torch.__version__, "nccl_version": nccl_version,
            "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "placement": "in-place", "dtype": "float32", "op": "sum", "pid": os.getpid(),
            "timing": "cuda-events, prequeued" if (gpu and not args.no_prequeue) else
                      ("cuda-events" if gpu else "host clock"),
        })

    if gpu:
        free, _total = torch.cuda.mem_get_info(device)
        limit = free // 3  # buffer plus NCCL's own and headroom
    else:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    factor = 2.0 * (world - 1) / world
    prequeue = gpu and not args.no_prequeue and hasattr(torch.cuda, "_sleep")
    # Generous host time per enqueued all-reduce (python, c10d, NCCL and its INFO log), in GPU
    # cycles at about 2 GHz; a too long sleep only costs idle time before the timed window.
    sleep_cycles = (args.iters * 150e-6 + 1e-3) * 2.0e9
    status = 0
    for size in sizes:
        count = max(size // 4, 1)
        nbytes = count * 4
        if nbytes > limit:
            if rank == 0:
                emit({"event": "skip", "size_bytes": nbytes, "reason": f"needs more than {limit} bytes free"})
            continue
        buf = torch.ones(count, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        if fault == "hang":
            time.sleep(3600)
        if gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        if gpu:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            if prequeue:
                # Keep the GPU busy while the host enqueues every timed all-reduce, so that the time
                # measured is NCCL's on the GPU and not Python's launch overhead (at 4 MiB a torch
                # all_reduce call costs about as much host time as the GPU needs for it).
                torch.cuda._sleep(int(sleep_cycles))  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(args.iters):
                dist.all_reduce(buf)
            end.record()
            end.synchronize()
            elapsed_us = start.elapsed_time(end) * 1000.0 / args.iters
        else:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(buf)
            elapsed_us = (time.perf_counter() - t0) * 1e6 / args.iters
        timing = torch.tensor([elapsed_us], dtype=torch.float64, device=device)
        dist.all_reduce(timing)
        time_us = float(timing.item()) / world

        correct = True
        if not args.no_check:
            # Small integers keep the float32 sum exact, so any difference is a real error.
            pattern = torch.arange(count, dtype=torch.float32, device=device).remainder_(7)
            data = pattern + float(rank + 1)
            dist.all_reduce(data)
            expected = pattern * world + world * (world + 1) / 2.0
            if fault == "wrong_sum":
                data[0] += 1.0
            bad = int((data != expected).sum().item())
            flag = torch.tensor([bad], dtype=torch.int64, device=device)
            dist.all_reduce(flag)
            correct = int(flag.item()) == 0
            del data, pattern, expected
        del buf
        if rank == 0:
            algbw = nbytes / (time_us * 1e-6) / 1e9
            emit({"event": "size", "size_bytes": nbytes, "count": count, "time_us": round(time_us, 3),
                  "algbw_gbps": _significant(algbw), "busbw_gbps": _significant(algbw * factor),
                  "correct": correct, "iters": args.iters, "warmup": args.warmup})
        if not correct:
            status = EXIT_WRONG_RESULT
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        emit({"event": "done", "status": status})
    return status


if __name__ == "__main__":
    sys.exit(main())
