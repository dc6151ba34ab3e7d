"""The worker's direct NCCL path, around what needs a GPU: finding the library torch loaded,
version codes, the ctypes call's error handling, falling back, and how a sweep names its method."""

from __future__ import annotations

from typing import Any

import pytest

from nccltune.trials.runner import TrialResult
from nccltune.trials.worker import DirectNccl, graph_wanted, loaded_nccl_path, timing_mode, version_code

MAPS = """\
7f1c2a000000-7f1c2a200000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c30000000-7f1c38000000 r-xp 00000000 08:01 5678 /opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
7f1c40000000-7f1c40001000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
"""


def test_the_loaded_nccl_library_is_found_in_the_memory_map() -> None:
    assert loaded_nccl_path(MAPS) == "/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"


def test_a_path_with_spaces_is_kept_whole() -> None:
    line = "7f00-7f01 r-xp 00000000 08:01 99 /srv/my envs/nccl/lib/libnccl.so.2.28.9\n"
    assert loaded_nccl_path(line) == "/srv/my envs/nccl/lib/libnccl.so.2.28.9"


def test_no_nccl_mapped_means_no_path() -> None:
    assert loaded_nccl_path(MAPS.replace("libnccl.so.2", "libnccl-net.so")) is None
    assert loaded_nccl_path("") is None


def test_version_codes_follow_nccl() -> None:
    assert version_code("2.28.9") == 22809
    assert version_code("2.21.5") == 22105
    with pytest.raises(ValueError):
        version_code("2.x")


def test_this_process_has_no_shared_nccl_so_attach_says_why() -> None:
    # The CPU build of torch has no NCCL: the worker falls back to torch's all_reduce.
    pytest.importorskip("torch")
    import torch.distributed as dist

    direct, why = DirectNccl.attach(dist, "cpu", None)
    assert direct is None
    assert "not loaded as a shared library" in why


class FakeTensor:
    def __init__(self, ptr: int, n: int) -> None:
        self.ptr, self.n = ptr, n

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n


class FakeFn:
    def __init__(self, impl: Any) -> None:
        self.impl = impl
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> Any:
        self.calls.append(args)
        return self.impl(*args)


class FakeNccl:
    """Stands for the CDLL: records calls and answers like NCCL would."""

    def __init__(self, result: int, async_states: list[int] | None = None, alltoall: bool = True) -> None:
        states = list(async_states or [])

        def get_async(_comm: Any, ref: Any) -> int:
            ref._obj.value = states.pop(0)
            return 0

        self.log: list[tuple[Any, ...]] = []  # every NCCL call in order, (name, *args)
        calls = ["ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclReduce", "ncclSend",
                 "ncclRecv", "ncclGroupStart", "ncclGroupEnd"] + (["ncclAlltoAll"] if alltoall else [])
        for name in calls:
            setattr(self, name, FakeFn(lambda *a, name=name: self.log.append((name, *a)) or result))
        self.ncclCommGetAsyncError = FakeFn(get_async)
        self.ncclGetErrorString = FakeFn(lambda rc: b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)")


def test_the_call_is_out_of_place_float32_sum_on_the_given_stream() -> None:
    lib = FakeNccl(0)
    direct = DirectNccl(lib, 0xABC)  # type: ignore[arg-type]
    direct.all_reduce(FakeTensor(0x1000, 256), FakeTensor(0x2000, 256), 0x77)
    (send, recv, count, dtype, op, comm, stream), = lib.ncclAllReduce.calls
    assert (send, recv, count, dtype, op) == (0x1000, 0x2000, 256, 7, 0)
    assert comm == 0xABC and stream == 0x77


def test_an_nccl_error_raises_with_nccls_message() -> None:
    direct = DirectNccl(FakeNccl(1), 1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="ncclAllReduce: unhandled cuda error"):
        direct.all_reduce(FakeTensor(1, 1), FakeTensor(2, 1), 0)


def test_a_non_blocking_communicator_is_polled_until_the_call_completes() -> None:
    lib = FakeNccl(7, async_states=[7, 7, 0])
    DirectNccl(lib, 1).all_reduce(FakeTensor(1, 1), FakeTensor(2, 1), 0)  # type: ignore[arg-type]
    assert len(lib.ncclCommGetAsyncError.calls) == 3


def test_a_non_blocking_failure_is_reported() -> None:
    lib = FakeNccl(7, async_states=[7, 3])
    with pytest.raises(RuntimeError, match="ncclAllReduce"):
        DirectNccl(lib, 1).all_reduce(FakeTensor(1, 1), FakeTensor(2, 1), 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("start", "method"), [
    ({"placement": "out-of-place", "timing": "host clock, direct NCCL calls (as nccl-tests)"},
     "out-of-place; host clock, direct NCCL calls (as nccl-tests)"),
    ({"placement": "in-place", "timing": "cuda-events, prequeued"}, "in-place; cuda-events, prequeued"),
    ({"engine": "nccl-tests", "nccl_version": "2.28.9"}, "out-of-place; all_reduce_perf (nccl-tests)"),
    ({}, None),
])
def test_the_sweep_names_how_it_measured(start: dict[str, str], method: str | None) -> None:
    assert TrialResult("ok", None, [], 1.0, start=start).method == method


