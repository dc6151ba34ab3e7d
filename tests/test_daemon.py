"""`nccltune daemon` as systemd runs it: a real process, a real notify socket, real demo sweeps.

Most tests start `python -m nccltune daemon --demo <copied snapshot>` with NOTIFY_SOCKET bound
by the test, and read its log and its sd_notify datagrams with timeouts. To keep the suite
short on two cores, one demo sweep seeds a published state that the tests copy; a test that
needs a sweep to start on such a copy runs the daemon with one sweep setting changed (the
published tuning then no longer matches, as after a config change). The parts that need no
process are tested in test_daemon_scheduler.py, test_daemon_watcher.py and test_daemon_service.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from nccltune.daemon import DEMO_BUSY_FILE
from nccltune.files.lock import SweepLock
from nccltune.store import Store
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

from demo_state import BASE_CONFIG, SHORT_CONFIG, SNAPSHOT, SWEEP_S, clean_env, copy_state, seeded_state

PUBLISHED = ("nccl.sh", "nccl.env", "nccl.json", "ncclTopology.xml")
# A sweep of 7 short trials: the defaults twice, NCCL_ALGO=Ring and the topology file alone,
# then one round of finalists and defaults.
START_S = 60.0


def config_text(**changes: dict[str, Any]) -> str:
    """BASE_CONFIG with some sections' keys changed: config_text(sweep={"min_gain_pct": 2})."""
    doc = json.loads(json.dumps(BASE_CONFIG))
    for section, values in changes.items():
        doc.setdefault(section, {}).update(values)
    return yaml.safe_dump(doc, sort_keys=False)


# The published tuning depends on this setting, so a daemon started with it on a seeded state
# sees the tuning as stale and sweeps at once, without publishing anything first.
RETUNE = {"sweep": {"min_gain_pct": 2.5}}


def published_bytes(state: Path) -> dict[str, bytes]:
    return {name: (state / name).read_bytes() for name in PUBLISHED if (state / name).exists()}


def provenance(state: Path) -> dict[str, Any]:
    doc = json.loads((state / "nccl.json").read_text())
    assert isinstance(doc["provenance"], dict)
    return doc["provenance"]


# -- a seeded state: one demo sweep, copied by the tests that need something published -------------


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return seeded_state(tmp_path_factory)


# -- the daemon under test -------------------------------------------------------------------------


