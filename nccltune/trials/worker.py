"""All-reduce benchmark worker: one process per rank, torch.distributed, JSON lines on stdout.

This file is executed by path with the interpreter configured as `bench.python`, which may be
a cluster's own training environment without nccltune installed: it imports only the standard
library and torch, and is the only module of nccltune that imports torch.

Per message size it runs warm-up and timed iterations of a float32 sum all-reduce and reports
time, algbw and busbw with nccl-tests' formulas (busbw = algbw * 2(n-1)/n, time averaged over
ranks), then checks the result of a fresh all-reduce element by element.

Two ways of timing on GPUs (`--timing`):
- direct (the default where possible): ncclAllReduce called through ctypes on torch's own NCCL
  communicator, out of place, timed like nccl-tests' all_reduce_perf: host clock from the first
  launch to the stream's completion, divided by the iterations. A C call costs a few
  microseconds of host time, so the loop is bound by the GPU as in nccl-tests, and the numbers
  are comparable with its out-of-place column. CUDA-event time is reported beside it.
- events: torch.distributed's all_reduce (in place), CUDA events around the timed iterations,
  with the GPU held by a sleep kernel while Python enqueues them (a torch all_reduce call costs
  about as much host time as the GPU needs for 4 MiB). Used when the direct way is unavailable
  (NCCL linked statically into torch, or no communicator handle in this torch).
On CPU (gloo) the host clock times torch's in-place all_reduce.

Rank 0 prints: {"event": "start", ...}, one {"event": "size", ...} per size, {"event": "done"}.
Exit status: 0 ok, 3 wrong result, 4 setup error; anything else is a crash.
`worker.py --probe` (no ranks, no communicator) prints one {"event": "probe", ...} line with
torch's and NCCL's versions and the NCCL library this interpreter loads, found by the same
memory-map rule the direct path uses: what the sweep and the daemon know of the worker's NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

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


_NCCL_FLOAT32 = 7  # ncclDataType_t
_NCCL_SUM = 0  # ncclRedOp_t
_NCCL_IN_PROGRESS = 7  # ncclResult_t of a non-blocking communicator


# A size gets more timed blocks only while they are cheap: the blocks of one size together move
# at most this many bytes per rank, so small (noisy, launch-bound) sizes get the repeats and
# 1 GiB gets one block.
BLOCK_BUDGET_BYTES = 4 << 30


def block_count(nbytes: int, iters: int, max_blocks: int) -> int:
    """Timed blocks for a size; the same on every rank, since it depends only on the arguments."""
    return max(1, min(max_blocks, BLOCK_BUDGET_BYTES // max(1, nbytes * iters)))


def loaded_nccl_path(maps_text: str) -> str | None:
    """The NCCL shared library this process has mapped (from /proc/self/maps), if any."""
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libnccl.so"):
            return fields[5].strip()
    return None


def read_maps() -> str:
    with open("/proc/self/maps") as fh:
        return fh.read()


def probe_record(maps: Callable[[], str] = read_maps) -> dict[str, object]:
    """`--probe`: torch's and NCCL's versions and the NCCL library this process has loaded, found
    by loaded_nccl_path in its memory map (`maps`), the rule the direct calls use."""
    info: dict[str, object] = {"event": "probe", "torch_version": None, "nccl_version": None, "nccl_lib": None}
    try:
        import torch
    except ImportError as exc:
        info["error"] = str(exc)
        return info
    info["torch_version"] = torch.__version__
    try:
        v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        info["nccl_version"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # a CPU-only torch has no NCCL: reported as unknown
        pass
    # Read after NCCL was asked its version, so that a lazily loaded library is mapped by then.
    with contextlib.suppress(OSError):
        info["nccl_lib"] = loaded_nccl_path(maps())
    return info


def version_code(text: str) -> int:
    """'2.28.9' -> 22809, NCCL's own integer version code."""
    major, minor, patch = (int(x) for x in text.split(".")[:3])
    return major * 10000 + minor * 100 + patch


