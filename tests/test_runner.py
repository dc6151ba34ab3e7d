"""The rank launcher with real worker processes (torch gloo on the CPU, 2 ranks, tiny sizes).

The worker interpreter is a small shell wrapper that records each rank's pid and the variables
of interest before exec'ing this Python, so the tests see what every rank really got and can
check afterwards that no rank survived. The ranks start by exec (bench.fork_ranks false), so that
the wrapper sees each; tests/test_forked_ranks.py holds the forked ranks to the same rules.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nccltune.errors import EXIT_BUSY, EXIT_UNAVAILABLE, BusyError, NccltuneError, UnavailableError
from nccltune.files.lock import SweepLock
from nccltune.trials.runner import Runner, TrialAborted, TrialResult, find_worker_python
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

SIZES = [4096, 65536]
SEEN = ("NCCL_ALGO", "NCCL_PROTO", "NCCLTUNE_TEST_BASE", FAULT_VAR, "RANK", "WORLD_SIZE", "OMP_NUM_THREADS")


@pytest.fixture
def wrapper(tmp_path: Path) -> Path:
    record = tmp_path / "ranks"
    record.mkdir()
    where = shlex.quote(str(record))
    # Written aside and renamed, so that a reader never sees a half-written pid file.
    lines = ["#!/bin/sh", f'echo $$ > {where}/"$RANK".tmp && mv {where}/"$RANK".tmp {where}/"$RANK".pid']
    for name in SEEN:
        lines.append(f'printf "%s\\n" "{name}=${{{name}-<unset>}}" >> {where}/"$RANK".env')
    lines.append(f'printf "%s\\n" "$*" > {where}/"$RANK".args')
    lines.append(f'exec {shlex.quote(sys.executable)} "$@"')
    path = tmp_path / "python-wrapper"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL") and k != FAULT_VAR}
    env.update(extra)
    return env


def _runner(wrapper: Path, tmp_path: Path, *, timeout_s: float = 60.0, base_env: dict[str, str] | None = None,
            abort_check: Callable[[], str | None] | None = None) -> Runner:
    # Ranks by exec, each through the wrapper; test_forked_ranks.py has the same for forked ranks.
    return Runner(python=str(wrapper), backend="gloo", nranks=2, base_env=base_env or _base_env(),
                  work_dir=tmp_path / "work", timeout_s=timeout_s, abort_check=abort_check, fork_ranks=False)


def _run(runner: Runner, candidate: dict[str, str] | None = None) -> TrialResult:
    return runner.run(candidate or {}, SIZES, warmup=1, iters=2, label="test")


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted((tmp_path / "ranks").glob("*.pid"))]


def _seen(tmp_path: Path, rank: int) -> dict[str, str]:
    text = (tmp_path / "ranks" / f"{rank}.env").read_text()
    return dict(line.split("=", 1) for line in text.splitlines())


def _assert_all_gone(pids: list[int]) -> None:
    assert pids
    for pid in pids:
        # Reaped (no zombie) and its process group empty: nothing the rank started survived.
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_ok_trial_reports_correct_sizes_with_nccl_tests_busbw(wrapper: Path, tmp_path: Path) -> None:
    result = _run(_runner(wrapper, tmp_path))
    assert result.status == "ok", result.reason
    assert result.ok and result.reason is None
    assert [s.size_bytes for s in result.sizes] == SIZES
    for s in result.sizes:
        assert s.correct
        assert s.time_us > 0 and s.busbw_gbps > 0
        # nccl-tests: algbw = bytes / time; busbw = algbw * 2(n-1)/n, which is algbw for 2 ranks.
        # Reported to enough digits to agree with the time closely even at a few MB/s, where
        # gloo moves 4 KiB.
        assert s.algbw_gbps == pytest.approx(s.size_bytes / (s.time_us * 1e3), rel=2e-4)
        assert s.busbw_gbps == s.algbw_gbps
    assert result.busbw() == {s.size_bytes: s.busbw_gbps for s in result.sizes}
    assert result.start["backend"] == "gloo" and result.start["world_size"] == 2
    assert result.start["timing"] == "host clock"
    assert result.nccl == {}  # gloo: no NCCL log to read
    assert result.log_dir is not None and (Path(result.log_dir) / "rank0.out").is_file()
    lines = (Path(result.log_dir) / "rank0.out").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["start", "size", "size", "done"]
    _assert_all_gone(_pids(tmp_path))
    # No timing asked for: the worker's command line names none (the next test asks for one).
    default_args = (tmp_path / "ranks" / "0.args").read_text()
    assert "--timing" not in default_args and "--no-prequeue" not in default_args


def test_the_timing_choice_reaches_the_worker(wrapper: Path, tmp_path: Path) -> None:
    runner = _runner(wrapper, tmp_path)
    result = runner.run({}, SIZES, warmup=1, iters=2, timing="events", prequeue=False)
    assert result.ok, result.reason
    args = (tmp_path / "ranks" / "1.args").read_text().split()
    assert args[args.index("--timing") + 1] == "events" and "--no-prequeue" in args
    # On CPU the timing choice changes nothing: gloo is timed by the host clock, in place.
    assert result.start["timing"] == "host clock" and result.start["placement"] == "in-place"


def test_the_candidate_reaches_every_rank_and_wins_over_the_base_env(wrapper: Path, tmp_path: Path) -> None:
    # The base environment would crash every rank; the candidate switches that off again, so an
    # "ok" trial also shows that the worker itself saw the candidate's value.
    base = _base_env(NCCL_ALGO="Tree", NCCL_PROTO="LL", NCCLTUNE_TEST_BASE="kept", **{FAULT_VAR: "crash"})
    runner = _runner(wrapper, tmp_path, base_env=base)
    result = _run(runner, {"NCCL_ALGO": "Ring", FAULT_VAR: ""})
    assert result.status == "ok", result.reason
    for rank in (0, 1):
        seen = _seen(tmp_path, rank)
        assert seen["NCCL_ALGO"] == "Ring"
        assert seen["NCCL_PROTO"] == "LL"
        assert seen["NCCLTUNE_TEST_BASE"] == "kept"
        assert seen[FAULT_VAR] == ""
        assert seen["RANK"] == str(rank) and seen["WORLD_SIZE"] == "2"
        assert seen["OMP_NUM_THREADS"] == "1"


def test_hang_is_a_timeout_and_every_rank_is_killed(wrapper: Path, tmp_path: Path) -> None:
    runner = _runner(wrapper, tmp_path, timeout_s=8, base_env=_base_env(**{FAULT_VAR: "hang@1"}))
    started = time.monotonic()
    result = _run(runner)
    elapsed = time.monotonic() - started
    assert result.status == "timeout"
    assert "no result within 8 s" in (result.reason or "")
    assert 8 <= elapsed < 8 + 5
    assert len(_pids(tmp_path)) == 2
    _assert_all_gone(_pids(tmp_path))


def test_crash_names_the_signal(wrapper: Path, tmp_path: Path) -> None:
    runner = _runner(wrapper, tmp_path, base_env=_base_env(**{FAULT_VAR: "crash@1"}))
    result = _run(runner)
    assert result.status == "crashed"
    assert result.reason == "rank 1 was killed by signal SIGABRT"
    assert result.wall_s < 30
    _assert_all_gone(_pids(tmp_path))


def test_wrong_sum_is_a_wrong_result(wrapper: Path, tmp_path: Path) -> None:
    runner = _runner(wrapper, tmp_path, base_env=_base_env(**{FAULT_VAR: "wrong_sum@1"}))
    result = _run(runner)
    assert result.status == "wrong_result"
    assert "wrong all-reduce result" in (result.reason or "")
    # The result check is collective: rank 0 reports the sizes that came out wrong on rank 1.
    assert result.sizes and not any(s.correct for s in result.sizes)
    _assert_all_gone(_pids(tmp_path))


def test_garbage_on_stdout_is_an_error_mentioning_json(wrapper: Path, tmp_path: Path) -> None:
    runner = _runner(wrapper, tmp_path, base_env=_base_env(**{FAULT_VAR: "garbage"}))
    result = _run(runner)
    assert result.status == "error"
    assert "JSON" in (result.reason or "")
    _assert_all_gone(_pids(tmp_path))


def test_an_abort_request_kills_the_ranks(wrapper: Path, tmp_path: Path) -> None:
    def abort_once_both_ranks_run() -> str | None:
        return "a job started on the GPUs" if len(_pids(tmp_path)) == 2 else None

    runner = _runner(wrapper, tmp_path, base_env=_base_env(**{FAULT_VAR: "hang"}),
                     abort_check=abort_once_both_ranks_run)
    with pytest.raises(TrialAborted, match="a job started"):
        _run(runner)
    _assert_all_gone(_pids(tmp_path))


def test_each_trial_gets_its_own_directory(wrapper: Path, tmp_path: Path) -> None:
    runner = _runner(wrapper, tmp_path, base_env=_base_env(**{FAULT_VAR: "crash"}))
    first, second = _run(runner), _run(runner)
    assert first.log_dir != second.log_dir
    assert Path(first.log_dir or "").name == "trial-001" and Path(second.log_dir or "").name == "trial-002"


_HOSTILE_RANK = """
import json, os, sys
if os.environ["RANK"] != "0":
    sys.exit(0)
