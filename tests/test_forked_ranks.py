"""Ranks forked from the rank server (bench.fork_ranks, the default) held to the rules of ranks
started by exec (test_runner.py): fresh processes for every trial, the candidate over the base
environment in every rank, the timeout, the abort and the kill; and what happens when the server
cannot fork: ranks start by exec, and a pid the server names is acted on only when it is its own,
and only through its pidfd (one the server reaps and the kernel hands again is never signalled).

Real worker processes: torch gloo on the CPU, two ranks, tiny sizes. What a forked rank saw is
shown by the worker's fault switch, which acts only when the rank's environment holds a value.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nccltune.hw.procfs import parent_pids
from nccltune.trials.forkedranks import EXIT_REPORT_S
from nccltune.trials.runner import SERVER_LOG, Runner, TrialAborted, TrialResult
from nccltune.trials.worker import FAULT_VAR
from tests.pidns import run_in_pid_namespace

pytest.importorskip("torch")

SIZES = [4096, 65536]


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL") and k != FAULT_VAR}
    env.update(extra)
    return env


def _runner(tmp_path: Path, *, python: str = sys.executable, timeout_s: float = 60.0,
            base_env: dict[str, str] | None = None, abort_check: Callable[[], str | None] | None = None) -> Runner:
    return Runner(python=python, backend="gloo", nranks=2, base_env=base_env or _base_env(),
                  work_dir=tmp_path / "work", timeout_s=timeout_s, abort_check=abort_check)


def _run(runner: Runner, candidate: dict[str, str] | None = None) -> TrialResult:
    return runner.run(candidate or {}, SIZES, warmup=1, iters=2, label="test")


class Watch:
    """The abort check that notes, while a trial runs, the processes the server forked and the
    workers this process started by exec."""

    def __init__(self) -> None:
        self.runner: Runner | None = None
        self.forked: set[int] = set()
        self.by_exec: set[int] = set()
        self.servers: set[int] = set()
        self.abort_when: Callable[[Watch], bool] = lambda watch: False

    def __call__(self) -> str | None:
        assert self.runner is not None
        server = self.runner.rank_server_pid
        parents = parent_pids()
        if server is not None:
            self.servers.add(server)
            self.forked |= {pid for pid, parent in parents.items() if parent == server}
        self.by_exec |= {pid for pid, parent in parents.items() if parent == os.getpid() and _runs_the_worker(pid)}
        return "a job started on the GPUs" if self.abort_when(self) else None


def _runs_the_worker(pid: int) -> bool:
    try:
        return b"worker.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _watched(tmp_path: Path, **kwargs: object) -> tuple[Runner, Watch]:
    watch = Watch()
    runner = _runner(tmp_path, abort_check=watch, **kwargs)  # type: ignore[arg-type]
    watch.runner = runner
    return runner, watch


def _start_pid(result: TrialResult) -> int:
    assert result.log_dir is not None
    first = (Path(result.log_dir) / "rank0.out").read_text().splitlines()[0]
    return int(json.loads(first)["pid"])


def _gone(pids: set[int], within_s: float = 10.0) -> bool:
    """Every process of `pids` has ended within `within_s` (a zombie has ended: a rank of a killed
    server is reaped by whoever adopts it, not by the runner)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = {pid for pid in pids if (state := _state(pid)) is not None and state != "Z"}
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.05)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def test_every_trial_forks_fresh_ranks_from_one_server_and_measures_correctly(tmp_path: Path) -> None:
    runner, watch = _watched(tmp_path)
    first = _run(runner)
    first_ranks, watch.forked = watch.forked, set()
    second = _run(runner)
    for result in (first, second):
        assert result.status == "ok", result.reason
        assert [s.size_bytes for s in result.sizes] == SIZES and all(s.correct for s in result.sizes)
    # Two ranks each, forked by one server that lives through the sweep, none by exec; new ones
    # every trial (NCCL reads its variables once per process).
    (server,) = watch.servers
    assert len(first_ranks) == 2 and len(watch.forked) == 2 and not first_ranks & watch.forked
    assert not watch.by_exec
    assert _start_pid(first) in first_ranks and _start_pid(second) in watch.forked
    assert _gone(first_ranks | watch.forked)
    assert runner.rank_server_pid == server
    runner.close()
    assert runner.rank_server_pid is None and _gone({server})