class NotifyListener:
    """The service manager's side of sd_notify: a bound datagram socket, read in a thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self.messages.append(fields)

    def all(self) -> list[dict[str, str]]:
        with self._lock:
            return list(self.messages)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@dataclass
class DaemonRun:
    proc: subprocess.Popen[bytes]
    log_path: Path
    notify: NotifyListener
    state: Path
    snapshot: Path
    config: Path
    # pid -> create time of every process the daemon started, seen while waiting on it
    ranks_seen: dict[int, float] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _fail(self, what: str) -> AssertionError:
        return AssertionError(f"{what}\n--- daemon log ---\n{self.log()}\n--- notify ---\n{self.notify.all()}")

    def wait(self, what: str, predicate: Callable[[], Any], timeout_s: float, *, alive: bool = True) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = predicate()
            if got:
                return got
            if alive and self.proc.poll() is not None:
                raise self._fail(f"the daemon exited ({self.proc.returncode}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise self._fail(f"timed out after {timeout_s:g} s waiting for {what}")
            self._note_ranks()
            time.sleep(0.05)

    def wait_log(self, pattern: str, timeout_s: float, *, after: int = 0) -> re.Match[str]:
        """The first match of `pattern` in the log at or after offset `after`."""
        rx = re.compile(pattern)
        match: re.Match[str] = self.wait(f"log /{pattern}/", lambda: rx.search(self.log(), after), timeout_s)
        return match

    def wait_notify(self, predicate: Callable[[dict[str, str]], bool], timeout_s: float, *,
                    after: int = 0) -> int:
        """Index of the first datagram at or after `after` that satisfies predicate."""
        def find() -> int | None:
            for i, msg in enumerate(self.notify.all()[after:], start=after):
                if predicate(msg):
                    return i + 1  # 1-based so that index 0 is truthy
            return None
        return int(self.wait("a notify datagram", find, timeout_s)) - 1

    def wait_ready(self, timeout_s: float = START_S, after: int = 0) -> int:
        return self.wait_notify(lambda m: m.get("READY") == "1", timeout_s, after=after)

    def _note_ranks(self) -> None:
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.ranks_seen.setdefault(child.pid, child.create_time())
        except psutil.Error:
            pass

    def still_running(self) -> list[psutil.Process]:
        """Processes the daemon started that are still there (same pid and start time)."""
        left = []
        for pid, created in self.ranks_seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                pass
        return left

    def metrics(self) -> dict[str, list[Any]]:
        """Samples by metric name from the textfile, parsed as Prometheus would."""
        # The history's file and the daemon's own (nccltune-daemon.prom): disjoint series.
        text = "".join((self.state / "metrics" / name).read_text()
                       for name in ("nccltune.prom", "nccltune-daemon.prom"))
        families = text_string_to_metric_families(text)
        out: dict[str, list[Any]] = {}
        for fam in families:
            for sample in fam.samples:
                out.setdefault(sample.name, []).append(sample)
        return out

    def wait_metric(self, name: str, value: float, timeout_s: float) -> dict[str, list[Any]]:
        def check() -> dict[str, list[Any]] | None:
            try:
                got = self.metrics()
            except (OSError, ValueError):
                return None
            return got if [s.value for s in got.get(name, [])] == [value] else None
        result: dict[str, list[Any]] = self.wait(f"metric {name} == {value}", check, timeout_s)
        return result

    def terminate(self, timeout_s: float = 60.0) -> int:
        self._note_ranks()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise self._fail("the daemon did not stop within the timeout after SIGTERM") from None


@dataclass
class Env:
    root: Path
    runs: list[DaemonRun] = field(default_factory=list)
    listeners: list[NotifyListener] = field(default_factory=list)

    def state_from(self, seeded: Path | None) -> Path:
        state = self.root / "state"
        if seeded is not None:
            copy_state(seeded, state)
        return state

    def snapshot(self) -> Path:
        path = self.root / "snapshot.json"
        if not path.exists():
            shutil.copyfile(SNAPSHOT, path)
        return path

    def start(self, state: Path, *, config: str | None = None, extra_env: dict[str, str] | None = None,
              args: tuple[str, ...] = (), name: str = "daemon") -> DaemonRun:
        cfg = self.root / f"{name}.yaml"
        cfg.write_text(config if config is not None else config_text())
        notify_path = os.path.join(self.root, f"{name}.sock")
        if len(notify_path) >= 100:  # sun_path is 108 bytes
            notify_path = os.path.join(tempfile.mkdtemp(prefix="ntn"), "n.sock")
        listener = NotifyListener(notify_path)
        self.listeners.append(listener)
        log_path = self.root / f"{name}.log"
        env = clean_env(NOTIFY_SOCKET=notify_path, HOME=str(self.root), **(extra_env or {}))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nccltune", "daemon", "--demo", str(self.snapshot()), "--config", str(cfg),
                 "--state-dir", str(state), "--poll-interval", "1", *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=self.root)
        run = DaemonRun(proc, log_path, listener, state, self.snapshot(), cfg)
        self.runs.append(run)
        return run


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    for run in e.runs:
        if run.proc.poll() is None:
            run._note_ranks()
            run.proc.kill()
            run.proc.wait(timeout=30)
        for p in run.still_running():  # only processes the daemon under test started
            with contextlib.suppress(psutil.Error):
                p.kill()
    for listener in e.listeners:
        listener.close()


def status_has(text: str) -> Callable[[dict[str, str]], bool]:
    return lambda m: text in m.get("STATUS", "")


def assert_no_ranks_left(run: DaemonRun) -> None:
    left = [(p.pid, p.cmdline()) for p in run.still_running()]
    assert not left, f"processes of the daemon still running: {left}"


def manual(d: DaemonRun, command: str) -> subprocess.CompletedProcess[str]:
    """`nccltune <command> --demo` on the daemon's state dir, as an operator would run it."""
    return subprocess.run([sys.executable, "-m", "nccltune", command, "--demo", str(d.snapshot), "--config",
                           str(d.config), "--state-dir", str(d.state)], capture_output=True, text=True,
                          env=clean_env(), timeout=120)


