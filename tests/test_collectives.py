"""nccl-tests' definitions per collective: which size is reported, the element counts per rank and
the bus-bandwidth factor, against numbers worked out by hand in the comments."""

from __future__ import annotations

from pathlib import Path

import pytest

from nccltune import collectives
from nccltune.collectives import COLLECTIVES, NAMES, algbw_gbps, get, parse_list
from nccltune.records import Measurement, TrialResult
from nccltune.trials.credentials import RANK_DIR
from nccltune.trials.runner import Runner

MiB = 1 << 20


def test_every_collective_is_there_with_its_nccl_tests_binary() -> None:
    assert NAMES == ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
    assert {c.name: c.perf_binary for c in COLLECTIVES.values()} == {
        "all_reduce": "all_reduce_perf", "all_gather": "all_gather_perf", "reduce_scatter": "reduce_scatter_perf",
        "broadcast": "broadcast_perf", "reduce": "reduce_perf", "all_to_all": "alltoall_perf",
        "sendrecv": "sendrecv_perf"}


# busbw / algbw: all_reduce 2(n-1)/n = 2*1/2, 2*3/4, 2*7/8; the split collectives (n-1)/n = 1/2, 3/4, 7/8;
# broadcast, reduce and sendrecv 1 whatever n.
@pytest.mark.parametrize(("name", "factors"), [
    ("all_reduce", (1.0, 1.5, 1.75)),
    ("all_gather", (0.5, 0.75, 0.875)),
    ("reduce_scatter", (0.5, 0.75, 0.875)),
    ("all_to_all", (0.5, 0.75, 0.875)),
    ("broadcast", (1.0, 1.0, 1.0)),
    ("reduce", (1.0, 1.0, 1.0)),
    ("sendrecv", (1.0, 1.0, 1.0)),
])
def test_busbw_factors_for_2_4_and_8_ranks(name: str, factors: tuple[float, float, float]) -> None:
    assert tuple(get(name).busbw_factor(n) for n in (2, 4, 8)) == pytest.approx(factors)


def test_one_rank_moves_nothing_between_ranks() -> None:
    # 2(1-1)/1 = 0 and (1-1)/1 = 0, as nccl-tests prints busbw 0 on one GPU; the root-bound ones stay 1.
    assert [get(n).busbw_factor(1) for n in NAMES] == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="nranks"):
        get("all_reduce").busbw_factor(0)


# (collective, requested bytes, ranks) -> (count argument, send elements, receive elements, reported bytes)
@pytest.mark.parametrize(("name", "size", "nranks", "expected"), [
    # 1 MiB = 262144 floats, one buffer per rank, count = 262144 for the unsplit ones.
    ("all_reduce", MiB, 4, (262144, 262144, 262144, MiB)),
    ("broadcast", MiB, 8, (262144, 262144, 262144, MiB)),
    ("reduce", MiB, 2, (262144, 262144, 262144, MiB)),
    ("sendrecv", MiB, 8, (262144, 262144, 262144, MiB)),
    # all_gather of 1 MiB total on 4 ranks: 262144 / 4 = 65536 floats per rank sent, 262144 received.
    ("all_gather", MiB, 4, (65536, 65536, 262144, MiB)),
    # reduce_scatter of 1 MiB on 8 ranks: 262144 floats sent, 262144 / 8 = 32768 received.
    ("reduce_scatter", MiB, 8, (32768, 262144, 32768, MiB)),
    # all_to_all of 1 MiB on 8 ranks: 32768 floats to and from each rank, the whole array both ways.
    ("all_to_all", MiB, 8, (32768, 262144, 262144, MiB)),
    # 1000 bytes = 250 floats on 3 ranks: 250 / 3 = 83.3, rounded down to a multiple of 4 = 80 per rank,
    # 240 floats = 960 bytes measured and reported (nccl-tests' size column shows 960 too).
    ("all_gather", 1000, 3, (80, 80, 240, 960)),
    ("reduce_scatter", 1000, 3, (80, 240, 80, 960)),
    # 8 bytes on 4 ranks would round to 0 floats per rank: at least 4, so 4 x 4 ranks x 4 bytes = 64.
    ("all_gather", 8, 4, (4, 4, 16, 64)),
    # Unsplit: 6 bytes is one whole float (4 bytes); 0 bytes still one float.
    ("all_reduce", 6, 2, (1, 1, 1, 4)),
    ("broadcast", 0, 2, (1, 1, 1, 4)),
    # One rank: all_gather's block is the whole array.
    ("all_gather", 4096, 1, (1024, 1024, 1024, 4096)),
])
def test_counts_and_the_reported_size(name: str, size: int, nranks: int, expected: tuple[int, int, int, int]) -> None:
    c = get(name)
    assert (*c.counts(size, nranks), c.size_bytes(size, nranks)) == expected


