"""All-reduce measured the way nccl-tests' all_reduce_perf -g N does it, for nodes without nccl-tests.

    NCCL_NVLS_ENABLE=0 python bench/inproc_allreduce.py --repeats 5 --json out.json

One process drives every visible GPU (ncclCommInitAll), each iteration is one NCCL group with an
ncclAllReduce per GPU on its own stream, and the time is the host clock from the first launch to
the completion of every stream, divided by the iterations; out of place, then in place, float32
sum, 5 warm-up and 20 timed iterations per size as all_reduce_perf's defaults. NCCL is the library
torch loaded, called through ctypes. This is a stand-in measured in the same run as the worker,
not nccl-tests itself: it shares nccl-tests' process layout and timer, not its code.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccltune.trials.worker import DirectNccl, loaded_nccl_path


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        raise SystemExit(f"{what}: {lib.ncclGetErrorString(rc).decode()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(str(65536 * 4**i) for i in range(8)))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()

    import torch

    ngpus = torch.cuda.device_count()
    if ngpus < 2:
        print("needs at least 2 visible GPUs", file=sys.stderr)
        return 1
    for g in range(ngpus):
        torch.zeros(1, device=f"cuda:{g}")  # a context on every GPU before NCCL's init
    path = loaded_nccl_path(Path("/proc/self/maps").read_text())
    if path is None:
        print("torch did not load NCCL as a shared library", file=sys.stderr)
        return 1
    lib = ctypes.CDLL(path)
    version = ctypes.c_int()
    lib.ncclGetVersion(ctypes.byref(version))
    comms = (ctypes.c_void_p * ngpus)()
    devs = (ctypes.c_int * ngpus)(*range(ngpus))
    check(lib, lib.ncclCommInitAll(comms, ngpus, devs), "ncclCommInitAll")
    ranks = [DirectNccl(lib, int(comms[g] or 0)) for g in range(ngpus)]  # the worker's own call per GPU
    streams = [torch.cuda.Stream(device=g) for g in range(ngpus)]  # type: ignore[no-untyped-call]
    factor = 2.0 * (ngpus - 1) / ngpus

    def launch(send: list[Any], recv: list[Any]) -> None:
        check(lib, lib.ncclGroupStart(), "ncclGroupStart")
        for g in range(ngpus):
            ranks[g].all_reduce(send[g], recv[g], streams[g].cuda_stream)
        check(lib, lib.ncclGroupEnd(), "ncclGroupEnd")

    def sync() -> None:
        for st in streams:
            st.synchronize()

    results: dict[str, dict[int, list[float]]] = {"out": {}, "in": {}}
    sizes = [int(s) for s in args.sizes.split(",")]
    for _ in range(args.repeats):
        for size in sizes:
            count = size // 4
            send = [torch.ones(count, dtype=torch.float32, device=f"cuda:{g}") for g in range(ngpus)]
            recv = [torch.empty_like(t) for t in send]
            for placement, dst in (("out", recv), ("in", send)):
                for _w in range(args.warmup):
                    launch(send, dst)
                sync()
                t0 = time.perf_counter()
                for _i in range(args.iters):
                    launch(send, dst)
                sync()
                us = (time.perf_counter() - t0) * 1e6 / args.iters
                results[placement].setdefault(size, []).append(size / us * 1e-3 * factor)
            del send, recv
    med = {p: {s: statistics.median(v) for s, v in r.items()} for p, r in results.items()}
    print(f"in-process all-reduce, {ngpus} GPUs, NCCL {version.value} ({path}), medians of {args.repeats}")
    print(f"{'size':>12} {'out busbw':>10} {'in busbw':>10}")
    for s in sizes:
        print(f"{s:>12} {med['out'][s]:>10.2f} {med['in'][s]:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"nccl_version": version.value, "runs": results, "medians": med},
                                              indent=1))
    for g in range(ngpus):
        lib.ncclCommDestroy(comms[g])
    return 0


if __name__ == "__main__":
    sys.exit(main())