def last_run(state: Path) -> Any:
    with Store(state / "history.db") as store:
        runs = store.runs(limit=1)
    assert runs
    return runs[0]


# -- start-up, sweep, publish, verify, metrics -----------------------------------------------------


def test_start_up_notifies_ready_then_sweeps_publishes_verifies_and_exports(env: Env) -> None:
    state = env.state_from(None)
    # The shortest sweep: start-up, publish, verify and the metrics do not depend on what it searched.
    d = env.start(state, config=yaml.safe_dump(SHORT_CONFIG, sort_keys=False))
    ready = d.wait_ready()
    sweeping = d.wait_notify(status_has("sweeping"), START_S)
    assert ready < sweeping, d.notify.all()
    # Every trial is announced with a STATUS before it runs, so READY came before any trial.
    first_trial = d.notify.all()[sweeping]["STATUS"]
    assert re.match(r"sweeping 1/\d+: baseline", first_trial), first_trial
    assert not any(m.get("STATUS", "").startswith("sweeping") for m in d.notify.all()[:ready + 1])

    # While the daemon sweeps, the sweep lock is its: a manual sweep is refused (75).
    got = manual(d, "sweep")
    assert got.returncode == 75, got.stderr
    assert f"another sweep is running (pid {d.proc.pid}" in got.stderr

    d.wait_log(r"sweep done in", SWEEP_S)
    for name in ("nccl.sh", "nccl.env", "nccl.json"):
        assert (state / name).is_file()
    prov = provenance(state)
    # A decision (the sweep's winner, or NCCL's defaults kept), not the safe stand-in.
    assert (prov["state"] in ("tuned", "defaults"), prov["generation"], prov["demo"]) == (True, 1, True)
    # A demo sweep on a loaded machine can measure every verify size too noisily to verify: then
    # verify says so (and fails) instead of passing on drops it could never see.
    verdict = d.wait_log(r"verify passed|verify: no size can be verified", SWEEP_S)
    metrics = d.wait_metric("nccltune_last_verify_success", 1.0 if verdict.group(0) == "verify passed" else 0.0,
                            30)
    assert [s.value for s in metrics["nccltune_last_sweep_success"]] == [1.0]
    assert [s.labels["version"] for s in metrics["nccltune_build_info"]]
    assert all(name.startswith("nccltune_") for name in metrics)
    busbw = metrics["nccltune_busbw_bytes_per_second"]
    sizes = {int(s.labels["size_bytes"]) for s in busbw}
    assert sizes == {4096, 16384, 65536, 262144, 1048576, 4194304}
    assert {s.labels["setting"] for s in busbw} == {"default", "published"}
    # Bytes per second: gloo on two cores moves at least 100 kB/s at 4 MiB and far below 1 TB/s.
    assert all(1e5 < s.value < 1e12 for s in busbw if s.labels["size_bytes"] == "4194304"), busbw
    with Store(state / "history.db") as store:
        run = store.runs(limit=1, kind="sweep")[0]
    expected = {r["size_bytes"]: r["default_busbw_gbps"] * 1e9 for r in run.summary["rows"]}
    for s in busbw:
        if s.labels["setting"] == "default":
            assert s.value == pytest.approx(expected[int(s.labels["size_bytes"])])
    assert d.log().index("daemon ready") < d.log().index("sweeping: nothing is published yet")

    assert d.terminate() == 0
    assert_no_ranks_left(d)


# -- topology change -------------------------------------------------------------------------------


