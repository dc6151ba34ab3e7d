"""The worker's direct NCCL path, around what needs a GPU: finding the library torch loaded,
version codes, the ctypes call's error handling, falling back, and how a sweep names its method."""

from __future__ import annotations

from typing import Any

import pytest

from nccltune.trials.runner import TrialResult
from nccltune.trials.worker import DirectNccl, loaded_nccl_path, version_code

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

    def __init__(self, result: int, async_states: list[int] | None = None) -> None:
        states = list(async_states or [])

        def get_async(_comm: Any, ref: Any) -> int:
            ref._obj.value = states.pop(0)
            return 0

        self.ncclAllReduce = FakeFn(lambda *a: result)
        self.ncclCommGetAsyncError = FakeFn(get_async)
        self.ncclGetErrorString = FakeFn(lambda rc: b"unhandled cuda error (run with NCCL_DEBUG=INFO for details)")


def test_the_call_is_out_of_place_float32_sum_on_the_given_stream() -> None:
    lib = FakeNccl(0)
    direct = DirectNccl(lib, 0xABC)  # type: ignore[arg-type]
    direct.all_reduce(FakeTensor(0x1000, 256), FakeTensor(0x2000, 256), 0x77)
    (send, recv, count, dtype, op, comm, stream), = lib.ncclAllReduce.calls
    assert (send.value, recv.value, count, dtype, op) == (0x1000, 0x2000, 256, 7, 0)
    assert comm.value == 0xABC and stream.value == 0x77


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
