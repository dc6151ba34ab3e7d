"""Collective benchmark worker: one process per rank, torch.distributed, JSON lines on stdout.

This file is executed by path with the interpreter configured as `bench.python`, which may be
a cluster's own training environment without nccltune installed, or loaded by path by the rank
server (rankserver.py), which forks ranks that call `main`: it imports only the standard library,
torch and nccltune/collectives.py (stdlib only, loaded by path from this file's package). It and
the rank server are the only modules of nccltune that import torch.

For each requested collective (`--collectives`, default all_reduce) and message size it runs
warm-up and timed iterations and reports time, algbw and busbw with nccl-tests' definitions of
size and bus bandwidth (see collectives.py; time averaged over ranks), then checks the result of
a fresh call element by element, with data that tells every rank's elements and offsets apart.
All data is float32; reductions sum; broadcast and reduce use root 0.

Ways of timing on GPUs (`--timing`):
- graph (the default where it works): the timed iterations of direct NCCL calls (below) are
  captured into one CUDA graph and the graph is replayed, as nccl-tests' -G does: host clock from
  the replay to the stream's completion, divided by the iterations. Python then costs one launch
  per block instead of one per call, which matters for small messages. If capture fails on any
  rank, every rank times direct calls instead.
- direct: NCCL called through ctypes on torch's own NCCL communicator, out of place, timed like
  nccl-tests: host clock from the first launch to the stream's completion, divided by the
  iterations. A C call costs a few microseconds of host time, so the loop is bound by the GPU
  for large messages. CUDA-event time is reported beside it.
- events: torch.distributed's calls, CUDA events around the timed iterations, with the GPU held by
  a sleep kernel while Python enqueues them. Used when the direct way is unavailable (NCCL linked
  statically into torch, or no communicator handle in this torch).
On CPU (gloo) the host clock times torch's calls; a collective that this torch's gloo backend
lacks is reported as not measured, with the reason.

Rank 0 prints: {"event": "start", ...}, per collective one {"event": "size", "collective": ...}
per size (or one {"event": "not_measured", "collective": ..., "reason": ...}), {"event": "done"}.
Exit status: 0 ok, 3 wrong result, 4 setup error; anything else is a crash.
`worker.py --probe` (no ranks, no communicator) prints one {"event": "probe", ...} line with
torch's and NCCL's versions and the NCCL library this interpreter loads, found by the same
memory-map rule the direct path uses: what the sweep and the daemon know of the worker's NCCL.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import functools
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn


def _load_collectives() -> ModuleType:
    """nccltune/collectives.py by path: run as a script, this file has no package to import from,
    and putting nccltune's parent directory on sys.path could shadow the node's own packages."""
    path = Path(__file__).resolve().parent.parent / "collectives.py"
    spec = importlib.util.spec_from_file_location("_nccltune_collectives", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING or __package__:
    from .. import collectives as coll
else:
    coll = _load_collectives()

EXIT_WRONG_RESULT = 3
EXIT_SETUP = 4
# Fault injection for the runner's tests: NCCLTUNE_WORKER_FAULT=hang|crash|garbage|wrong_sum (the
# checked result of every collective off by one), optionally "@rank" to hit one rank only, and
# ":NAME=VALUE" to hit only the trials whose environment has that value (one candidate; set on
# one node, one trial of one node). Unset in real use.
FAULT_VAR = "NCCLTUNE_WORKER_FAULT"


def emit(doc: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def _significant(x: float) -> float:
    """Six significant digits. A fixed number of decimals would quantise small bandwidths (gloo
    moves 4 KiB at a few MB/s, 0.003 GB/s at 3 decimals, a 30% step) into fake noise and gains."""
    return float(f"{x:.6g}")


def fault_for(rank: int) -> str | None:
    spec, _, condition = os.environ.get(FAULT_VAR, "").partition(":")
    if not spec:
        return None
    kind, _, who = spec.partition("@")
    if who and int(who) != rank:
        return None
    name, _, value = condition.partition("=")
    if condition and os.environ.get(name) != value:
        return None
    return kind


_NCCL_FLOAT32 = 7  # ncclDataType_t
_NCCL_SUM = 0  # ncclRedOp_t
_NCCL_IN_PROGRESS = 7  # ncclResult_t of a non-blocking communicator
ROOT = 0  # of broadcast and reduce


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


def os_name(path: str = "/etc/os-release") -> str | None:
    """The distribution this process runs on (PRETTY_NAME): the job's image's, in a container."""
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    return None


def probe_record(maps: Callable[[], str] = read_maps) -> dict[str, object]:
    """`--probe`: torch's and NCCL's versions and the NCCL library this process has loaded, found
    by loaded_nccl_path in its memory map (`maps`), the rule the direct calls use."""
    info: dict[str, object] = {"event": "probe", "torch_version": None, "nccl_version": None, "nccl_lib": None,
                               "python": platform.python_version(), "os": os_name()}
    try:
        import torch
    except ImportError as exc:
        info["error"] = str(exc)
        return info
    info["torch_version"] = torch.__version__
    info["nccl_version"] = torch_nccl_version(torch)  # None from a CPU-only torch: unknown
    # Read after NCCL was asked its version, so that a lazily loaded library is mapped by then.
    with contextlib.suppress(OSError):
        info["nccl_lib"] = loaded_nccl_path(maps())
    return info


def version_code(text: str) -> int:
    """'2.28.9' -> 22809, NCCL's own integer version code."""
    major, minor, patch = (int(x) for x in text.split(".")[:3])
    return major * 10000 + minor * 100 + patch


