"""Rank launcher: every trial in a fresh set of rank processes, with a hard timeout.

NCCL caches most of its variables per process (NCCL_PARAM in include/param.h), so each
candidate environment gets new processes: forked from the runner's rank server where they may be
(trials.forkedranks: torch imported once per sweep, not once per rank), else started by exec.
All ranks of a trial run in their own process groups; on a timeout, a crash of any rank, Ctrl-C
or an abort request, every group is killed, each through the pidfd of its leader, held from the
rank's start (trials.held): never by a number alone. A failed trial is reported with its reason
and the caller goes on. This is the only module that starts rank processes (through the rank
server, which only forks what this module asks for).

The ranks run as the rank user: what they print is read within bounds (the JSON lines of rank 0's
stdout from its first MAX_OUT_BYTES, at most MAX_WORKER_LINES of them; the last line of its stderr
from its last ERR_TAIL_BYTES; NCCL's log to nccllog.MAX_LOG_BYTES), and every text of theirs the
result keeps (its reason, the start record's fields, why a collective was not measured) is
escaped (logsetup.escaped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..collectives import COLLECTIVES
from ..errors import InputError, NccltuneError, UnavailableError
from ..files import trust
from ..files.atomicfile import atomic_write
from ..files.inputfile import Bounded, loads_strict, read_bounded
from ..files.trust import ensure_dir
from ..hw.procfs import boot_id, start_time_ticks
from ..logsetup import escaped
from ..nccl.debuglog import SizeChoice, choices_by_size, nccl_func, parse_nccl_log, summarize
from ..records import Measurement, TrialResult, TrialStatus
from . import nccltests, rankexec, rankserver
from .container import Container
from .credentials import RANK_DIR, cache_dir, check_reachable, fresh_rank_dir, rank_preexec, rank_user
from .forkedranks import SERVER, UNREPORTED, ForkedRank, RankServer, ServerFailed
from .held import Child, Held
from .launch.base import ERR_TAIL_BYTES, MAX_OUT_BYTES, Launch, TrialSpec, worker_args
from .launch.local import LocalLaunch
from .nccllog import rank0_log, read_log
from .trialenv import RankSide, TrialEnv

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("worker.py")
_EXIT_WRONG_RESULT = 3
_EXIT_SETUP = 4
# The rank record's name in the state directory (see reap_leftover_ranks).
RANK_RECORD = "ranks.running"
SERVER_LOG = "rankserver.err"  # the rank server's output, in the runner's work directory
# Rank 0's JSON lines read at most (within MAX_OUT_BYTES): the worker prints one per collective and
# size, and a start and a done line; 256 sizes of every collective are under 2500.
MAX_WORKER_LINES = 65536
SAID_CHARS = 200  # what a failed trial's reason quotes of a rank's own last line


def reap_leftover_ranks(record: Path) -> list[int]:
    """End the ranks an earlier sweep left running, as its rank record lists them; return their pids.

    Each line is "pid start_time boot_id". A pid counts only in the boot that wrote it and while
    the process that has it started at the recorded time: it is held by a pidfd first, then its
    start time read, then the pidfd checked to hold a process not yet reaped, so the start time
    read was that process's own; it is then ended through the pidfd (trials.held), and a reused
    pid is never hit. Call it holding the sweep lock: then no live sweep owns those ranks. The
    record is emptied.

    Raises:
        InputError: the record may not be trusted (a symlink, another owner), exit 78.
    """
    try:
        fd = trust.open_file(record, os.O_RDONLY, "rank record")
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot read the rank record %s: %s", record, exc)
        return []
    try:
        text = os.read(fd, 1 << 16).decode("ascii", "replace")
    finally:
        os.close(fd)
    killed: list[int] = []
    boot = boot_id()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or boot is None or parts[2] != boot:
            continue
        pid, started = int(parts[0]), int(parts[1])
        held = Held.open(pid) if pid > 1 else None
        if held is None:
            continue
        if start_time_ticks(pid) == started and held.exists():
            log.warning("ending rank process %d left running by an earlier sweep", pid)
            held.kill()
            killed.append(pid)
        held.close()
    atomic_write(record, "")
    return killed


class TrialAborted(NccltuneError):
    """The caller asked to stop (a job started on the GPUs, or the service is stopping)."""


def with_nccl_choice(m: Measurement, choice: SizeChoice | None) -> Measurement:
    """The measurement with the algorithm, protocol and channels NCCL logged for its size."""
    if choice is None:
        return m
    return replace(m, algo=choice.algo, proto=choice.proto, channels=choice.channels)


def check_python(configured: str) -> None:
    """Refuse a worker interpreter that cannot be one, or that root may not run, before anything
    is measured or written: the interpreter and every directory and link on the way to it pass
    the trust rule (a venv's python linked to /usr/bin/python3 is fine; one in a directory another
    user may write is not).

    Raises:
        UnavailableError: it does not exist (exit 69).
        InputError: a directory, a file without the run bit, or not trusted on its way (exit 78).
    """
    found = shutil.which(configured)
    if found is None and not Path(configured).exists():
        raise UnavailableError(f"bench.python {configured!r} does not exist")
    target = Path(found or configured)
    # A directory or a file without the run bit would fail in every rank's exec: say so once.
    if target.is_dir():
        raise InputError("bench.python (--python)", f"{configured} is a directory, not an interpreter")
    try:
        trust.trusted_file(target, "worker interpreter (bench.python)")
    except OSError as exc:
        raise InputError("bench.python (--python)", f"{configured}: {exc.strerror}") from exc
    if not os.access(target, os.X_OK):
        raise InputError("bench.python (--python)", f"{configured} is not executable (no run bit)",
                         hint=f"chmod +x {configured}, or name the interpreter your jobs use")


def _log_text(path: Path) -> str | None:
    """An NCCL log the ranks wrote, as text; None, with a warning, when it is no regular file of
    theirs (nccllog.read_log follows no link)."""
    try:
        return read_log(path).decode(errors="replace")
    except OSError as exc:
        log.warning("not reading NCCL's log %s: %s", escaped(path), escaped(exc))
        return None


def _read_out(path: Path) -> Bounded:
    """What a rank printed on its stdout (the first MAX_OUT_BYTES); nothing where it left no file
    of its own (trials.launch.read_text's rule)."""
    try:
        return read_bounded(path, MAX_OUT_BYTES)
    except OSError:
        return Bounded(b"", 0)


def _last_line(path: Path) -> str:
    """The last line a rank printed on its stderr (read from its last ERR_TAIL_BYTES), "" for none."""
    try:
        lines = read_bounded(path, ERR_TAIL_BYTES, tail=True).lines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _escaped_doc(value: Any) -> Any:
    """A document a rank printed with each of its texts escaped (keys too), numbers and the rest
    as they are."""
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, dict):
        return {escaped(k, 64): _escaped_doc(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped_doc(v) for v in value]
    return value


def find_worker_python(configured: str | None) -> str:
    """The interpreter that runs the worker: configured, this one if it has torch, or python3.

    Raises:
        UnavailableError: no interpreter with torch was found (exit 69).
    """
    if configured:
        check_python(configured)
        # A bare name ("python3") is looked up once, on the caller's PATH, where check_python
        # trusted it: children run with a fixed PATH, on which the name can be another interpreter.
        return shutil.which(configured) or configured
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    for name in ("python3", "python"):
        # Only the system's directories, and only an interpreter root may run; asked isolated
        # (python -I, from /, a clean environment) so that no torch.py planted anywhere is imported.
        exe = shutil.which(name, path=trust.SAFE_PATH)
        if not exe or exe == sys.executable:
            continue
        try:
            trust.trusted_file(exe, "worker interpreter")
        except (InputError, OSError) as exc:
            log.warning("not looking for torch in %s: %s", exe, exc)
            continue
        probe = subprocess.run(trust.python_argv(exe, "-c", "import torch"), capture_output=True, timeout=120,
                               cwd="/", env=trust.child_env(), stdin=subprocess.DEVNULL)
        if probe.returncode == 0:
            return exe
    raise UnavailableError(
        "no Python interpreter with torch found for the benchmark worker",
        hint="set bench.python in the config (or --python) to the interpreter your jobs use",
    )


def exit_status(who: str, code: int | None, what: str = "", said: str = "") -> tuple[TrialStatus, str]:
    """The trial's status when `who` ended it with exit status `code` (negative: killed by that
    signal; None: its launcher said only `what`); `said`: its own last line of stderr, or ""."""
    tail = f": {said}" if said else ""
    if code is None:
        return "crashed", f"{who}: {what}{tail}"
    if code == UNREPORTED:
        return "crashed", f"{who} ended, and the rank server did not say how{tail}"
    if code == _EXIT_WRONG_RESULT:
        return "wrong_result", f"{who} found a wrong all-reduce result"
    if code < 0:
        return "crashed", f"{who} was killed by signal {signal.Signals(-code).name}{tail}"
    if code == _EXIT_SETUP:
        return "error", f"{who} could not set up{tail or ' (see its log)'}"
    return "crashed", f"{who} exited with status {code}{tail}"


class Runner:
    """Runs trials. One instance per sweep; `kill()` stops whatever is running."""

    def __init__(
        self,
        *,
        python: str,
        backend: str,
        nranks: int,
        base_env: Mapping[str, str],
        work_dir: Path,
        timeout_s: float = 180.0,
        gpus: Sequence[int] | None = None,
        nccl_debug: bool | None = None,
        abort_check: Callable[[], str | None] | None = None,
        nccl_tests: str | None = None,
        rank_record: Path | None = None,
        launch: Launch | None = None,
        user: str | None = None,
        topology_file: Path | None = None,
        fork_ranks: bool = True,
        container: Container | None = None,
    ) -> None:
        """`base_env`: the fixed part of every trial's environment (trials.trialenv); `topology_file`:
        the run's copy of nccltune's topology file, which a candidate names by the marker
        publish.OWN_TOPOLOGY (None: no candidate of this runner may name it);
        `nccl_debug`: run the ranks with NCCL's INFO log and read it (None: with the NCCL backend);
        `nccl_tests`: path of all_reduce_perf to measure with instead of the torch worker;
        `rank_record`: file listing the running ranks (see reap_leftover_ranks); `launch`: how ranks
        start (trials.launch; default one process per rank here); `user`: bench.user, whom the ranks
        run as when this is root (trials.credentials); `fork_ranks`: fork the worker's ranks from
        one rank server (trials.rankserver, bench.fork_ranks) rather than start each by exec;
        `container`: every rank runs the worker in that image (bench.image, trials.container).

        Raises:
            InputError: that user does not exist, or cannot run the worker (exit 78).
        """
        self.python = python
        self.backend = backend
        self.nranks = nranks
        self.base_env = dict(base_env)
        self.topology_file = topology_file
        self.work_dir = work_dir
        self.timeout_s = timeout_s
        self.gpus = tuple(gpus) if gpus else None
        self.nccl_debug = backend == "nccl" if nccl_debug is None else nccl_debug
        self.abort_check = abort_check
        self.nccl_tests = nccl_tests
        self.rank_record = rank_record
        self.launch = launch or LocalLaunch(nranks)
        self.rank_user = rank_user(user)
        self.container = container
        if nccl_tests is None and container is None:
            check_reachable(python, [WORKER, Path(rankexec.__file__), SERVER], self.rank_user)
        self.fork_ranks = fork_ranks and nccl_tests is None and container is None
        self._server: RankServer | None = None
        self._names: list[str] = []
        self._procs: list[Child | ForkedRank] = []
        self._containers: list[str] = []  # this trial's containers, by name (bench.image)
        self._seq = 0

    def recorded(self, candidate: Mapping[str, str]) -> dict[str, str]:
        """The candidate as the history stores it: the marker as the run's topology file."""
        return TrialEnv(self.base_env, candidate).recorded(self.topology_file)

    def run(self, candidate: Mapping[str, str], sizes: Sequence[int], *, warmup: int, iters: int,
            check: bool = True, label: str = "", timing: str = "auto", prequeue: bool = True,
            max_blocks: int = 1, collectives: Sequence[str] = ("all_reduce",),
            start_warmup: int | None = None) -> TrialResult:
        """One trial. `timing`: the worker's GPU timing (auto, graph, direct or events); `prequeue` applies
        to events; `max_blocks`: timed blocks per size, the median reported (see worker.block_count);
        `collectives`: what the worker measures (collectives.NAMES), each over all sizes; `start_warmup`:
        untimed calls at each collective's largest size before its first is timed (worker.Job.warm_start;
        default `warmup`, as nccl-tests warms up at its largest size before its ladder of sizes)."""
        self._seq += 1
        trial_dir = self.work_dir / f"trial-{self._seq:03d}"
        ensure_dir(trial_dir, "trial directory")
        rank_dir = fresh_rank_dir(trial_dir, self.rank_user)
        side = RankSide(self.topology_file, trial_dir, rank_dir, cache_dir(self.work_dir, self.rank_user),
                        self.rank_user, self.nccl_debug, self.gpus)
        env = TrialEnv(self.base_env, candidate).for_ranks(side)
        # Isolated (-I): the worker imports nothing from a working directory or PYTHONPATH.
        args = ["--backend", self.backend,
                "--sizes", ",".join(str(s) for s in sizes), "--warmup", str(warmup), "--iters", str(iters),
                "--timeout-s", str(max(30.0, self.timeout_s))]
        cmd = (self.container.launch_argv(args) if self.container
               else [*trust.python_argv(self.python, str(WORKER)), *args])
        if not check:
            cmd.append("--no-check")
        if timing != "auto":
            cmd += ["--timing", timing]
        if max_blocks > 1:
            cmd += ["--max-blocks", str(max_blocks)]
        if not prequeue:
            cmd.append("--no-prequeue")
        start = warmup if start_warmup is None else start_warmup
        if start > 0:
            cmd += ["--start-warmup", str(start)]
        if list(collectives) != ["all_reduce"]:
            cmd += ["--collectives", ",".join(collectives)]
        log.debug("trial %s %s: %s", self._seq, label, " ".join(f"{k}={v}" for k, v in candidate.items()))
        self.launch.prepare()  # other nodes joining: not part of the trial's time
        started = time.monotonic()
        self._procs, self._names, self._containers = [], [], []
        if self.nccl_tests:
            return self._run_nccl_tests(trial_dir, env, sizes, warmup, iters, started, collectives)
        try:
            user = self.rank_user.name if self.rank_user and self.launch.runs_as_caller else None
            specs = self.launch.start(TrialSpec(self._seq, trial_dir, cmd, env, dict(candidate), self.timeout_s,
                                                nccl_log=self.nccl_debug, user=user, topology_file=self.topology_file))
            self._names = [s.who for s in specs]
            for spec in specs:
                if self.container:
                    name = f"nccltune-{os.getpid()}-{self._seq}-{spec.name}"
                    self._containers.append(name)
                    argv = self.container.argv(spec.argv, spec.env, trial_dir, rank_dir, name)
                    self._spawn(trial_dir, spec.name, argv, self.container.runtime_env(spec.env),
                                as_root=self.container.switches_user)
                    continue
                # The worker's own command line, as a local launch hands it on, may be forked.
                self._spawn(trial_dir, spec.name, spec.argv, spec.env, forkable=spec.argv == cmd)
            status, reason = self._wait(started)
            self.launch.finish(trial_dir)
            # srun exits 143 whichever of its tasks failed: the launch knows which, and how.
            failed = self.launch.failed_rank(trial_dir) if status in ("crashed", "error", "wrong_result") else None
            if failed is not None:
                status, reason = exit_status(failed.who, failed.code, failed.what, failed.said)
        except BaseException:
            self.kill()
            raise
        wall = time.monotonic() - started
        result = self._collect(trial_dir, status, reason, wall)
        result.shape = self.launch.record()
        return result

    def _spawn(self, trial_dir: Path, name: str, cmd: list[str], env: dict[str, str], *,
               forkable: bool = False, as_root: bool = False) -> None:
        """Start one process in its own session (so its whole group can be killed), output to files
        root opens in the trial directory, as the rank user (trials.credentials) in its rank directory.
        A `forkable` one (the worker, `cmd` = [python, -I, worker.py, args...]) is forked from the
        rank server where the runner has one that may (see _rank_server), else started by exec.

        The rank dies with its parent (PR_SET_PDEATHSIG, SIGKILL; a forked one with the rank server,
        which dies with this process): a kill -9 of the sweep or the daemon must not leave ranks
        holding the GPUs. It is also written to the rank record, so that the next sweep ends it
        should the death signal not reach it (see reap_leftover_ranks). `as_root`: the process is a
        container runtime that makes the rank the rank user itself (--user), so it starts as the caller.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | trust.NOFOLLOW | trust.CLOEXEC
        # The child holds its own copies of these descriptors; ours close right away.
        out = os.open(trial_dir / f"{name}.out", flags, 0o644)
        try:
            err = os.open(trial_dir / f"{name}.err", flags, 0o644)
            try:
                # srun runs as the caller; its tasks switch in rankexec (SrunLaunch, TrialSpec.user).
                switch = None if self.launch.runs_as_caller or as_root else self.rank_user
                server = self._rank_server(env) if forkable else None
                proc: Child | ForkedRank | None
                proc = self._fork(server, cmd, env, trial_dir / RANK_DIR, out, err) if server else None
                if proc is None:
                    proc = Child(cmd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=trial_dir / RANK_DIR,
                                 preexec_fn=rank_preexec(os.getpid(), switch))
            except OSError as exc:
                # Not an interpreter after all (exec format error, no permission): the setting is wrong.
                raise InputError("bench.python (--python)", f"{cmd[0]} cannot be run: {exc.strerror}") from exc
            finally:
                os.close(err)
        finally:
            os.close(out)
        self._procs.append(proc)
        self._record_ranks()

    @property
    def rank_server_pid(self) -> int | None:
        """The pid of the process that forks this runner's ranks, while one runs."""
        return self._server.pid if self._server is not None and self._server.broken is None else None

    def _rank_server(self, env: dict[str, str]) -> RankServer | None:
        """The runner's rank server, started at the first rank it may fork (with that rank's
        environment, rankserver.start_part), or None: ranks start by exec (not wanted, it failed,
        or `env` differs from the server's in what is read while torch is imported)."""
        if not self.fork_ranks:
            return None
        if self._server is None:
            try:
                self._server = RankServer(self.python, env, cache_dir(self.work_dir, self.rank_user),
                                          self.rank_user, self.work_dir / SERVER_LOG, ready_s=self.timeout_s)
            except ServerFailed as exc:
                log.warning("ranks start by exec: the rank server did not come up (%s; see %s)", exc,
                            self.work_dir / SERVER_LOG)
                self.fork_ranks = False
                return None
            log.debug("rank server %d ready", self._server.pid)
        if self._server.broken is not None:
            self.fork_ranks = False
            return None
        if not rankserver.same_start(self._server.env, env):
            log.debug("trial %d: a rank by exec (its environment differs where torch's import reads it)", self._seq)
            return None
        return self._server

    def _fork(self, server: RankServer, cmd: list[str], env: dict[str, str], cwd: Path, out: int,
              err: int) -> ForkedRank | None:
        """The rank forked by `server`, or None (it failed: said once, exec from now on)."""
        null = os.open(os.devnull, os.O_RDONLY | trust.CLOEXEC)
        try:
            # The rank directory is in root's trial directory: opened here, entered there by descriptor.
            home = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | trust.NOFOLLOW | trust.CLOEXEC)
        except BaseException:
            os.close(null)
            raise
        try:
            return server.fork(worker_args(cmd), env, (null, out, err, home))
        except ServerFailed as exc:
            server.fail(str(exc))
            self.fork_ranks = False
            return None
        finally:
            os.close(null)
            os.close(home)

    def close(self) -> None:
        """End the rank server, if one runs (a runner that is dropped ends it too: it exits when
        its socket closes)."""
        if self._server is not None:
            self._server.close()
            self._server = None

    def _record_ranks(self) -> None:
        """Rewrite the rank record: one "pid start_time boot_id" line per live rank of this runner
        (see reap_leftover_ranks); a start time counts only when the rank's pidfd shows it
        unreaped after it was read, so it is the rank's own."""
        if self.rank_record is None:
            return
        lines = []
        boot = boot_id() or "-"
        for p in self._procs:
            if p.poll() is None:
                started = start_time_ticks(p.pid)
                if started is not None and p.held.exists():
                    lines.append(f"{p.pid} {started} {boot}\n")
        atomic_write(self.rank_record, "".join(lines))

    def _run_nccl_tests(self, trial_dir: Path, env: dict[str, str], sizes: Sequence[int], warmup: int,
                        iters: int, started: float, collectives: Sequence[str]) -> TrialResult:
        """The `*_perf` binary of each collective in turn, one process over all GPUs each; the rest
        of the pipeline is the same. The first one that fails ends the trial."""
        assert self.nccl_tests is not None
        results: list[Measurement] = []
        binaries: list[str] = []
        version: str | None = None
        status: TrialStatus = "ok"
        reason: str | None = None
        wanted = set(sizes)
        pids: dict[str, int] = {}  # collective -> pid of its binary (NCCL's log is named by it)
        for name in collectives:
            binary = nccltests.binary_for(self.nccl_tests, name)
            perf = Path(binary).name
            binaries.append(perf)
            # all_reduce_perf's output keeps the name it always had; the others are named by binary.
            out_name = "rank0" if name == "all_reduce" else perf
            cmd = nccltests.command(binary, sizes, self.nranks, warmup, iters)
            self._procs = []
            try:
                self._spawn(trial_dir, out_name, cmd, env)
                pids[name] = self._procs[0].pid
                status, reason = self._wait(started)
            except BaseException:
                self.kill()
                raise
            out = _read_out(trial_dir / f"{out_name}.out")
            rows, seen = nccltests.parse_output("\n".join(out.lines()))
            if out.cut and status == "ok":
                status, reason = "error", f"{perf} printed over {MAX_OUT_BYTES} bytes"
            version = version or seen
            got = [Measurement(r.size_bytes, r.time_us, r.algbw_gbps, r.busbw_gbps, correct=r.correct,
                               collective=name) for r in rows if r.size_bytes in wanted or not wanted]
            results += got
            if status == "ok" and not got:
                status, reason = "error", f"{perf} printed no result rows"
            if status == "ok" and any(not m.correct for m in got):
                status, reason = "wrong_result", f"{perf} counted wrong values"
            if status != "ok":
                reason = reason if reason and perf in reason else f"{perf}: {reason or status}"
                break
        wall = time.monotonic() - started
        reason = escaped(reason) if reason else reason
        version = escaped(version, 64) if version else version
        result = TrialResult(status=status, reason=reason, sizes=results, wall_s=round(wall, 2),
                             start={"engine": "nccl-tests", "nccl_version": version, "binaries": binaries,
                                    "pid": pids.get(collectives[0]) if collectives else None, "pids": pids},
                             log_dir=str(trial_dir))
        self._attach_nccl_log(trial_dir, result)
        return result

    def _wait(self, started: float) -> tuple[TrialStatus, str | None]:
        deadline = started + self.timeout_s
        while True:
            codes = [p.poll() for p in self._procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # One rank down means the others would wait forever on it.
                self.kill()
                index, code = failed[0]
                rank = self._names[index] if index < len(self._names) else f"rank {index}"
                assert code is not None
                return exit_status(rank, code)
            remote = self.launch.poll()
            if remote:
                self.kill()
                return "crashed", remote
            if all(c == 0 for c in codes):
                return "ok", None
            if time.monotonic() > deadline:
                self.kill()
                return "timeout", f"no result within {self.timeout_s:g} s (hang?); all ranks killed"
            if self.abort_check is not None:
                why = self.abort_check()
                if why:
                    self.kill()
                    raise TrialAborted(why)
            time.sleep(0.05)

    def kill(self) -> None:
        """Kill every rank and its process group through the pidfd the runner holds (trials.held:
        a group only while its leader is not reaped), reap them and empty the rank record."""
        # What a launch stops is what it started itself (forked ranks are the worker's own, handed on unchanged).
        self.launch.stop([p for p in self._procs if isinstance(p, Child)])
        for p in self._procs:
            if p.poll() is None:
                if isinstance(p, ForkedRank):
                    p.kill()
                else:
                    p.kill_group()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                log.warning("rank process %d did not exit after SIGKILL", p.pid)
        if self.container is not None:
            self.container.remove(self._containers)
        with contextlib.suppress(NccltuneError):
            self._record_ranks()

    def _collect(self, trial_dir: Path, status: TrialStatus, reason: str | None, wall: float) -> TrialResult:
        sizes: list[Measurement] = []
        start: dict[str, Any] = {}
        not_measured: dict[str, str] = {}
        done = False
        out = _read_out(trial_dir / "rank0.out")
        lines = out.lines()
        if out.cut and status == "ok":
            status, reason = "error", f"worker printed over {MAX_OUT_BYTES} bytes on its stdout"
        if len(lines) > MAX_WORKER_LINES and status == "ok":
            status, reason = "error", f"worker printed over {MAX_WORKER_LINES} lines on its stdout"
        for line in lines[:MAX_WORKER_LINES]:
            if not line.strip():
                continue
            try:
                doc = loads_strict(line)
            except ValueError:
                if status == "ok":
                    status, reason = "error", f"worker printed something that is not JSON: {line[:80]!r}"
                continue
            if not isinstance(doc, dict):
                continue
            event = doc.get("event")
            if event == "start":
                start = _escaped_doc(doc)
            elif event == "size":
                try:
                    sizes.append(Measurement.from_doc(doc))
                except (KeyError, TypeError, ValueError):
                    status, reason = "error", f"malformed size record from the worker: {line[:80]!r}"
            elif event == "not_measured":
                not_measured[escaped(doc.get("collective"), 64)] = escaped(doc.get("reason"))
            elif event == "done":
                done = True
            elif event == "error":
                reason = reason or f"{doc.get('kind')}: {doc.get('message')}"
        if status == "ok" and not done:
            status, reason = "error", "worker exited without finishing (no 'done' record)"
        wrong = sorted({s.collective for s in sizes if not s.correct})
        # The ranks' exit status says only "wrong result"; the records say which collectives.
        # A launcher over several nodes (torchrun, srun) reports one exit status for all ranks; rank
        # 0's finished records still tell a wrong result from a crash.
        if wrong and (status == "ok" or (status == "crashed" and done)
                      or (status == "wrong_result" and wrong != ["all_reduce"])):
            status, reason = "wrong_result", f"{', '.join(w.replace('_', '-') for w in wrong)} result check failed"
        result = TrialResult(status=status, reason=reason, sizes=sizes, wall_s=round(wall, 2), start=start,
                             log_dir=str(trial_dir), not_measured=not_measured)
        self._attach_nccl_log(trial_dir, result)
        status, reason = result.status, result.reason
        if status != "ok" and reason and "see its log" in reason:
            err = _last_line(trial_dir / "rank0.err")
            if err:
                reason += f": {err[:SAID_CHARS]}"
        if status in ("crashed", "error", "timeout") and not reason:
            reason = status
        # Every text of the reason may be the ranks' (their records, their stderr, NCCL's log).
        result.status, result.reason = status, escaped(reason) if reason else reason
        return result

    @staticmethod
    def _attach_nccl_log(trial_dir: Path, result: TrialResult) -> None:
        """NCCL's INFO log of rank 0 (nccllog.rank0_log: sent by its node when that was another):
        versions, transports, and the algorithm/protocol per size."""
        chosen = rank0_log(trial_dir, result.start.get("pid"))
        text = _log_text(chosen) if chosen is not None else None
        if text is None:
            return
        parsed = parse_nccl_log(text)
        result.nccl = summarize(parsed)
        # nccl-tests runs one process per collective, each with its own log.
        pids = result.start.get("pids") or {}
        nranks = result.start.get("world_size")
        nranks = nranks if isinstance(nranks, int) and nranks >= 1 else 1
        by_collective = {}
        for c in {m.collective for m in result.sizes}:
            func = nccl_func(c)
            if func is None:
                continue
            own = trial_dir / RANK_DIR / f"nccl.{pids[c]}.log" if c in pids else None
            own_text = _log_text(own) if own and own.exists() else None
            log_of_c = parse_nccl_log(own_text) if own_text is not None else parsed
            by_collective[c] = choices_by_size(log_of_c, func)
        # NCCL logs the bytes it sees (one rank's block for the split collectives), not the
        # measured size: each measurement is looked up under NCCL's own count.
        def logged(m: Measurement) -> SizeChoice | None:
            found = by_collective.get(m.collective)
            return found.get(COLLECTIVES[m.collective].nccl_bytes(m.size_bytes, nranks)) if found else None

        result.sizes = [with_nccl_choice(m, logged(m)) for m in result.sizes]
        if parsed.errors and result.status == "ok":
            result.status, result.reason = "error", f"NCCL: {parsed.errors[0]}"
