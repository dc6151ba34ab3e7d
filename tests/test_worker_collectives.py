"""Every collective through the real worker on two gloo ranks (tiny sizes, two iterations): correct
results, a wrong result caught for each collective, and a collective the backend cannot run
(gloo's send to its own rank) reported as not measured with the reason."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from nccltune.collectives import NAMES, get
from nccltune.trials.runner import Runner, TrialResult
from nccltune.trials.worker import FAULT_VAR, expected_output, pattern

pytest.importorskip("torch")

# 4096 B is 1024 floats; split over 2 ranks, 512 per rank. 1000 B exercises the rounding of the
# split collectives: 250 floats / 2 ranks = 125, down to 124 per rank, 248 floats = 992 bytes.
SIZES = [1000, 4096]


def _run(tmp_path: Path, names: tuple[str, ...], fault: str | None = None, nranks: int = 2) -> TrialResult:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL") and k != FAULT_VAR}
    if fault:
        env[FAULT_VAR] = fault
    runner = Runner(python=sys.executable, backend="gloo", nranks=nranks, base_env=env, work_dir=tmp_path / "work",
                    timeout_s=120.0)
    return runner.run({}, SIZES, warmup=1, iters=2, collectives=names)


def test_every_collective_is_measured_and_correct_on_gloo(tmp_path: Path) -> None:
    result = _run(tmp_path, NAMES)
    assert result.status == "ok", result.reason
    assert result.start["collectives"] == list(NAMES)
    assert result.not_measured == {}
    got = {(s.collective, s.size_bytes): s for s in result.sizes}
    expected_sizes = {(n, get(n).size_bytes(size, 2)) for n in NAMES for size in SIZES}
    assert set(got) == expected_sizes
    # The split collectives report 992 bytes for 1000 requested; the others one whole buffer of 1000.
    assert ("all_gather", 992) in got and ("all_reduce", 1000) in got
    for (name, size), s in got.items():
        assert s.correct, (name, size)
        assert s.busbw_gbps == pytest.approx(s.algbw_gbps * get(name).busbw_factor(2), rel=1e-5)


def test_a_wrong_result_is_caught_for_every_collective(tmp_path: Path) -> None:
    result = _run(tmp_path, NAMES, fault="wrong_sum")
    assert result.status == "wrong_result"
    assert {s.collective for s in result.sizes} == set(NAMES)
    assert not any(s.correct for s in result.sizes)
    assert result.reason is not None and "all-gather" in result.reason and "sendrecv" in result.reason


def test_a_collective_the_backend_cannot_run_is_not_measured_with_the_reason(tmp_path: Path) -> None:
    # gloo cannot send to its own rank: the ring step of a single rank is refused by torch's gloo,
    # so it is reported as not measured and the next collective is measured as usual.
    result = _run(tmp_path, ("sendrecv", "all_gather"), nranks=1)
    assert result.status == "ok", result.reason
    assert list(result.not_measured) == ["sendrecv"]
    why = result.not_measured["sendrecv"]
    assert why.startswith("torch ") and " gloo: " in why and "not connected" in why
    assert {s.collective for s in result.sizes} == {"all_gather"} and all(s.correct for s in result.sizes)


def test_the_default_is_all_reduce_only(tmp_path: Path) -> None:
    result = _run(tmp_path, ("all_reduce",))
    assert result.ok, result.reason
    assert {s.collective for s in result.sizes} == {"all_reduce"}
    assert result.start["collectives"] == ["all_reduce"]


# pattern(rank, i) = i % 251 + 256 (rank + 1): the rank in the multiples of 256, the offset below.
@pytest.mark.parametrize(("name", "rank", "count", "recv_n", "expected"), [
    # Block k from rank k, elements 0..3: 256..259 from rank 0, 512..515 from rank 1.
    ("all_gather", 0, 4, 8, [256, 257, 258, 259, 512, 513, 514, 515]),
    # Rank 1 gets block 1 (elements 2, 3) of every rank: 258, 259 from rank 0, 514, 515 from rank 1.
    ("all_to_all", 1, 2, 4, [258, 259, 514, 515]),
    # Rank 1 gets the sum over ranks of elements 2, 3: 2 x (2 + j) + 256 x (1 + 2) = 772, 774.
    ("reduce_scatter", 1, 2, 2, [772, 774]),
    # Rank 0 receives rank 1's elements (the ring's previous rank with 2 ranks).
    ("sendrecv", 0, 3, 3, [512, 513, 514]),
    ("broadcast", 1, 2, 2, [256, 257]),
    ("all_reduce", 1, 2, 2, [768, 770]),
])
def test_expected_outputs_tell_ranks_and_offsets_apart(name: str, rank: int, count: int, recv_n: int,
                                                       expected: list[int]) -> None:
    import torch

    assert expected_output(torch, name, rank, 2, count, recv_n, "cpu").tolist() == expected


def test_reduce_is_checked_on_the_root_only() -> None:
    import torch

    assert expected_output(torch, "reduce", 1, 2, 4, 4, "cpu") is None
    assert expected_output(torch, "reduce", 0, 2, 2, 2, "cpu").tolist() == [768, 770]
    assert pattern(torch, 3, torch.arange(2, dtype=torch.int32) + 251).tolist() == [1024, 1025]


def test_an_unknown_collective_is_a_setup_error_naming_the_known_ones(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from nccltune.trials import worker

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert worker.main(["--backend", "gloo", "--sizes", "4096", "--collectives", "all_reduce,alltoall"]) == 4
    (line,) = capsys.readouterr().out.splitlines()
    doc = json.loads(line)
    assert doc["event"] == "error" and doc["kind"] == "usage"
    assert "unknown collective 'alltoall' (known: all_reduce, all_gather" in doc["message"]


def test_the_start_warmup_calls_the_largest_size_that_fits_before_any_is_timed() -> None:
    import torch

    from nccltune.trials.worker import Job, _arguments

    calls: list[tuple[str, int]] = []

    def job_with(start: int) -> Job:
        args = _arguments(["--sizes", "1024,4096,16384", "--backend", "gloo", "--start-warmup", str(start)])
        job = Job(torch, dist=None, args=args, rank=0, world=2, local_rank=0)
        job.make_call = lambda name, src, dst, count: (lambda: calls.append((name, count)))  # type: ignore[method-assign]
        job.everywhere = lambda ok: ok  # type: ignore[method-assign]  # one rank: its own answer
        return job

    all_reduce = get("all_reduce")
    job_with(3).warm_start(all_reduce, [1024, 4096, 16384], limit=1 << 20)
    assert calls == [("all_reduce", 4096)] * 3  # 16384 bytes: 4096 floats
    calls.clear()
    job_with(2).warm_start(all_reduce, [1024, 4096, 16384], limit=8192)  # 16384 bytes do not fit
    assert calls == [("all_reduce", 1024)] * 2
    calls.clear()
    short = job_with(1)
    short.everywhere = lambda ok: False  # type: ignore[method-assign]
    short.warm_start(all_reduce, [1024, 4096, 16384], limit=1 << 20)  # no size fits on some other rank
    assert calls == []
    other = job_with(1)
    asked: list[bool] = []
    other.everywhere = lambda ok: asked.append(ok) or len(asked) > 1  # type: ignore[method-assign]
    other.warm_start(all_reduce, [1024, 4096, 16384], limit=1 << 20)  # the largest does not fit elsewhere
    assert calls == [("all_reduce", 1024)] and asked == [True, True]  # 4096 bytes: 1024 floats
    calls.clear()
    job_with(0).warm_start(all_reduce, [1024, 4096, 16384], limit=1 << 20)
    job_with(3).warm_start(all_reduce, [1024, 4096, 16384], limit=100)  # nothing fits
    assert calls == []


def test_a_trial_with_a_start_warmup_runs_and_measures_every_size(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL") and k != FAULT_VAR}
    runner = Runner(python=sys.executable, backend="gloo", nranks=2, base_env=env, work_dir=tmp_path / "work",
                    timeout_s=120.0)
    result = runner.run({}, SIZES, warmup=1, iters=2, start_warmup=2)
    assert result.ok, result.reason  # a worker without --start-warmup would exit on its usage error
    assert [s.size_bytes for s in result.sizes] == SIZES and all(s.correct for s in result.sizes)