how = os.environ["NCCLTUNE_TEST_HOSTILE"]
print(json.dumps({"event": "start", "pid": os.getpid(), "backend": "gloo",
                  "torch_version": "2.9\\n2026-01-01T00:00:00 ERROR nccltune: forged\\x1b[2J",
                  "nested": {"key\\x1b[31m": ["value\\r\\n"]}}), flush=True)
if how == "flood":
    # Done, then 40 GiB more of stdout and of stderr (sparse: no disk, and no end to reading them whole).
    print(json.dumps({"event": "done"}), flush=True)
    os.ftruncate(1, 40 << 30)
    os.ftruncate(2, 40 << 30)
    sys.exit(0)
print(json.dumps({"event": "not_measured", "collective": "all\\x1b[31m", "reason": "none\\nWARNING forged"}))
sys.stderr.write("noise\\n\\x1b[2J the last\\x1b[31m line\\x9b2J\\x07 forged\\n")
sys.exit(4)
"""


def _hostile_runner(tmp_path: Path) -> Runner:
    """Ranks by exec whose rank 0 is not the worker but `_HOSTILE_RANK`, as a rank user's process may be."""
    rank = tmp_path / "hostile_rank.py"
    rank.write_text(_HOSTILE_RANK)
    python = tmp_path / "python-hostile"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {shlex.quote(str(rank))}\n")
    python.chmod(0o755)
    return Runner(python=str(python), backend="gloo", nranks=2, base_env=_base_env(), work_dir=tmp_path / "work",
                  timeout_s=60, fork_ranks=False)