def test_all_gather_of_1_mib_on_4_ranks_in_100_us() -> None:
    # algbw = 1048576 B / 100 us = 10.48576 GB/s; busbw = algbw x 3/4 = 7.86432 GB/s.
    c = get("all_gather")
    assert algbw_gbps(MiB, 100.0) == pytest.approx(10.48576)
    assert c.busbw_gbps(MiB, 100.0, 4) == pytest.approx(7.86432)


def test_all_reduce_of_1_gib_on_8_ranks_in_5_ms() -> None:
    # algbw = 1073741824 B / 5000 us = 214.7483648 GB/s; busbw = x 2*7/8 = 375.8096384 GB/s.
    assert get("all_reduce").busbw_gbps(1 << 30, 5000.0, 8) == pytest.approx(375.8096384)


def test_sendrecv_matches_a_published_sendrecv_perf_row() -> None:
    # sendrecv_perf -g 8, 134217728 B in 1211.2 us printed algbw 110.81 and busbw 110.81 GB/s.
    assert get("sendrecv").busbw_gbps(134217728, 1211.2, 8) == pytest.approx(110.81, abs=0.005)


def test_a_time_must_be_positive() -> None:
    with pytest.raises(ValueError, match="time_us"):
        algbw_gbps(MiB, 0.0)


def test_the_nccl_log_names_per_collective() -> None:
    assert [COLLECTIVES[n].log_func for n in NAMES] == [
        "AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "AlltoAll", None]


def test_collective_lists_parse_in_order_each_once() -> None:
    assert [c.name for c in parse_list("all_gather, reduce_scatter,all_gather")] == ["all_gather", "reduce_scatter"]
    with pytest.raises(ValueError, match=r"unknown collective 'allreduce' \(known: all_reduce, all_gather"):
        parse_list("allreduce")
    with pytest.raises(ValueError, match="no collective named"):
        parse_list(" , ")


def test_gloo_has_every_collective_in_this_torch() -> None:
    # Checked on two gloo ranks of torch 2.13: every call of the worker runs (tests/test_worker_collectives.py).
    assert all(collectives.gloo_reason(c) is None for c in COLLECTIVES.values())


def test_nccls_algorithm_per_size_is_matched_by_the_collectives_function(tmp_path: Path) -> None:
    # Same size, two functions: each size record gets its own collective's line, sendrecv (p2p) none.
    (tmp_path / RANK_DIR).mkdir()
    (tmp_path / RANK_DIR / "nccl.7001.log").write_text(
        "nodea:7001:7001 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1}\n"
        "nodea:7001:7001 [0] NCCL INFO AllGather: 4096 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..3}\n")
    result = TrialResult("ok", None, [Measurement(4096, 1.0, 1.0, 1.0, collective=n)
                                      for n in ("all_reduce", "all_gather", "sendrecv")], 1.0, start={"pid": 7001})
    Runner._attach_nccl_log(tmp_path, result)
    assert [(s.algo, s.proto) for s in result.sizes] == [("TREE", "LL"), ("RING", "SIMPLE"), (None, None)]