def test_argument_types_are_set_once_so_the_loop_passes_plain_integers() -> None:
    lib = FakeNccl(0)
    direct = DirectNccl(lib, 0xABC, rank=0, nranks=2)  # type: ignore[arg-type]
    assert len(lib.ncclReduce.argtypes) == 8 and len(lib.ncclAllGather.argtypes) == 6
    direct.call("reduce", 0x1000, 0x2000, 64, 0x77)
    assert lib.log == [("ncclReduce", 0x1000, 0x2000, 64, 7, 0, 0, 0xABC, 0x77)]  # float32, sum, root 0
    assert all(isinstance(a, int) for a in lib.log[0][1:])


@pytest.mark.parametrize(("name", "call", "args"), [
    ("all_gather", "ncclAllGather", (0x1000, 0x2000, 64, 7, 0xABC, 0x77)),
    ("reduce_scatter", "ncclReduceScatter", (0x1000, 0x2000, 64, 7, 0, 0xABC, 0x77)),
    ("broadcast", "ncclBroadcast", (0x1000, 0x2000, 64, 7, 0, 0xABC, 0x77)),
    ("all_to_all", "ncclAlltoAll", (0x1000, 0x2000, 64, 7, 0xABC, 0x77)),
])
def test_each_collective_makes_its_own_nccl_call(name: str, call: str, args: tuple[int, ...]) -> None:
    lib = FakeNccl(0)
    DirectNccl(lib, 0xABC, rank=1, nranks=4).call(name, 0x1000, 0x2000, 64, 0x77)  # type: ignore[arg-type]
    assert lib.log == [(call, *args)]


def test_all_to_all_without_ncclalltoall_is_one_group_of_sends_and_receives_per_peer() -> None:
    lib = FakeNccl(0, alltoall=False)
    direct = DirectNccl(lib, 0xABC, rank=1, nranks=3)  # type: ignore[arg-type]
    assert direct.all_to_all_call == "grouped ncclSend/ncclRecv"
    direct.call("all_to_all", 0x1000, 0x8000, 16, 0x77)
    # Block p of both buffers goes to / comes from rank p: 16 floats = 64 bytes apart.
    assert lib.log == [("ncclGroupStart",),
                       ("ncclSend", 0x1000, 16, 7, 0, 0xABC, 0x77), ("ncclRecv", 0x8000, 16, 7, 0, 0xABC, 0x77),
                       ("ncclSend", 0x1040, 16, 7, 1, 0xABC, 0x77), ("ncclRecv", 0x8040, 16, 7, 1, 0xABC, 0x77),
                       ("ncclSend", 0x1080, 16, 7, 2, 0xABC, 0x77), ("ncclRecv", 0x8080, 16, 7, 2, 0xABC, 0x77),
                       ("ncclGroupEnd",)]


@pytest.mark.parametrize(("rank", "nranks", "to", "frm"), [(0, 4, 1, 3), (3, 4, 0, 2), (0, 1, 0, 0)])
def test_sendrecv_is_one_ring_step_in_one_group(rank: int, nranks: int, to: int, frm: int) -> None:
    lib = FakeNccl(0)
    DirectNccl(lib, 0xABC, rank=rank, nranks=nranks).call("sendrecv", 0x1000, 0x2000, 8, 0)  # type: ignore[arg-type]
    # With one rank the step sends to and receives from itself.
    assert lib.log == [("ncclGroupStart",), ("ncclSend", 0x1000, 8, 7, to, 0xABC, 0),
                       ("ncclRecv", 0x2000, 8, 7, frm, 0xABC, 0), ("ncclGroupEnd",)]


def test_a_failing_group_names_the_call() -> None:
    with pytest.raises(RuntimeError, match="ncclGroupStart: unhandled cuda error"):
        DirectNccl(FakeNccl(1), 1, 0, 2).call("sendrecv", 1, 2, 1, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("requested", "gpu", "direct_ok", "graph_ok", "mode"), [
    ("auto", False, False, False, "host"),  # gloo: host clock, whatever was asked
    ("graph", False, False, False, "host"),
    ("auto", True, True, True, "graph"),  # the default where capture works
    ("auto", True, True, False, "direct"),  # capture failed on some rank: all time direct calls
    ("auto", True, False, False, "events"),  # no direct NCCL: torch's calls
    ("direct", True, True, True, "direct"),
    ("events", True, True, True, "events"),
    ("graph", True, True, False, None),  # asked for, unavailable: a setup error
    ("graph", True, False, False, None),
    ("direct", True, False, False, None),
])
def test_the_timing_falls_back_only_where_allowed(requested: str, gpu: bool, direct_ok: bool, graph_ok: bool,
                                                  mode: str | None) -> None:
    assert timing_mode(requested, gpu, direct_ok, graph_ok) == mode


def test_graph_capture_is_tried_only_for_auto_and_graph() -> None:
    assert graph_wanted("auto") and graph_wanted("graph")
    assert not graph_wanted("direct") and not graph_wanted("events")