def test_a_rank_that_prints_without_end_costs_root_a_bounded_read(tmp_path: Path) -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    result = _hostile_runner(tmp_path).run({"NCCLTUNE_TEST_HOSTILE": "flood"}, SIZES, warmup=1, iters=2)
    # 16 MiB of rank 0's stdout and 1 MiB of its stderr read, not 40 GiB of each.
    assert time.monotonic() - started < 30
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 200
    assert result.status == "error" and result.reason == f"worker printed over {16 << 20} bytes on its stdout"


def test_what_a_rank_says_is_kept_escaped(tmp_path: Path) -> None:
    result = _hostile_runner(tmp_path).run({"NCCLTUNE_TEST_HOSTILE": "forge"}, SIZES, warmup=1, iters=2)
    assert result.status == "error"
    # The reason quotes the rank's own last line of stderr, escaped: one line, no terminal escape.
    assert result.reason == ("rank 0 could not set up (see its log): "
                             "\\x1b[2J the last\\x1b[31m line\\x9b2J\\x07 forged")
    assert result.start["torch_version"] == "2.9\\n2026-01-01T00:00:00 ERROR nccltune: forged\\x1b[2J"
    assert result.start["nested"] == {"key\\x1b[31m": ["value\\r\\n"]}
    assert result.not_measured == {"all\\x1b[31m": "none\\nWARNING forged"}
    assert result.torch_version is not None and result.torch_version.isprintable()


def test_a_missing_interpreter_is_unavailable() -> None:
    with pytest.raises(UnavailableError, match="/nonexistent") as err:
        find_worker_python("/nonexistent")
    assert err.value.exit_code == EXIT_UNAVAILABLE == 69


def test_the_interpreter_defaults_to_this_one_when_it_has_torch() -> None:
    assert find_worker_python(None) == sys.executable
    assert find_worker_python(sys.executable) == sys.executable


# -- one sweep at a time ----------------------------------------------------------------------------


def test_a_second_lock_is_busy_and_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sweep.lock"
    with SweepLock(path):
        assert path.read_text().strip() == str(os.getpid())
        # A second lock object opens its own file description, so flock refuses it even here.
        with pytest.raises(BusyError) as err:
            SweepLock(path).acquire()
        assert err.value.exit_code == EXIT_BUSY == 75
        assert f"pid {os.getpid()}" in str(err.value) and str(path) in str(err.value)
    # Released: the next sweep gets it, and the stale pid is gone from the file.
    assert path.read_text() == ""
    again = SweepLock(path)
    again.acquire()
    again.release()


def test_a_lock_held_by_another_process_names_its_pid(tmp_path: Path) -> None:
    import subprocess

    path = tmp_path / "sweep.lock"
    code = ("import sys, time; from pathlib import Path; from nccltune.files.lock import SweepLock; "
            "lock = SweepLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(BusyError, match=f"pid {holder.pid}"):
            SweepLock(path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # The kernel drops the flock with its holder: no stale lock after a crash.
    SweepLock(path).acquire()


def test_a_lock_that_cannot_be_created_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NccltuneError, match="cannot open the sweep lock") as err:
        SweepLock(blocker / "state" / "sweep.lock").acquire()
    assert str(blocker / "state" / "sweep.lock") in str(err.value)


def test_a_bare_interpreter_name_is_resolved_on_the_callers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--python python3` means the python3 the caller's PATH finds (a venv's, say): the children run
    with a fixed PATH, where that name can be the system's interpreter without torch."""
    here = Path(sys.executable)
    monkeypatch.setenv("PATH", f"{here.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    got = find_worker_python(here.name)
    assert os.path.isabs(got) and Path(got).parent == here.parent
