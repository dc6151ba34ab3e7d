"""The reading of NCCL's log against real multi-rank NCCL 2.28.9 logs (fixtures/nccllog/h200x1-nccl-hosts,
recorded with bench/gpu_nccl_hosts_logs.sh: N NCCL hosts on one H200 over NCCL's socket transport).

The expectations are read by hand off the logs' `X: N Bytes -> Algo A proto P` lines, not derived
with nccltune's own parser, so a misreading cannot hide in both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nccltune.collectives import COLLECTIVES
from nccltune.nccl.debuglog import choices_by_size, parse_nccl_log
from nccltune.records import Measurement, TrialResult
from nccltune.trials.nccllog import debug_env
from nccltune.trials.runner import Runner

FIXTURES = Path(__file__).parent / "fixtures" / "nccllog" / "h200x1-nccl-hosts"
KIB, MIB = 1024, 1024 * 1024
SIZES = (4 * KIB, 64 * KIB, MIB, 4 * MIB)
RING_LL, RING_SIMPLE = ("RING", "LL"), ("RING", "SIMPLE")
# NCCL's defaults on 2 and on 4 socket-connected hosts, per measured size: LL at 4 KiB only, for
# every collective (the split ones' 4 KiB is one rank's 2 KiB or 1 KiB block in the log).
DEFAULTS = {c: {4 * KIB: RING_LL, 64 * KIB: RING_SIMPLE, MIB: RING_SIMPLE, 4 * MIB: RING_SIMPLE}
            for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")}
# On 4 hosts NCCL keeps LL for all_reduce up to 64 KiB ("AllReduce: 65536 Bytes -> Algo RING proto LL").
DEFAULTS_4 = {**DEFAULTS, "all_reduce": {**DEFAULTS["all_reduce"], 64 * KIB: RING_LL}}
FORCED_LL = {c: dict.fromkeys(SIZES, RING_LL) for c in DEFAULTS}


def _trial(tmp_path: Path, label: str) -> TrialResult:
    """A finished trial as the runner leaves it: rank 0's worker lines and its NCCL log in the rank
    directory, named by rank 0's pid."""
    docs = [json.loads(line) for line in (FIXTURES / f"{label}.rank0.jsonl").read_text().splitlines() if line]
    start = next(d for d in docs if d["event"] == "start")
    sizes = [Measurement.from_doc(d) for d in docs if d["event"] == "size"]
    rank_dir = Path(debug_env(tmp_path)["NCCL_DEBUG_FILE"]).parent  # where every rank's NCCL writes its log
    rank_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / f"{label}.rank0.nccl.log", rank_dir / f"nccl.{start['pid']}.log")
    return TrialResult(status="ok", reason=None, sizes=sizes, wall_s=1.0, start=start, log_dir=str(tmp_path))


@pytest.mark.parametrize(("label", "nranks", "expected"), [
    ("defaults-2hosts", 2, DEFAULTS), ("defaults-4hosts", 4, DEFAULTS_4), ("ring-ll-2hosts", 2, FORCED_LL)])
def test_every_measurement_gets_the_choice_nccl_logged(tmp_path: Path, label: str, nranks: int,
                                                       expected: dict[str, dict[int, tuple[str, str]]]) -> None:
    result = _trial(tmp_path, label)
    Runner._attach_nccl_log(tmp_path, result)
    assert result.nccl["nranks"] == nranks
    assert result.nccl["transports"]  # NET/Socket between the hosts
    got = {m.collective: {} for m in result.sizes}
    for m in result.sizes:
        got[m.collective][m.size_bytes] = (m.algo, m.proto)
    assert got == expected
    # The channel count comes along: one channel at 4 KiB, both of the communicator's two at 4 MiB.
    channels = {(m.collective, m.size_bytes): m.channels for m in result.sizes}
    assert channels[("all_reduce", 4 * KIB)] == 1 and channels[("all_reduce", 4 * MIB)] == 2
    assert channels[("all_gather", 4 * KIB)] == 1 and channels[("all_gather", 4 * MIB)] == 2


def test_nccl_logs_the_split_collectives_under_one_ranks_block() -> None:
    """The fact the lookup rests on, read off the 4-host log: NCCL names a 4 MiB all_gather on 4
    ranks "1048576 Bytes", an all_reduce of 4 MiB "4194304 Bytes"."""
    log = parse_nccl_log((FIXTURES / "defaults-4hosts.rank0.nccl.log").read_text())
    gathered = choices_by_size(log, "AllGather")
    scattered = choices_by_size(log, "ReduceScatter")
    reduced = choices_by_size(log, "AllReduce")
    assert MIB in gathered and 4 * MIB not in gathered
    assert MIB in scattered and 4 * MIB not in scattered
    assert 4 * MIB in reduced
    for size in SIZES:
        assert COLLECTIVES["all_gather"].nccl_bytes(size, 4) == size // 4
        assert COLLECTIVES["reduce_scatter"].nccl_bytes(size, 4) == size // 4
        assert COLLECTIVES["all_reduce"].nccl_bytes(size, 4) == size
        assert COLLECTIVES["broadcast"].nccl_bytes(size, 4) == size


def test_a_range_of_measured_sizes_maps_onto_ncclss_counts_without_gap_or_overlap() -> None:
    ag = COLLECTIVES["all_gather"]
    # Two neighbouring spans of measured sizes, split anywhere: their NCCL ranges stay neighbours.
    for split in (1000, 1001, 1002, 1003, 4096):
        low = ag.nccl_byte_range(0, split - 1, 4)
        high = ag.nccl_byte_range(split, 8192, 4)
        assert low[1] + 1 == high[0]
    assert ag.nccl_byte_range(4096, 8192, 1) == (4096, 8192)  # one rank: the block is the whole buffer
    assert COLLECTIVES["all_reduce"].nccl_byte_range(1000, 2000, 4) == (1000, 2000)


def test_forcing_tree_for_every_collective_fails_all_gather() -> None:
    """Why Tree is set as allreduce:Tree: with NCCL_ALGO=Tree for every collective, NCCL 2.28.9
    refuses the first all_gather ("invalid usage"); the run stopped there."""
    err = (FIXTURES / "tree-simple-2hosts.rank0.err").read_text()
    assert "ncclAllGather: invalid usage" in err
    log = parse_nccl_log((FIXTURES / "tree-simple-2hosts.rank0.nccl.log").read_text())
    assert set(choices_by_size(log, "AllReduce").values()) and all(
        (c.algo, c.proto) == ("TREE", "SIMPLE") for c in choices_by_size(log, "AllReduce").values())