def timing_mode(requested: str, gpu: bool, direct_ok: bool, graph_ok: bool) -> str | None:
    """The timing the ranks use: 'host' (CPU), 'graph', 'direct' or 'events'; None when the
    requested one is unavailable. Every rank calls it with the same, agreed, arguments.

    `direct_ok`: every rank can call NCCL directly; `graph_ok`: every rank captured direct calls
    into a CUDA graph (only tried where direct_ok and graph timing is wanted).
    """
    if not gpu:
        return "host"
    if requested == "events":
        return "events"
    if not direct_ok:
        return "events" if requested == "auto" else None
    if requested == "direct":
        return "direct"
    if graph_ok:
        return "graph"
    return "direct" if requested == "auto" else None


def graph_wanted(requested: str) -> bool:
    """Whether graph capture is tried at all for this --timing."""
    return requested in ("auto", "graph")


class DirectNccl:
    """NCCL's calls through ctypes on the communicator torch created, in torch's loaded NCCL.

    Argument types are set once here; the timed loop passes plain integers (pointers, counts,
    the stream handle), so a call costs ctypes' conversion and NCCL's enqueue and nothing else.
    """

    def __init__(self, lib: ctypes.CDLL, comm: int, rank: int = 0, nranks: int = 1) -> None:
        self.lib = lib
        self.comm = comm
        self.rank, self.nranks = rank, nranks
        vp, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        signatures: dict[str, list[Any]] = {
            "ncclAllReduce": [vp, vp, size, i32, i32, vp, vp],
            "ncclAllGather": [vp, vp, size, i32, vp, vp],
            "ncclReduceScatter": [vp, vp, size, i32, i32, vp, vp],
            "ncclBroadcast": [vp, vp, size, i32, i32, vp, vp],
            "ncclReduce": [vp, vp, size, i32, i32, i32, vp, vp],
            "ncclAlltoAll": [vp, vp, size, i32, vp, vp],  # NCCL 2.28 and later
            "ncclSend": [vp, size, i32, i32, vp, vp],
            "ncclRecv": [vp, size, i32, i32, vp, vp],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
        }
        self.fn: dict[str, Any] = {}
        for name, argtypes in signatures.items():
            fn = getattr(lib, name, None)  # a CDLL raises AttributeError for a symbol it lacks
            if fn is None:
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
            self.fn[name] = fn
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclCommGetAsyncError.restype = ctypes.c_int
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]

    @property
    def all_to_all_call(self) -> str:
        """How all_to_all is called: NCCL's own call where the library has it, else grouped p2p."""
        return "ncclAlltoAll" if "ncclAlltoAll" in self.fn else "grouped ncclSend/ncclRecv"

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
        return cls(lib, comm, dist.get_rank(), dist.get_world_size()), path

    def _check(self, rc: int, what: str) -> None:
        if rc == _NCCL_IN_PROGRESS:
            state = ctypes.c_int(_NCCL_IN_PROGRESS)
            while state.value == _NCCL_IN_PROGRESS:
                self.lib.ncclCommGetAsyncError(self.comm, ctypes.byref(state))
            rc = state.value
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.ncclGetErrorString(rc).decode(errors='replace')}")

    def call(self, name: str, send: int, recv: int, count: int, stream: int) -> None:
        """One collective, out of place: `send`/`recv` device addresses, `count` the NCCL call's
        count argument (collectives.Collective.counts), float32, sum, root 0."""
        fn, comm = self.fn, self.comm
        if name == "all_reduce":
            self._check(fn["ncclAllReduce"](send, recv, count, _NCCL_FLOAT32, _NCCL_SUM, comm, stream), "ncclAllReduce")
        elif name == "all_gather":
            self._check(fn["ncclAllGather"](send, recv, count, _NCCL_FLOAT32, comm, stream), "ncclAllGather")
        elif name == "reduce_scatter":
            self._check(fn["ncclReduceScatter"](send, recv, count, _NCCL_FLOAT32, _NCCL_SUM, comm, stream),
                        "ncclReduceScatter")
        elif name == "broadcast":
            self._check(fn["ncclBroadcast"](send, recv, count, _NCCL_FLOAT32, ROOT, comm, stream), "ncclBroadcast")
        elif name == "reduce":
            self._check(fn["ncclReduce"](send, recv, count, _NCCL_FLOAT32, _NCCL_SUM, ROOT, comm, stream),
                        "ncclReduce")
        elif name == "all_to_all" and "ncclAlltoAll" in fn:
            self._check(fn["ncclAlltoAll"](send, recv, count, _NCCL_FLOAT32, comm, stream), "ncclAlltoAll")
        elif name == "all_to_all":
            block_bytes = count * coll.ELEMENT_BYTES
            self._group([(peer, send + peer * block_bytes, recv + peer * block_bytes) for peer in range(self.nranks)],
                        count, stream)
        elif name == "sendrecv":
            # The ring step: to rank+1, from rank-1 (with one rank, to and from itself).
            self._group([((self.rank + 1) % self.nranks, send, 0), ((self.rank - 1) % self.nranks, 0, recv)],
                        count, stream)
        else:
            raise ValueError(f"unknown collective {name!r}")

    def _group(self, peers: list[tuple[int, int, int]], count: int, stream: int) -> None:
        """(peer, send address or 0, receive address or 0) pairs as one NCCL group."""
        fn, comm = self.fn, self.comm
        self._check(fn["ncclGroupStart"](), "ncclGroupStart")
        for peer, send, recv in peers:
            if send:
                self._check(fn["ncclSend"](send, count, _NCCL_FLOAT32, peer, comm, stream), "ncclSend")
            if recv:
                self._check(fn["ncclRecv"](recv, count, _NCCL_FLOAT32, peer, comm, stream), "ncclRecv")
        self._check(fn["ncclGroupEnd"](), "ncclGroupEnd")

    def all_reduce(self, send: Any, recv: Any, stream: int) -> None:
        """ncclAllReduce of two tensors (float32 sum), out of place."""
        self.call("all_reduce", send.data_ptr(), recv.data_ptr(), send.numel(), stream)