def test_topology_change_republishes_a_safe_environment_then_retunes(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    before = provenance(state)
    d = env.start(state)
    ready = d.wait_ready()
    # The seeded tuning matches this topology and config: nothing to do.
    assert d.notify.all()[ready]["STATUS"] == "idle"
    old_xml = (state / "ncclTopology.xml").read_text()

    snap = json.loads(d.snapshot.read_text())
    snap["nvml"]["gpus"][0]["nvlinks"][3]["active"] = False
    tmp = d.snapshot.with_suffix(".tmp")
    tmp.write_text(json.dumps(snap))
    os.replace(tmp, d.snapshot)

    changed = d.wait_log(r"topology changed \(\w+ -> \w+\): (.*)", 30)
    assert "0000:00:06.0" in changed.group(1) and "nvlinks_active 18 -> 17" in changed.group(1)
    d.wait_log(r"republished a safe environment", 30)
    safe = provenance(state)
    assert safe["state"] == "safe"
    assert safe["generation"] == before["generation"] + 1
    assert safe["topology_fingerprint"] != before["topology_fingerprint"]
    safe_env = json.loads((state / "nccl.json").read_text())["env"]
    # The new topology file is part of the published set; the stable-path copy follows it.
    in_set = state / "generations" / str(safe["generation"]) / "ncclTopology.xml"
    assert safe_env["NCCL_TOPO_FILE"] == str(in_set)
    assert "NCCL_ALGO" not in safe_env
    assert in_set.read_text() == (state / "ncclTopology.xml").read_text() != old_xml

    d.wait_log(r"sweeping: topology changed", 30)
    d.wait_log(r"sweep done in", SWEEP_S)
    tuned = provenance(state)
    assert tuned["state"] in ("tuned", "defaults")
    assert tuned["generation"] == before["generation"] + 2
    assert tuned["topology_fingerprint"] == safe["topology_fingerprint"]
    metrics = d.wait_metric("nccltune_topology_changes_total", 1.0, 30)
    assert [s.value for s in metrics["nccltune_published_generation"]] == [tuned["generation"]]
    assert d.terminate() == 0
    assert_no_ranks_left(d)


# -- SIGTERM ---------------------------------------------------------------------------------------


def test_sigterm_during_a_sweep_stops_cleanly(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    # The NCCL_ALGO=Ring trial hangs (until the trial timeout): SIGTERM lands in the middle of it.
    d = env.start(state, config=config_text(**RETUNE), extra_env={FAULT_VAR: "hang@1:NCCL_ALGO=Ring"})
    d.wait_ready()
    # After READY: start-up writes ncclTopology.xml for the published tuning when it is missing.
    before = published_bytes(state)
    d.wait_notify(status_has("sweeping"), START_S)

    def ranks() -> list[int]:
        """The worker's processes: started by exec (worker.py) or forked by the rank server."""
        try:
            return [p.pid for p in psutil.Process(d.proc.pid).children(recursive=True)
                    if any("worker.py" in part for part in p.cmdline())
                    or any("rankserver.py" in part for part in p.parent().cmdline())]
        except psutil.Error:
            return []
    assert d.wait("rank processes", lambda: len(ranks()) == 2, 60)
    d._note_ranks()
    # A verify would measure beside the sweep: refused (75) like a second sweep.
    got = manual(d, "verify")
    assert got.returncode == 75, got.stderr
    assert f"pid {d.proc.pid}" in got.stderr
    stopping_from = len(d.notify.all())
    assert d.terminate() == 0
    msgs = d.notify.all()[stopping_from:]
    assert any(m.get("STOPPING") == "1" for m in msgs), msgs
    assert_no_ranks_left(d)
    assert published_bytes(state) == before
    assert last_run(state).status == "interrupted"
    assert "sweep stopped: the service is stopping" in d.log()

    # The daemon lock was released: another daemon starts on the same state and stops as asked.
    again = env.start(state, args=("--max-polls", "1"), name="again")
    assert again.proc.wait(timeout=START_S) == 0, again.log()
    assert "stopping after 1 poll(s)" in again.log()


# -- SIGHUP ----------------------------------------------------------------------------------------


def test_sighup_keeps_the_old_config_when_the_new_one_is_invalid(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    d = env.start(state)
    ready = d.wait_ready()

    d.config.write_text("daemon:\n  quiet_period_s: -1\n")
    d.proc.send_signal(signal.SIGHUP)
    reloading = d.wait_notify(lambda m: m.get("RELOADING") == "1", 30, after=ready + 1)
    assert int(d.notify.all()[reloading]["MONOTONIC_USEC"]) > 0
    d.wait_log(r"ERROR .*new configuration is invalid, keeping the old one: .*daemon\.yaml:2", 30)
    again = d.wait_ready(30, after=reloading + 1)
    assert d.notify.all()[again]["STATUS"] == "idle"
    # Still polling with the old config: the metrics file (old metrics_dir) comes back.
    (state / "metrics" / "nccltune.prom").unlink()
    d.wait("the metrics file rewritten", (state / "metrics" / "nccltune.prom").exists, 30)
    assert d.proc.poll() is None

    # A valid change is taken, and a changed sweep setting makes the published tuning stale.
    d.config.write_text(config_text(daemon={"quiet_period_s": 0, "verify_interval_s": 3600}))
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(r"configuration reloaded", 30)
    d.wait_ready(30, after=again + 1)
    assert "sweeping" not in d.log()
    d.config.write_text(config_text(**RETUNE))
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(r"sweeping: NCCL, nccltune or the sweep settings changed", 30)
    assert d.terminate() == 0
    assert_no_ranks_left(d)


ALIAS_BOMB = "".join(
    [f"l0: &l0 [{', '.join(['x'] * 9)}]\n"]
    + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9)]
)


def test_sighup_with_an_alias_bomb_is_refused_and_sigterm_still_stops(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    d = env.start(state)
    ready = d.wait_ready()
    assert len(ALIAS_BOMB) < 600
    d.config.write_text(ALIAS_BOMB)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(r"ERROR .*new configuration is invalid, keeping the old one: .*daemon\.yaml:\d+: .*YAML aliases", 30)
    d.wait_ready(30, after=ready + 1)
    assert d.terminate() == 0


# -- one daemon, one sweep at a time ---------------------------------------------------------------


def test_a_second_daemon_on_the_same_state_dir_exits_75(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    first = env.start(state)
    first.wait_ready()
    second = env.start(state, name="second")
    assert second.proc.wait(timeout=START_S) == 75
    assert f"another daemon is running (pid {first.proc.pid}" in second.log()
    assert not any(m.get("READY") for m in second.notify.all())
    assert first.proc.poll() is None
    assert first.terminate() == 0


def test_a_held_sweep_lock_keeps_the_daemon_from_sweeping(env: Env) -> None:
    state = env.state_from(None)
    with SweepLock(state / "sweep.lock"):
        d = env.start(state)
        d.wait_ready()
        d.wait_log(rf"sweep not started: another sweep is running \(pid {os.getpid()}", 30)
        got = manual(d, "sweep")
        assert got.returncode == 75, got.stderr
        assert f"pid {os.getpid()}" in got.stderr
        assert not any(m.get("STATUS", "").startswith("sweeping") for m in d.notify.all())
        assert d.terminate() == 0
    with Store(state / "history.db") as store:
        assert store.runs() == []
    assert not (state / "nccl.json").exists()


# -- a job starts while the daemon sweeps ----------------------------------------------------------


def test_a_job_that_starts_during_a_sweep_stops_it_and_keeps_the_files(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    d = env.start(state, config=config_text(**RETUNE))
    d.wait_ready()
    before = published_bytes(state)
    assert set(before) == set(PUBLISHED)
    sweeping = d.wait_notify(status_has("sweeping"), START_S)
    (state / DEMO_BUSY_FILE).touch()
    stopped = d.wait_log(r"sweep stopped: a job started on the GPUs", 30)
    pending = d.wait_notify(status_has("idle, sweep pending"), 30, after=sweeping)
    assert published_bytes(state) == before
    run = last_run(state)
    assert (run.kind, run.status) == ("sweep", "interrupted")
    # While the job runs no new sweep starts, quiet period 0 or not.
    refused = stopped
    for _ in range(3):
        refused = d.wait_log(r"sweep pending \(.*\) but not now: GPUs in use", 30, after=refused.end())
    assert "sweeping: " not in d.log()[stopped.end():]
    assert not any(m.get("STATUS", "").startswith("sweeping") for m in d.notify.all()[pending:])
    assert d.terminate() == 0
    assert_no_ranks_left(d)
    assert published_bytes(state) == before


# -- degraded --------------------------------------------------------------------------------------


def test_an_unreadable_node_degrades_the_daemon_and_keeps_the_files(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    d = env.start(state)
    d.wait_ready()
    d.wait_metric("nccltune_degraded", 0.0, 30)
    before = published_bytes(state)
    good = d.snapshot.read_bytes()
    d.snapshot.write_text('{"kind": "nccltune-snapshot", "nvml": ')

    d.wait_log(r"ERROR .*degraded: cannot read the node: .*snapshot\.json", 30)
    degraded = d.wait_notify(status_has("degraded"), 30)
    d.wait_metric("nccltune_degraded", 1.0, 30)
    assert published_bytes(state) == before

    d.snapshot.write_bytes(good)
    d.wait_log(r"leaving degraded state", 30)
    d.wait_notify(lambda m: m.get("STATUS") == "idle", 30, after=degraded + 1)
    d.wait_metric("nccltune_degraded", 0.0, 30)
    assert published_bytes(state) == before
    assert "topology changed" not in d.log()
    assert d.terminate() == 0


# -- a hanging worker ------------------------------------------------------------------------------


def test_a_hanging_worker_times_out_and_the_daemon_keeps_polling(env: Env) -> None:
    state = env.state_from(None)
    d = env.start(state, config=config_text(bench={"trial_timeout_s": 3}),
                  extra_env={"NCCLTUNE_WORKER_FAULT": "hang@1"})
    d.wait_ready()
    d.wait_log(r"trial 1/\d+ baseline defaults #1: timeout \(no result within 3 s", 60)
    d.wait_log(r"sweep failed: every run of NCCL's defaults failed", 60)
    d.wait_metric("nccltune_last_sweep_success", 0.0, 30)
    assert_no_ranks_left(d)
    (state / "metrics" / "nccltune.prom").unlink()
    d.wait("the metrics file rewritten", (state / "metrics" / "nccltune.prom").exists, 30)
    assert d.proc.poll() is None
    assert not (state / "nccl.json").exists()
    assert last_run(state).status == "failed"
    assert d.terminate() == 0


# -- bad start-up input ----------------------------------------------------------------------------


def test_an_invalid_config_exits_78_before_ready(env: Env) -> None:
    state = env.state_from(None)
    d = env.start(state, config="daemon:\n  poll_interval_s: 0\n")
    assert d.proc.wait(timeout=START_S) == 78
    assert "daemon.yaml:2" in d.log() and "poll_interval_s" in d.log()
    time.sleep(0.3)  # anything sent has arrived by now
    assert not any(m.get("READY") for m in d.notify.all())
    assert not (state / "daemon.lock").exists()


def test_a_corrupt_history_is_moved_aside_at_start(env: Env, seeded: Path) -> None:
    state = env.state_from(seeded)
    (state / "history.db").write_bytes(b"this is not an SQLite database\0" * 64)
    d = env.start(state, config=config_text(**RETUNE))
    d.wait_ready()
    aside = list(state.glob("history.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not an SQLite")
    assert d.log().index("is corrupt") < d.log().index("daemon ready")
    # The new history works: the sweep that follows is recorded there.
    d.wait_notify(status_has("sweeping"), START_S)
    assert d.terminate() == 0
    run = last_run(state)
    assert (run.kind, run.status) == ("sweep", "interrupted")