def test_the_candidate_reaches_every_forked_rank_and_wins_over_the_base_env(tmp_path: Path) -> None:
    # The base environment would crash every rank; the candidate switches that off again.
    base = _base_env(NCCL_ALGO="Tree", NCCLTUNE_TEST_BASE="kept", **{FAULT_VAR: "crash"})
    runner = _runner(tmp_path, base_env=base)
    assert _run(runner, {"NCCL_ALGO": "Ring", FAULT_VAR: ""}).status == "ok"
    # A fault that fires only where the rank sees the value: the candidate's, the base's, and
    # each rank's own RANK.
    for fault, rank in (("crash@1:NCCL_ALGO=Ring", 1), ("crash@0:NCCLTUNE_TEST_BASE=kept", 0)):
        result = _run(runner, {"NCCL_ALGO": "Ring", FAULT_VAR: fault})
        assert (result.status, result.reason) == ("crashed", f"rank {rank} was killed by signal SIGABRT")
    # The base's value where the candidate does not set it: OMP_NUM_THREADS as every rank gets it.
    result = _run(runner, {FAULT_VAR: "crash@1:OMP_NUM_THREADS=1"})
    assert result.reason == "rank 1 was killed by signal SIGABRT"
    runner.close()


def test_a_hang_is_a_timeout_every_forked_rank_is_killed_and_the_server_forks_on(tmp_path: Path) -> None:
    runner, watch = _watched(tmp_path, base_env=_base_env(**{FAULT_VAR: "hang@1:NCCL_ALGO=Tree"}))
    # The server is started (torch imported, which the runner waits for up to the trial timeout)
    # by a trial with the generous timeout; then the short one is the hung trial's.
    assert _run(runner).status == "ok"
    served, watch.forked = watch.forked, set()
    runner.timeout_s = 5
    result = _run(runner, {"NCCL_ALGO": "Tree"})
    assert result.status == "timeout" and "no result within 5 s" in (result.reason or "")
    assert len(watch.forked) == 2 and _gone(watch.forked)
    hung, watch.forked = watch.forked, set()
    runner.timeout_s = 60
    assert _run(runner).status == "ok"
    assert len(watch.forked) == 2 and not (hung | served) & watch.forked and not watch.by_exec
    assert len(watch.servers) == 1
    runner.close()


def test_a_wrong_sum_in_a_forked_rank_is_a_wrong_result(tmp_path: Path) -> None:
    runner = _runner(tmp_path, base_env=_base_env(**{FAULT_VAR: "wrong_sum@1"}))
    result = _run(runner)
    assert result.status == "wrong_result" and "wrong all-reduce result" in (result.reason or "")
    runner.close()


def test_an_abort_request_kills_the_forked_ranks(tmp_path: Path) -> None:
    runner, watch = _watched(tmp_path, base_env=_base_env(**{FAULT_VAR: "hang"}))
    watch.abort_when = lambda w: len(w.forked) == 2
    with pytest.raises(TrialAborted, match="a job started"):
        _run(runner)
    assert len(watch.forked) == 2 and _gone(watch.forked)
    runner.close()


def test_a_rank_whose_start_environment_differs_starts_by_exec(tmp_path: Path) -> None:
    """OMP_NUM_THREADS is read while torch is imported: a candidate that changes it cannot run in
    a process forked after that import."""
    runner, watch = _watched(tmp_path)
    assert _run(runner).status == "ok" and len(watch.forked) == 2
    watch.forked = set()
    result = _run(runner, {"OMP_NUM_THREADS": "2", FAULT_VAR: "crash@1:OMP_NUM_THREADS=1"})
    assert result.status == "ok", result.reason
    assert not watch.forked and len(watch.by_exec) == 2
    runner.close()