# Pattern values: f(rank, i) = i % 251 + 256 (rank + 1), small integers whose float32 sums are
# exact, so a wrong element shows the rank (multiples of 256) or the offset (the low part) it
# came from; -1 (never a pattern value) marks receive buffers before the checked call.
_PATTERN_MOD = 251
_PATTERN_RANK = 256


def pattern(torch: Any, rank: Any, index: Any) -> Any:
    """f(rank, index) as float32; rank may be a tensor of the same shape as index (int32)."""
    return (index % _PATTERN_MOD + _PATTERN_RANK * (rank + 1)).to(torch.float32)


def expected_output(torch: Any, name: str, rank: int, world: int, count: int, recv_n: int, device: Any) -> Any:
    """What the receive buffer must hold after the collective, given every rank sent
    pattern(rank, arange(send elements)); None where nothing is defined (reduce off the root)."""
    def summed(index: Any) -> Any:  # the sum of pattern(q, index) over all ranks q
        return (index % _PATTERN_MOD * world + _PATTERN_RANK * world * (world + 1) // 2).to(torch.float32)

    index = torch.arange(recv_n, dtype=torch.int32, device=device)
    if name == "all_reduce":
        return summed(index)
    if name == "all_gather":  # block k comes from rank k, its elements 0..count-1
        return pattern(torch, index // count, index % count)
    if name == "reduce_scatter":  # this rank's block of the summed array
        return summed(index + rank * count)
    if name == "all_to_all":  # block q comes from rank q, which sent this rank's block of its array
        return pattern(torch, index // count, index % count + rank * count)
    if name == "broadcast":
        return pattern(torch, ROOT, index)
    if name == "reduce":
        return summed(index) if rank == ROOT else None
    if name == "sendrecv":
        return pattern(torch, (rank - 1) % world, index)
    raise ValueError(f"unknown collective {name!r}")


# torch.distributed's calls that change their buffer in place (torch has no out-of-place form).
TORCH_IN_PLACE = frozenset({"all_reduce", "broadcast", "reduce"})


def torch_call(dist: Any, name: str, send: Any, recv: Any, rank: int, world: int) -> None:
    """The collective through torch.distributed (gloo, or NCCL when direct calls are unavailable).
    For TORCH_IN_PLACE collectives `recv` is the buffer operated on and `send` is not read."""
    if name == "all_reduce":
        dist.all_reduce(recv)
    elif name == "broadcast":
        dist.broadcast(recv, src=ROOT)
    elif name == "reduce":
        dist.reduce(recv, dst=ROOT)
    elif name == "all_gather":
        dist.all_gather_into_tensor(recv, send)
    elif name == "reduce_scatter":
        dist.reduce_scatter_tensor(recv, send)
    elif name == "all_to_all":
        dist.all_to_all_single(recv, send)
    elif name == "sendrecv":
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    else:
        raise ValueError(f"unknown collective {name!r}")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    ap.add_argument("--collectives", default=coll.DEFAULT,
                    help=f"comma-separated collectives to measure, of: {', '.join(coll.NAMES)}")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--timing", choices=("auto", "graph", "direct", "events"), default="auto",
                    help="GPU timing: CUDA graph of direct NCCL calls, direct NCCL calls, or torch with CUDA "
                         "events (auto: the first of these that works)")
    ap.add_argument("--max-blocks", type=int, default=1,
                    help="time up to this many blocks of --iters per size and report the median block "
                         "(fewer for large sizes, see block_count)")
    ap.add_argument("--start-warmup", type=int, default=0,
                    help="calls at each collective's largest size before its first size is timed: a process's "
                         "first calls set up NCCL's connections, helper threads and socket buffers")
    ap.add_argument("--no-prequeue", action="store_true",
                    help="events timing: do not hold the GPU while the host enqueues the timed iterations")
    return ap.parse_args(argv)


class SetupError(Exception):
    """A rank that cannot measure: the error line's kind and message; the worker exits EXIT_SETUP."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def torch_nccl_version(torch: Any) -> str | None:
    """The NCCL version torch reports, as text; None where it has none (a CPU-only torch)."""
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # best effort, reported as unknown
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


class Job:
    """This rank in the job: its process group, its device, and the way every rank agreed to call
    and time the collectives (set by `attach_nccl` and `choose_timing`)."""

    def __init__(self, torch: Any, dist: Any, args: argparse.Namespace, rank: int, world: int,
                 local_rank: int) -> None:
        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = rank, world
        self.gpu = args.backend == "nccl"
        self.device = self._device(local_rank)
        self.nccl_version: str | None = None
        self.direct: DirectNccl | None = None
        self.direct_note = ""
        self.stream: Any = None
        self.graph_note = ""
        self.graph_ok = False
        self.mode = ""
        self.prequeue = False

    def _device(self, local_rank: int) -> Any:
        torch = self.torch
        if not self.gpu:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise SetupError("no_cuda", "torch sees no CUDA device")
        # A rank bound to one GPU (srun --gpus-per-task=1: Slurm sets CUDA_VISIBLE_DEVICES per task)
        # sees only that one; otherwise every rank of the node sees them all and takes its own.
        device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else local_rank)
        torch.cuda.set_device(device)
        return device

    def init_process_group(self) -> None:
        init_kwargs = {"backend": self.args.backend, "rank": self.rank, "world_size": self.world,
                       "timeout": timedelta(seconds=self.args.timeout_s)}
        if self.gpu:
            # Eager communicator creation: NCCL's init (and its log) happens here, not at the first op.
            init_kwargs["device_id"] = self.device
        try:
            self.dist.init_process_group(**init_kwargs)
        except TypeError:  # torch without device_id
            init_kwargs.pop("device_id", None)
            self.dist.init_process_group(**init_kwargs)

    def everywhere(self, ok: bool) -> bool:
        """True when `ok` holds on every rank: ranks must take the same path, or they would wait
        on different collectives."""
        flag = self.torch.tensor([1 if ok else 0], dtype=self.torch.int32, device=self.device)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MIN)
        return int(flag.item()) == 1

    def attach_nccl(self, wanted: list[Any]) -> None:
        """On GPUs: NCCL's version, the direct calls and graph capture where every rank has them."""
        if not self.gpu:
            return
        torch, timing = self.torch, self.args.timing
        self.nccl_version = torch_nccl_version(torch)
        if timing != "events":
            self.dist.barrier()  # a first collective: the communicator exists even where init is lazy
            self.direct, self.direct_note = DirectNccl.attach(self.dist, self.device, self.nccl_version)
            if not self.everywhere(self.direct is not None):
                if self.direct is not None:
                    self.direct_note = "another rank cannot call NCCL directly"
                self.direct = None
        if self.direct is None:
            return
        # A stream of its own, as nccl-tests creates: the legacy default stream would serialise
        # with every other blocking stream on the device.
        self.stream = torch.cuda.Stream(self.device)
        torch.cuda.set_stream(self.stream)
        if graph_wanted(timing):
            self.graph_note = capture_probe(torch, self.direct, wanted, self.world, self.stream)
            if not self.everywhere(not self.graph_note) and not self.graph_note:
                self.graph_note = "another rank cannot capture NCCL calls into a CUDA graph"
            self.graph_ok = not self.graph_note

    def choose_timing(self) -> str:
        """Set the agreed timing mode; the start line's description of it."""
        direct_ok = self.direct is not None
        mode = timing_mode(self.args.timing, self.gpu, direct_ok, self.graph_ok)
        if mode is None:
            kind, why = (("no_graph", self.graph_note) if direct_ok else ("no_direct_nccl", self.direct_note))
            raise SetupError(kind, why)
        self.mode = mode
        self.prequeue = mode == "events" and not self.args.no_prequeue and hasattr(self.torch.cuda, "_sleep")
        if mode == "events":
            return "cuda-events, prequeued" if self.prequeue else "cuda-events"
        return {
            "graph": f"host clock, CUDA graph of {self.args.iters} direct NCCL calls (as nccl-tests -G)",
            "direct": "host clock, direct NCCL calls (as nccl-tests)",
            "host": "host clock",
        }.get(mode, "")

    @property
    def through_nccl(self) -> bool:
        return self.mode in ("graph", "direct")

    def start_record(self, timing: str, wanted: list[Any]) -> dict[str, object]:
        torch, args, direct = self.torch, self.args, self.direct
        return {
            "event": "start", "backend": args.backend, "world_size": self.world,
            "torch_version": torch.__version__, "nccl_version": self.nccl_version,
            "device": torch.cuda.get_device_name(self.device) if self.gpu else "cpu",
            "placement": "out-of-place" if self.through_nccl else "in-place", "dtype": "float32", "op": "sum",
            "pid": os.getpid(), "timing": timing, "collectives": [c.name for c in wanted],
            **({"direct_nccl": self.direct_note} if self.gpu and args.timing != "events" else {}),
            **({"graph_capture": self.graph_note} if self.graph_note else {}),
            **({"all_to_all_call": direct.all_to_all_call} if direct is not None else {}),
        }

    def buffer_limit(self) -> int:
        """The most bytes one buffer of a size may take."""
        if self.gpu:
            free, _total = self.torch.cuda.mem_get_info(self.device)
            return int(free // 4)  # send and receive buffers plus NCCL's own and headroom
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8

    def make_call(self, name: str, src: Any, dst: Any, count: int) -> Callable[[], None]:
        """One call of collective `name` with its arguments bound: the device addresses and the
        stream as plain integers for NCCL, else torch's call (in place for TORCH_IN_PLACE)."""
        if self.direct is not None:
            assert self.stream is not None
            return functools.partial(self.direct.call, name, src.data_ptr(), dst.data_ptr(), count,
                                     self.stream.cuda_stream)
        return functools.partial(torch_call, self.dist, name, src, dst, self.rank, self.world)

    def unsupported(self, c: Any) -> str | None:
        """Why this torch cannot run collective `c` on this backend, agreed by every rank; None
        where it can (always through NCCL's own calls)."""
        if self.through_nccl:
            return None
        reason = None if self.gpu else coll.gloo_reason(c)
        if reason is not None:
            return reason
        # This torch's backend may lack the call: it raises on every rank before any
        # communication, so one small call tells, and the ranks agree on the answer.
        torch = self.torch
        count, send_n, recv_n = c.counts(64 * self.world, self.world)
        probe_send = torch.ones(send_n, dtype=torch.float32, device=self.device)
        probe_recv = probe_send.clone() if c.name in TORCH_IN_PLACE else torch.empty(recv_n, device=self.device)
        try:
            self.make_call(c.name, probe_send, probe_recv, count)()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            reason = f"torch {torch.__version__} {self.args.backend}: {exc}".splitlines()[0]
        if not self.everywhere(reason is None):
            reason = reason or "not supported by another rank's torch"
        return reason

    def time_size(self, c: Any, count: int, send_n: int, recv_n: int, nbytes: int, in_place: bool,
                  fault: str | None) -> tuple[int, list[float], float, float]:
        """Warm-up and timed blocks of one size: (blocks, per-block microseconds, median time,
        median GPU-event time), averaged over the ranks. Its buffers are freed on return, before
        the check allocates its own."""
        torch, args, device = self.torch, self.args, self.device
        send = torch.ones(send_n, dtype=torch.float32, device=device)
        recv = send if in_place else torch.empty(recv_n, dtype=torch.float32, device=device)
        op = self.make_call(c.name, send, recv, count)
        for _ in range(args.warmup):
            op()
        if fault == "hang":
            time.sleep(3600)
        graph = None
        if self.mode == "graph":
            assert self.direct is not None and self.stream is not None
            graph = capture(torch, op, args.iters, self.stream)
            graph.replay()  # the first launch uploads the graph; not timed
        if self.gpu:
            torch.cuda.synchronize(device)
        self.dist.barrier()
        if self.gpu:
            torch.cuda.synchronize(device)
        blocks = block_count(nbytes, args.iters, args.max_blocks)
        # Generous host time per enqueued call (python, c10d, NCCL and its INFO log), in GPU cycles
        # at about 2 GHz; a too long sleep only costs idle time before the timed window.
        sleep_cycles = int((args.iters * 150e-6 + 1e-3) * 2.0e9) if self.prequeue else 0
        per_block: list[float] = []
        for _ in range(blocks):
            per_block.extend(timed_block(torch, self.gpu, self.mode, args.iters, op, graph, sleep_cycles))
        timing_t = torch.tensor(per_block, dtype=torch.float64, device=device)
        self.dist.all_reduce(timing_t)
        averaged = [float(x) / self.world for x in timing_t.tolist()]  # nccl-tests averages over ranks
        block_us, block_gpu_us = averaged[0::2], averaged[1::2]
        return blocks, block_us, statistics.median(block_us), statistics.median(block_gpu_us)

    def correct(self, name: str, count: int, send_n: int, recv_n: int, in_place: bool, fault: str | None) -> bool:
        """A fresh call on pattern data, checked element by element on every rank."""
        torch, device = self.torch, self.device
        index = torch.arange(send_n, dtype=torch.int32, device=device)
        data = pattern(torch, self.rank, index)
        out = data.clone() if in_place else torch.full((recv_n,), -1.0, dtype=torch.float32, device=device)
        self.make_call(name, data, out, count)()
        expected = expected_output(torch, name, self.rank, self.world, count, recv_n, device)
        if fault == "wrong_sum":
            out[0] += 1.0
        bad = 0 if expected is None else int((out != expected).sum().item())
        flag = torch.tensor([bad], dtype=torch.int64, device=device)
        self.dist.all_reduce(flag)
        return int(flag.item()) == 0

    def warm_start(self, c: Any, sizes: list[int], limit: int) -> None:
        """--start-warmup calls of collective `c` at the largest of `sizes` that fits, untimed: what a
        process sets up on its first calls (connections, NCCL's helper threads, socket buffers) is
        then not charged to the smallest sizes, which are timed first."""
        # The largest size whose buffers fit on every rank (free memory differs between ranks that
        # share a GPU): the ranks must make the same calls, or they would wait on each other.
        size = next((s for s in sorted(sizes, reverse=True) if self.args.start_warmup > 0
                     and self.everywhere(max(c.counts(s, self.world)[1:]) * coll.ELEMENT_BYTES <= limit)), None)
        if size is None:
            return
        count, send_n, recv_n = c.counts(size, self.world)
        send = self.torch.ones(send_n, dtype=self.torch.float32, device=self.device)
        in_place = not self.through_nccl and c.name in TORCH_IN_PLACE
        op = self.make_call(c.name, send, send if in_place else self.torch.empty(recv_n, device=self.device), count)
        for _ in range(self.args.start_warmup):
            op()
        if self.gpu:
            self.torch.cuda.synchronize(self.device)

    def measure(self, c: Any, size: int, limit: int, fault: str | None) -> bool:
        """One size of collective `c`: timed, checked, rank 0's line written; False on a wrong result."""
        name, args = c.name, self.args
        count, send_n, recv_n = c.counts(size, self.world)
        nbytes = max(send_n, recv_n) * coll.ELEMENT_BYTES
        if nbytes > limit:
            if self.rank == 0:
                emit({"event": "skip", "collective": name, "size_bytes": nbytes,
                      "reason": f"needs more than {limit} bytes free"})
            return True
        in_place = not self.through_nccl and name in TORCH_IN_PLACE
        blocks, block_us, time_us, gpu_time_us = self.time_size(c, count, send_n, recv_n, nbytes, in_place, fault)
        correct = args.no_check or self.correct(name, count, send_n, recv_n, in_place, fault)
        if self.rank == 0:
            factor = c.busbw_factor(self.world)
            algbw = coll.algbw_gbps(nbytes, time_us)
            record: dict[str, object] = {
                "event": "size", "collective": name, "size_bytes": nbytes, "count": count,
                "time_us": round(time_us, 3), "algbw_gbps": _significant(algbw),
                "busbw_gbps": _significant(algbw * factor), "correct": correct, "iters": args.iters,
                "warmup": args.warmup, "blocks": blocks, "placement": "in-place" if in_place else "out-of-place"}
            if blocks > 1:
                record["block_busbw_gbps"] = [_significant(coll.algbw_gbps(nbytes, us) * factor) for us in block_us]
            if self.gpu:
                record["gpu_time_us"] = round(gpu_time_us, 3)
            emit(record)
        return correct


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--probe"]:
        emit(probe_record())
        return 0
    args = _arguments(argv)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    try:
        wanted = coll.parse_list(args.collectives)
    except ValueError as exc:
        emit({"event": "error", "rank": rank, "kind": "usage", "message": f"--collectives: {exc}"})
        return EXIT_SETUP
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
    try:
        job = Job(torch, dist, args, rank, world, local_rank)
        job.init_process_group()
        job.attach_nccl(wanted)
        timing = job.choose_timing()
    except SetupError as exc:
        emit({"event": "error", "rank": rank, "kind": exc.kind, "message": str(exc)})
        return EXIT_SETUP
    if rank == 0:
        emit(job.start_record(timing, wanted))
    limit = job.buffer_limit()
    status = 0
    for c in wanted:
        reason = job.unsupported(c)
        if reason is not None:
            if rank == 0:
                emit({"event": "not_measured", "collective": c.name, "backend": args.backend, "reason": reason})
            continue
        job.warm_start(c, sizes, limit)
        for size in sizes:
            if not job.measure(c, size, limit, fault):
                status = EXIT_WRONG_RESULT
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        emit({"event": "done", "status": status})
    return status


def capture(torch: Any, call: Callable[[], None], n: int, stream: Any) -> Any:
    """A CUDA graph of `n` calls enqueued on `stream`. Thread-local capture: torch's watchdog
    thread keeps querying its own events meanwhile, which global capture would forbid."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for _ in range(n):
            call()
    return graph


def capture_probe(torch: Any, direct: DirectNccl, wanted: list[Any], world: int, stream: Any) -> str:
    """Capture one small call of every wanted collective into a CUDA graph (never replayed):
    '' when all captured, else why not."""
    for c in wanted:
        count, send_n, recv_n = c.counts(1024 * world, world)
        send = torch.ones(send_n, dtype=torch.float32, device=stream.device)
        recv = torch.empty(recv_n, dtype=torch.float32, device=stream.device)
        call = functools.partial(direct.call, c.name, send.data_ptr(), recv.data_ptr(), count, stream.cuda_stream)
        try:
            graph = capture(torch, call, 1, stream)
        except Exception as exc:  # capture fails in CUDA, NCCL or torch; any of them means no graph
            return f"{c.name}: {type(exc).__name__}: {exc}".splitlines()[0]
        del graph
    return ""


def timed_block(torch: Any, gpu: bool, mode: str, iters: int, call: Callable[[], None], graph: Any,
                sleep_cycles: int) -> tuple[float, float]:
    """Time per call over one block of iterations: (reported, GPU-event) microseconds. Graph mode
    replays the captured iterations; `sleep_cycles` > 0 holds the GPU while events mode enqueues."""
    if not gpu:
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        host_us = (time.perf_counter() - t0) * 1e6 / iters
        return host_us, host_us
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    start.record()
    t0 = time.perf_counter()
    if graph is not None:
        graph.replay()
    else:
        for _ in range(iters):
            call()
    end.record()
    end.synchronize()
    host_us = (time.perf_counter() - t0) * 1e6 / iters
    gpu_us = start.elapsed_time(end) * 1000.0 / iters
    return (gpu_us if mode == "events" else host_us), gpu_us


def end_process(code: int) -> NoReturn:
    """End this process with `code` as an interpreter ends, less the teardown: what was registered
    to run at exit runs and every output buffer is flushed (Python's streams, then C's), then the
    process exits at once. Tearing down the modules and objects of torch is half a second of CPU
    per process, spent after the rank's work is done: a trial's ranks end together, and each trial
    waits for the last of them. A rank the rank server forks ends the same way (rankserver._rank)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    ctypes.CDLL(None).fflush(None)
    os._exit(code)


if __name__ == "__main__":
    # An exception out of main, SystemExit included, ends the interpreter as usual.
    end_process(main())