class DirectNccl:
    """ncclAllReduce through ctypes on the communicator torch created, in torch's loaded NCCL."""

    def __init__(self, lib: ctypes.CDLL, comm: int) -> None:
        self.lib = lib
        self.comm = ctypes.c_void_p(comm)
        lib.ncclAllReduce.restype = ctypes.c_int
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclCommGetAsyncError.restype = ctypes.c_int
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]

    @classmethod
    def attach(cls, dist: Any, device: Any, torch_nccl_version: str | None) -> tuple[DirectNccl | None, str]:
        """The direct path, or None and why not."""
        try:
            with open("/proc/self/maps") as fh:
                path = loaded_nccl_path(fh.read())
        except OSError as exc:
            return None, f"cannot read /proc/self/maps: {exc}"
        if path is None:
            return None, "NCCL is not loaded as a shared library (linked into torch?)"
        try:
            lib = ctypes.CDLL(path)
            got = ctypes.c_int(0)
            lib.ncclGetVersion(ctypes.byref(got))
        except (OSError, AttributeError) as exc:
            return None, f"cannot call into {path}: {exc}"
        if torch_nccl_version and got.value != version_code(torch_nccl_version):
            return None, f"{path} is NCCL {got.value}, torch reports {torch_nccl_version}"
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(device)
            comm = int(backend._comm_ptr())
        except Exception as exc:  # private API: absent or renamed in some torch versions
            return None, f"no communicator handle from torch ({type(exc).__name__}: {exc})"
        if not comm:
            return None, "torch has not created its communicator"
        return cls(lib, comm), path

    def all_reduce(self, send: Any, recv: Any, stream: int) -> None:
        rc = self.lib.ncclAllReduce(ctypes.c_void_p(send.data_ptr()), ctypes.c_void_p(recv.data_ptr()), send.numel(),
                                    _NCCL_FLOAT32, _NCCL_SUM, self.comm, ctypes.c_void_p(stream))
        if rc == _NCCL_IN_PROGRESS:
            state = ctypes.c_int(_NCCL_IN_PROGRESS)
            while state.value == _NCCL_IN_PROGRESS:
                self.lib.ncclCommGetAsyncError(self.comm, ctypes.byref(state))
            rc = state.value
        if rc != 0:
            raise RuntimeError(f"ncclAllReduce: {self.lib.ncclGetErrorString(rc).decode(errors='replace')}")


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--probe"]:
        emit(probe_record())
        return 0
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--timing", choices=("auto", "direct", "events"), default="auto",
                    help="GPU timing: direct NCCL calls (auto: when possible) or torch with CUDA events")
    ap.add_argument("--max-blocks", type=int, default=1,
                    help="time up to this many blocks of --iters per size and report the median block "
                         "(fewer for large sizes, see block_count)")
    ap.add_argument("--no-prequeue", action="store_true",
                    help="events timing: do not hold the GPU while the host enqueues the timed iterations")
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
    direct: DirectNccl | None = None
    direct_note = ""
    if gpu:
        try:
            v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            nccl_version = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:  # best effort, reported as unknown
            nccl_version = None
        if args.timing != "events":
            dist.barrier()  # a first collective: the communicator exists even where init is lazy
            direct, direct_note = DirectNccl.attach(dist, device, nccl_version)
            # Every rank must take the same path, or they would wait on different collectives.
            agree = torch.tensor([0 if direct is None else 1], dtype=torch.int32, device=device)
            dist.all_reduce(agree, op=dist.ReduceOp.MIN)
            if int(agree.item()) == 0:
                if direct is not None:
                    direct_note = "another rank cannot call NCCL directly"
                direct = None
            if direct is None and args.timing == "direct":
                emit({"event": "error", "rank": rank, "kind": "no_direct_nccl", "message": direct_note})
                return EXIT_SETUP
    prequeue = gpu and direct is None and not args.no_prequeue and hasattr(torch.cuda, "_sleep")
    if direct is not None:
        timing, placement = "host clock, direct NCCL calls (as nccl-tests)", "out-of-place"
    elif gpu:
        timing, placement = ("cuda-events, prequeued" if prequeue else "cuda-events"), "in-place"
    else:
        timing, placement = "host clock", "in-place"
    if rank == 0:
        emit({
            "event": "start", "backend": args.backend, "world_size": world,
            "torch_version": torch.__version__, "nccl_version": nccl_version,
            "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "placement": placement, "dtype": "float32", "op": "sum", "pid": os.getpid(), "timing": timing,
            **({"direct_nccl": direct_note} if gpu and args.timing != "events" else {}),
        })

    if gpu:
        free, _total = torch.cuda.mem_get_info(device)
        limit = free // 4  # send and receive buffers plus NCCL's own and headroom
    else:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    factor = 2.0 * (world - 1) / world
    stream = None
    if direct is not None:
        # A stream of its own, as nccl-tests creates: the legacy default stream would serialise
        # with every other blocking stream on the device.
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        torch.cuda.set_stream(stream)
    # Generous host time per enqueued all-reduce (python, c10d, NCCL and its INFO log), in GPU
    # cycles at about 2 GHz; a too long sleep only costs idle time before the timed window.
    sleep_cycles = (args.iters * 150e-6 + 1e-3) * 2.0e9

    def timed_block(send: Any, recv: Any) -> tuple[float, float]:
        """Time per all-reduce over one block of iterations: (reported, GPU-event) microseconds."""
        if not gpu:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                one_all_reduce(send, recv)
            host_us = (time.perf_counter() - t0) * 1e6 / args.iters
            return host_us, host_us
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        if prequeue:
            torch.cuda._sleep(int(sleep_cycles))  # type: ignore[no-untyped-call]
        start.record()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            one_all_reduce(send, recv)
        end.record()
        end.synchronize()
        host_us = (time.perf_counter() - t0) * 1e6 / args.iters
        gpu_us = start.elapsed_time(end) * 1000.0 / args.iters
        return (host_us if direct is not None else gpu_us), gpu_us

    def one_all_reduce(src: Any, dst: Any) -> None:
        """Out of place through NCCL directly, else torch's in-place all_reduce of dst."""
        if direct is not None:
            assert stream is not None
            direct.all_reduce(src, dst, stream.cuda_stream)
        else:
            dist.all_reduce(dst)

    status = 0
    for size in sizes:
        count = max(size // 4, 1)
        nbytes = count * 4
        if nbytes > limit:
            if rank == 0:
                emit({"event": "skip", "size_bytes": nbytes, "reason": f"needs more than {limit} bytes free"})
            continue
        send = torch.ones(count, dtype=torch.float32, device=device)
        recv = torch.empty_like(send) if direct is not None else send
        for _ in range(args.warmup):
            one_all_reduce(send, recv)
        if fault == "hang":
            time.sleep(3600)
        if gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        if gpu:
            torch.cuda.synchronize(device)
        blocks = block_count(nbytes, args.iters, args.max_blocks)
        per_block: list[float] = []
        for _ in range(blocks):
            per_block.extend(timed_block(send, recv))
        timing_t = torch.tensor(per_block, dtype=torch.float64, device=device)
        dist.all_reduce(timing_t)
        averaged = [float(x) / world for x in timing_t.tolist()]  # nccl-tests averages over ranks
        block_us, block_gpu_us = averaged[0::2], averaged[1::2]
        time_us, gpu_time_us = statistics.median(block_us), statistics.median(block_gpu_us)

        correct = True
        if not args.no_check:
            # Small integers keep the float32 sum exact, so any difference is a real error.
            pattern = torch.arange(count, dtype=torch.float32, device=device).remainder_(7)
            data = pattern + float(rank + 1)
            out = torch.zeros_like(data) if direct is not None else data
            one_all_reduce(data, out)
            expected = pattern * world + world * (world + 1) / 2.0
            if fault == "wrong_sum":
                out[0] += 1.0
            bad = int((out != expected).sum().item())
            flag = torch.tensor([bad], dtype=torch.int64, device=device)
            dist.all_reduce(flag)
            correct = int(flag.item()) == 0
            del data, out, pattern, expected
        del send, recv
        if rank == 0:
            algbw = nbytes / (time_us * 1e-6) / 1e9
            record: dict[str, object] = {
                "event": "size", "size_bytes": nbytes, "count": count, "time_us": round(time_us, 3),
                "algbw_gbps": _significant(algbw), "busbw_gbps": _significant(algbw * factor),
                "correct": correct, "iters": args.iters, "warmup": args.warmup, "blocks": blocks}
            if blocks > 1:
                record["block_busbw_gbps"] = [_significant(nbytes / (us * 1e3) * factor) for us in block_us]
            if gpu:
                record["gpu_time_us"] = round(gpu_time_us, 3)
            emit(record)
        if not correct:
            status = EXIT_WRONG_RESULT
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        emit({"event": "done", "status": status})
    return status


if __name__ == "__main__":
    sys.exit(main())