def test_a_server_killed_mid_trial_takes_its_ranks_and_the_next_trial_runs_by_exec(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runner, watch = _watched(tmp_path, base_env=_base_env(**{FAULT_VAR: "hang@1:NCCL_ALGO=Tree"}))

    def kill_the_server(w: Watch) -> bool:
        if len(w.forked) == 2 and w.runner is not None and w.runner.rank_server_pid:
            os.kill(w.runner.rank_server_pid, signal.SIGKILL)
        return False

    watch.abort_when = kill_the_server
    result = _run(runner, {"NCCL_ALGO": "Tree"})
    assert result.status == "crashed" and "SIGKILL" in (result.reason or "")
    assert _gone(watch.forked) and _gone(watch.servers)
    watch.abort_when = lambda w: False
    assert _run(runner).status == "ok"
    assert len(watch.by_exec) == 2
    runner.close()


def _python_with_server(tmp_path: Path, server: str) -> str:
    """An interpreter that runs `server` (a shell command line, given the descriptor as $1) in
    place of the rank server, and is this Python otherwise."""
    path = tmp_path / "python-wrapper"
    path.write_text("#!/bin/sh\n"
                    'case "$*" in *rankserver.py*) eval "shift 2; set -- \\"\\$@\\"";'
                    f" {server} ;; esac\n"
                    f'exec {shlex.quote(sys.executable)} "$@"\n')
    path.chmod(0o755)
    return str(path)


def _python_with_liar(tmp_path: Path, answer: str) -> str:
    """An interpreter whose rank server says it is ready, then runs `answer` (Python, indented
    once, with the socket `s`) for every request instead of forking the rank asked for."""
    liar = tmp_path / "liar.py"
    liar.write_text("import json, os, socket, sys, time\n"
                    "s = socket.socket(fileno=int(sys.argv[1]))\n"
                    "s.send(json.dumps({'ready': os.getpid()}).encode())\n"
                    "while True:\n"
                    "    data, fds, _f, _a = socket.recv_fds(s, 1 << 20, 4)\n"
                    "    if not data:\n"
                    "        break\n" + answer)
    return _python_with_server(tmp_path, f'exec {shlex.quote(sys.executable)} -I {shlex.quote(str(liar))} "$1"')


def test_a_server_that_cannot_start_leaves_the_ranks_to_exec(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    python = _python_with_server(tmp_path, 'echo "no torch here" >&2; exit 4')
    runner, watch = _watched(tmp_path, python=python)
    result = _run(runner)
    assert result.status == "ok", result.reason
    assert len(watch.by_exec) == 2 and not watch.forked
    assert "ranks start by exec: the rank server did not come up" in caplog.text
    assert "no torch here" in (tmp_path / "work" / SERVER_LOG).read_text()
    runner.close()


def test_a_pid_the_server_names_is_used_only_when_it_is_its_own(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A server that names init as the rank it forked: the runner takes nothing of it (no signal
    to pid 1 or its group, no wait on it), ends the server and starts the ranks by exec."""
    python = _python_with_liar(tmp_path, "    s.send(json.dumps({'started': 1}).encode())\n")
    runner, watch = _watched(tmp_path, python=python)
    result = _run(runner)
    assert result.status == "ok", result.reason
    assert len(watch.by_exec) == 2
    assert "pid 1, which it named, is not a rank of its own" in caplog.text
    assert runner.rank_server_pid is None
    runner.close()


def test_a_rank_the_server_says_has_ended_counts_as_running_while_it_runs(tmp_path: Path) -> None:
    """A server that forks a real child, names it, and says at once that it exited with status 0:
    the runner goes by the process (its pidfd), so the trial times out and the child is killed."""
    python = _python_with_liar(tmp_path,
                               "    pid = os.fork()\n"
                               "    if pid == 0:\n"
                               "        time.sleep(120)\n"
                               "        os._exit(0)\n"
                               "    s.send(json.dumps({'started': pid}).encode())\n"
                               "    s.send(json.dumps({'exited': pid, 'code': 0}).encode())\n"
                               "    s.send(json.dumps({'exited': 1, 'code': 0}).encode())\n")
    runner, watch = _watched(tmp_path, python=python, timeout_s=3)
    result = _run(runner)
    assert result.status == "timeout", result.reason
    assert len(watch.forked) == 2 and _gone(watch.forked)
    runner.close()


_REAPED_AND_HANDED_AGAIN = '''
import json, os, sys
from pathlib import Path
from nccltune.hw.procfs import parent_pids
from nccltune.trials.runner import Runner

import nccltune.trials.forkedranks
python, work, timeout_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
nccltune.trials.forkedranks.EXIT_REPORT_S = float(sys.argv[4])
env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL")}
named, given = set(), []

def watch():
    server = runner.rank_server_pid
    if server is not None:
        named.update(pid for pid, parent in parent_pids().items() if parent == server)
    # A rank the server reaped without a word: its pid goes to a process group of someone else's.
    for pid in sorted(named):
        if not given and not os.path.exists(f"/proc/{pid}"):
            given.append(give_pid(pid, ["sleep", "60"]))
    return None

runner = Runner(python=python, backend="gloo", nranks=2, base_env=env, work_dir=work / "work",
                timeout_s=timeout_s, abort_check=watch)
result = runner.run({}, [4096], warmup=1, iters=2, label="reaped")
alive = [p.poll() is None for p in given]
for p in given:
    p.kill()
runner.close()
print(json.dumps({"status": result.status, "reason": result.reason, "named": sorted(named),
                  "given": [p.pid for p in given], "alive": alive}))
'''


# The rank ends 0.5 s into the trial: the timeout of 3 s comes before EXIT_REPORT_S after that; the
# shorter wait for the server's word (2.5 s, as long as the first case gives the pid to be handed
# again) comes before the timeout of 30 s.
@pytest.mark.parametrize(("timeout_s", "exit_report_s"), [(3.0, EXIT_REPORT_S), (30.0, 2.5)])
def test_a_rank_the_server_reaps_unsaid_ends_the_trial_and_its_pid_is_never_signalled(
        tmp_path: Path, timeout_s: float, exit_report_s: float) -> None:
    """A server (any process of the rank user may do this) that forks each rank, names it, and
    reaps it without a word when it ends; meanwhile the kernel hands the pid to another process
    group. The trial ends by the timeout's kill (3 s) or by the rank's pidfd (30 s: the rank ended
    and the server said nothing of it within exit_report_s); neither signals the new process."""
    python = _python_with_liar(tmp_path,
                               "    import signal\n"
                               "    signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
                               "    pid = os.fork()\n"
                               "    if pid == 0:\n"
                               "        os.setsid()\n"
                               "        time.sleep(0.5)\n"
                               "        os._exit(0)\n"
                               "    s.send(json.dumps({'started': pid}).encode())\n")
    got = run_in_pid_namespace(_REAPED_AND_HANDED_AGAIN, python, str(tmp_path), str(timeout_s), str(exit_report_s))
    assert len(got["named"]) == 2 and len(got["given"]) == 1 and got["given"][0] in got["named"]
    assert got["alive"] == [True], "a kill meant for the reaped rank reached the process that got its pid"
    if timeout_s < exit_report_s:
        assert got["status"] == "timeout", got
    else:
        assert got["status"] == "crashed", got
        assert "ended, and the rank server did not say how" in got["reason"]


def test_what_a_server_says_reaches_the_log_escaped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server whose refusal holds a forged log line and a terminal escape: the runner says it
    failed in one line of its own, the server's words escaped, and starts the ranks by exec."""
    refusal = "'no\\n2026 WARNING nccltune: forged\\x1b[2J'"
    python = _python_with_liar(tmp_path, f"    s.send(json.dumps({{'refused': {refusal}}}).encode())\n")
    runner, watch = _watched(tmp_path, python=python)
    result = _run(runner)
    assert result.status == "ok", result.reason
    assert len(watch.by_exec) == 2
    (said,) = [r.getMessage() for r in caplog.records if "rank server" in r.getMessage()]
    assert said.isprintable() and "it did not fork the rank: no\\n2026 WARNING nccltune: forged\\x1b[2J" in said
    runner.close()
