"""`nccltune daemon`: the node service. Keeps NCCL settings right as the node changes.

Start-up: load and validate the config (exit 78, so systemd does not loop), open the history
(a corrupt one is moved aside), probe NVML and the worker's torch/NCCL, compute the
fingerprints, regenerate ncclTopology.xml, notify READY; if nothing valid is published for this
fingerprint, schedule a sweep (at once with daemon.sweep_on_start, else after one poll interval).

Loop (every poll interval, NVML only, never torch in this process): a changed topology
fingerprint is logged with what changed, a safe environment is republished at once (the new
topology file, no values tuned on the old topology) and a re-sweep is scheduled. Sweeps start
only while the GPUs are free of compute processes and have been for the quiet period, inside
the maintenance window if one is set; a job that starts during a sweep stops it (workers killed,
last published files kept). Verification runs periodically and after each sweep; drift beyond
the threshold is logged, exported and schedules a re-sweep. SIGTERM stops cleanly, SIGHUP
reloads the config (keeping the old one when the new one is invalid; new sweep settings
schedule a re-sweep, as they would at start-up).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .config import Config, load_config, with_overrides
from .doctor import default_conf_files, diagnose
from .errors import BusyError, NccltuneError, UnavailableError
from .lock import SweepLock
from .metrics import MetricsState, write_metrics
from .pipeline import POLICY_VAR, Node, SweepPipeline, load_node, probe_nccl, tuning_fingerprint
from .publish import Provenance, atomic_write, publish, read_published
from .sdnotify import Notifier, watchdog_interval_s
from .store import Store
from .topology.fingerprint import topology_facts
from .topology.ncclxml import render_xml
from .trials.runner import TrialAborted, find_worker_python
from .trust import ensure_dir
from .verify import run_verify

log = logging.getLogger(__name__)

# Demo only: while this file exists in the state directory, the (simulated) GPUs count as busy,
# so that start/stop of jobs can be exercised without GPUs.
DEMO_BUSY_FILE = "demo-busy"
ABORT_CHECK_EVERY_S = 2.0


def describe_change(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two sets of topology facts (fingerprint inputs)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            ident = _identity_key(key, a, b)
            if ident is None:
                out.append(f"{key} changed")
                continue
            before = {ident(x): x for x in a}
            after = {ident(x): x for x in b}
            for k in sorted(set(before) - set(after)):
                out.append(f"{key} {k} is gone")
            for k in sorted(set(after) - set(before)):
                out.append(f"{key} {k} is new")
            for k in sorted(set(before) & set(after)):
                for field_name in sorted(set(before[k]) | set(after[k])):
                    va, vb = before[k].get(field_name), after[k].get(field_name)
                    if va != vb:
                        out.append(f"{key} {k}: {field_name} {va} -> {vb}")
        else:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def _identity_key(key: str, a: list[Any], b: list[Any]) -> Callable[[dict[str, Any]], str] | None:
    """What names one entry of a facts list, or None when no field tells the entries apart.

    The field must be set and unique on both sides: NICs without a PCI address (virtio in VMs)
    all have bus_id None, and keying on it would fold them into one entry and hide changes.
    """
    if not all(isinstance(x, dict) for x in a + b):
        return None
    for k in ("bus_id", "busid", "gpu", "name", "numaid"):
        def ident(x: dict[str, Any], k: str = k) -> str:
            return str(x[k]) + (f"->{x.get('target')}" if key == "nvlinks" else "")

        if not all(x.get(k) is not None for x in a + b):
            continue
        if len({ident(x) for x in a}) == len(a) and len({ident(x) for x in b}) == len(b):
            return ident
    return None


@dataclass
class DaemonOptions:
    config_path: Path | None
    overrides: dict[str, object]
    demo: str | bool | None = None
    python: str | None = None
    max_polls: int | None = None  # stop after this many polls (bring-up scripts and tests)
    poll_interval_s: float | None = None


class Daemon:
    def __init__(self, opts: DaemonOptions, notifier: Notifier | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], _dt.datetime] = _dt.datetime.now) -> None:
        self.opts = opts
        self.notifier = notifier or Notifier()
        self.clock = clock
        # Local time of day, for the maintenance window; injected so that tests need not wait for it.
        self.wall_clock = wall_clock
        self.wake = threading.Event()
        self.stop_requested = False
        self.reload_requested = False
        self.cfg = self._load_config()
        self.metrics = MetricsState(demo=bool(opts.demo))
        self.need_sweep: str | None = None
        self.node: Node | None = None
        self.facts: dict[str, Any] = {}
        self.nccl: dict[str, Any] = {}
        self.tuning_fp: str | None = None
        self.last_busy = -1e18
        # The GPUs as last seen (poll or abort check): a quiet period of 0 must not let a sweep
        # start while a job holds them.
        self.busy_now = False
        self.last_verify = clock()
        self.verify_due = False
        self.watchdog_s = watchdog_interval_s()
        self.last_ping = 0.0
        self._last_abort_check = 0.0
        self._daemon_lock: SweepLock | None = None
        self.status_text = "starting"

    # -- configuration -----------------------------------------------------------------------------

    def _load_config(self) -> Config:
        path = self.opts.config_path
        from .config import DEFAULT_CONFIG_PATH

        cfg = load_config(path or DEFAULT_CONFIG_PATH, required=path is not None)
        if self.opts.overrides:
            cfg = with_overrides(cfg, **self.opts.overrides)
        return cfg

    @property
    def poll_interval(self) -> float:
        return self.opts.poll_interval_s or self.cfg.daemon.poll_interval_s

    def status(self, text: str) -> None:
        if text != self.status_text:
            self.notifier.status(text)
        self.status_text = text

    def ping(self) -> None:
        if self.watchdog_s and self.clock() - self.last_ping >= self.watchdog_s / 2:
            self.notifier.watchdog()
            self.last_ping = self.clock()

    # -- signals -------------------------------------------------------------------------------------

    def _on_term(self, signum: int, frame: object) -> None:
        self.stop_requested = True
        self.wake.set()

    def _on_hup(self, signum: int, frame: object) -> None:
        self.reload_requested = True
        self.wake.set()

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGHUP, self._on_hup)

    def reload(self) -> None:
        self.reload_requested = False
        self.notifier.reloading("reloading configuration")
        try:
            new = self._load_config()
        except NccltuneError as exc:
            log.error("new configuration is invalid, keeping the old one: %s", exc)
            self.notifier.ready(self.status_text)
            return
        self.cfg = new
        log.info("configuration reloaded")
        if self.node is not None:
            self._refresh_tuning_fingerprint()
            # New sweep settings make the published tuning stale, as they do at start-up.
            try:
                self._check_published()
            except NccltuneError as exc:  # a failed safe republish: the config itself is fine
                log.error("cannot republish a safe environment: %s", exc)
            self.status(self._idle_status() if not self.metrics.degraded else self.status_text)
        self.notifier.ready(self.status_text)

    # -- start-up ------------------------------------------------------------------------------------

    def start(self) -> None:
        state = Path(self.cfg.state_dir)
        ensure_dir(state, "state directory")
        self._daemon_lock = SweepLock(state / "daemon.lock")
        try:
            self._daemon_lock.acquire()
        except BusyError as exc:
            raise BusyError(str(exc).replace("another sweep", "another daemon")) from exc
        # Opening moves a corrupt history aside now, and a database this version cannot use
        # (newer schema) stops the start with its message instead of failing every sweep later.
        with Store(state / "history.db"):
            pass
        self.node = load_node(self.cfg, self.opts.demo)
        self.facts = topology_facts(self.node.topo)
        self.nccl = self._probe_nccl()
        self.metrics.nccl_version = self.nccl.get("nccl_version")
        self._update_node_metrics()
        self._refresh_tuning_fingerprint()
        self._regenerate_xml()
        self._check_published()
        self.status("idle" if not self.need_sweep else f"idle, sweep pending ({self.need_sweep})")
        self.notifier.ready(self.status_text)
        log.info("nccltune %s daemon ready: %d GPU(s), fingerprint %s, NCCL %s%s", __version__,
                 len(self.node.topo.gpus), self.node.fingerprint, self.nccl.get("nccl_version") or "n/a",
                 " (CPU demo)" if self.node.demo else "")

    def _probe_nccl(self) -> dict[str, Any]:
        """The worker interpreter's torch and NCCL; empty when it has no torch (nccl-tests engine)."""
        try:
            return probe_nccl(find_worker_python(self.opts.python or self.cfg.bench.python))
        except UnavailableError as exc:
            log.info("no torch for the worker (%s); NCCL version unknown to the daemon", exc.message)
            return {}

    def _refresh_tuning_fingerprint(self) -> None:
        assert self.node is not None
        self.tuning_fp = tuning_fingerprint(self.cfg, self.node.fingerprint, self.nccl.get("nccl_version"),
                                            self.node.demo)

    def _regenerate_xml(self) -> None:
        assert self.node is not None
        text = render_xml(self.node.topo.system)
        path = self.cfg.topology_file
        try:
            if path.exists() and path.read_text() == text:
                return
        except OSError:
            pass
        try:
            published = read_published(self.cfg.publish_dir)
        except NccltuneError:
            return  # _check_published reports it and schedules the sweep that replaces it
        # Only rewrite a file that the published environment does not rely on with other content:
        # a tuned environment always comes with the file it was measured with.
        if published is None or published[1].get("topology_fingerprint") != self.node.fingerprint:
            return
        atomic_write(path, text)

    def _check_published(self) -> None:
        assert self.node is not None
        try:
            published = read_published(self.cfg.publish_dir)
        except NccltuneError as exc:
            # The sweep replaces it (publish() tolerates a corrupt nccl.json); exit 78 here would
            # keep systemd from restarting the service at all.
            log.error("the published files cannot be read: %s", exc)
            self.need_sweep = "the published files cannot be read"
            return
        if published is None:
            self.need_sweep = "nothing is published yet"
            return
        _env, prov = published
        if prov.get("topology_fingerprint") != self.node.fingerprint:
            self.need_sweep = "the published tuning is for another topology"
            self.republish_safe("the published tuning was measured on another topology")
        elif prov.get("tuning_fingerprint") != self.tuning_fp:
            self.need_sweep = "NCCL, nccltune or the sweep settings changed since the published tuning"
        elif prov.get("state") == "safe":
            self.need_sweep = "only a safe environment is published"

    def republish_safe(self, why: str) -> None:
        """The new topology file and policy values, nothing measured on the old topology."""
        assert self.node is not None
        cfg = self.cfg
        atomic_write(cfg.topology_file, render_xml(self.node.topo.system))
        env = {"NCCL_TOPO_FILE": str(cfg.topology_file), POLICY_VAR: str(cfg.sweep.async_error_handling),
               **cfg.sweep.pin}
        prov = Provenance(
            nccltune_version=__version__,
            created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            topology_fingerprint=self.node.fingerprint, nccl_version=self.nccl.get("nccl_version"),
            backend=self.node.backend, demo=self.node.demo, profile=None,
            note=f"safe environment: {why}; tuning pending", tuning_fingerprint=None, state="safe")
        files = publish(cfg.publish_dir, env, prov)
        self.metrics.published_generation = files.generation
        log.warning("republished a safe environment (generation %d): %s", files.generation, why)

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> int:
        self.install_signals()
        try:
            self.start()
            polls = 0
            # daemon.sweep_on_start: a pending sweep may start right away instead of one poll
            # interval (a minute by default) after start-up; the first poll still checks the GPUs.
            skip_sleep = self.cfg.daemon.sweep_on_start and self.need_sweep is not None
            while not self.stop_requested:
                if not skip_sleep:
                    self._sleep(self.poll_interval)
                skip_sleep = False
                if self.stop_requested:
                    break
                if self.reload_requested:
                    self.reload()
                self.poll()
                self.maybe_sweep()
                self.maybe_verify()
                self.write_metrics()
                polls += 1
                if self.opts.max_polls is not None and polls >= self.opts.max_polls:
                    log.info("stopping after %d poll(s) as asked", polls)
                    break
        finally:
            self.notifier.stopping("stopping")
            if self._daemon_lock is not None:
                self._daemon_lock.release()
        return 0

    def _sleep(self, seconds: float) -> None:
        end = self.clock() + seconds
        while not self.stop_requested and not self.reload_requested:
            left = end - self.clock()
            if left <= 0:
                return
            step = min(left, self.watchdog_s / 2 if self.watchdog_s else left)
            self.wake.wait(step)
            self.wake.clear()
            self.ping()

    def gpus_busy(self, node: Node | None = None) -> list[int]:
        """Compute processes on the GPUs that are not this daemon's own trial ranks."""
        node = node or self.node
        if node is None:
            return []
        if node.demo:
            return [0] if (Path(self.cfg.state_dir) / DEMO_BUSY_FILE).exists() else []
        pids = {p.pid for g in node.snapshot.nvml.gpus for p in g.processes}
        return sorted(pids - _own_descendants())

    def poll(self) -> None:
        try:
            node = load_node(self.cfg, self.opts.demo)
        except NccltuneError as exc:
            self._degraded(f"cannot read the node: {exc.message}")
            return
        except Exception as exc:  # NVML errors (GPU lost, driver unloaded) are not NccltuneErrors
            self._degraded(f"NVML error: {exc}")
            return
        if self.metrics.degraded:
            log.warning("node readable again; leaving degraded state")
            self.metrics.degraded = False
        assert self.node is not None
        self.busy_now = bool(self.gpus_busy(node))
        if self.busy_now:
            self.last_busy = self.clock()
        facts = topology_facts(node.topo)
        if node.fingerprint != self.node.fingerprint:
            changes = describe_change(self.facts, facts)
            log.warning("topology changed (%s -> %s): %s", self.node.fingerprint, node.fingerprint,
                        "; ".join(changes) or "details unknown")
            self.metrics.topology_changes_total += 1
            self.node, self.facts = node, facts
            self._update_node_metrics()
            self._refresh_tuning_fingerprint()
            self.need_sweep = "topology changed"
            try:
                self.republish_safe("topology changed: " + "; ".join(changes[:3]))
            except NccltuneError as exc:
                # The sweep (still scheduled) publishes for the new topology; until then the
                # old files stay, which the log and `nccltune doctor` flag as stale.
                log.error("cannot republish a safe environment: %s", exc)
        else:
            self.node, self.facts = node, facts
        self._check_nccl_library()
        self.status(self._idle_status())

    def _check_nccl_library(self) -> None:
        lib = self.nccl.get("nccl_lib")
        if not lib:
            return
        try:
            st = os.stat(lib)
            now = [st.st_size, int(st.st_mtime)]
        except OSError:
            now = None
        if now != self.nccl.get("nccl_lib_stat"):
            old = self.nccl.get("nccl_version")
            self.nccl = self._probe_nccl()
            self.metrics.nccl_version = self.nccl.get("nccl_version")
            log.warning("NCCL library %s changed (version %s -> %s)", lib, old, self.nccl.get("nccl_version"))
            self._refresh_tuning_fingerprint()
            self.need_sweep = "NCCL changed"

    def _degraded(self, why: str) -> None:
        if not self.metrics.degraded:
            log.error("degraded: %s; keeping the last published files", why)
        self.metrics.degraded = True
        self.status(f"degraded: {why}")

    def _idle_status(self) -> str:
        if self.need_sweep:
            return f"idle, sweep pending ({self.need_sweep})"
        return "idle"

    def may_sweep_now(self) -> str | None:
        """None if a sweep may start now, else why not."""
        if self.metrics.degraded:
            return "degraded"
        if self.busy_now:
            return "GPUs in use"
        quiet = self.cfg.daemon.quiet_period_s
        idle_for = self.clock() - self.last_busy
        if idle_for < quiet:
            return f"GPUs busy within the last {quiet:g} s"
        if not self.cfg.daemon.in_window(self.wall_clock().time()):
            return f"outside the maintenance window {self.cfg.daemon.maintenance_window}"
        return None

    def maybe_sweep(self) -> None:
        if not self.need_sweep:
            return
        blocked = self.may_sweep_now()
        if blocked:
            log.info("sweep pending (%s) but not now: %s", self.need_sweep, blocked)
            return
        self.sweep()

    def _abort_check(self) -> str | None:
        self.ping()
        if self.stop_requested:
            return "the service is stopping"
        now = self.clock()
        if now - self._last_abort_check < ABORT_CHECK_EVERY_S:
            return None
        self._last_abort_check = now
        try:
            node = self.node if self.node is not None and self.node.demo else load_node(self.cfg, self.opts.demo)
        except Exception:  # judged at the next poll (degraded state)
            return None
        busy = self.gpus_busy(node)
        self.busy_now = bool(busy)
        if busy:
            self.last_busy = now
            return f"a job started on the GPUs (pid {', '.join(map(str, busy))})"
        return None

    def _progress(self, seq: int, total: int, phase: str, label: str, result: Any) -> None:
        if result is None:
            self.status(f"sweeping {seq}/{total}: {phase} {label}")
        else:
            log.info("trial %d/%d %s %s: %s%s", seq, total, phase, label, result.status,
                     f" ({result.reason})" if result.reason else "")
        self.ping()

    def sweep(self) -> None:
        why = self.need_sweep
        log.info("sweeping: %s", why)
        self.metrics.sweeps_total += 1
        started = time.time()
        try:
            pipe = SweepPipeline(self.cfg, demo=self.opts.demo, progress=self._progress,
                                 abort_check=self._abort_check, python=self.opts.python)
            report = pipe.run()
        except TrialAborted as exc:
            log.warning("sweep stopped: %s; the published files are unchanged", exc)
            self.metrics.last_sweep_success = False
            self.status(self._idle_status())
            return
        except BusyError as exc:
            log.warning("sweep not started: %s", exc)
            self.metrics.sweeps_total -= 1  # counted as started above, but nothing ran
            self.status(self._idle_status())
            return
        except NccltuneError as exc:
            log.error("sweep failed: %s; the published files are unchanged", exc)
            self.metrics.last_sweep_success = False
            self.need_sweep = None  # retried after the next change or verify failure, not in a loop
            self.status(self._idle_status())
            return
        except Exception:
            # A bug or an OS error inside the pipeline must not end the service: the published
            # files are still good, and a restart would only re-run the same sweep into the error.
            log.exception("sweep failed unexpectedly; the published files are unchanged")
            self.metrics.last_sweep_success = False
            self.need_sweep = None
            self.status(self._idle_status())
            return
        self.need_sweep = None
        self.metrics.last_sweep_ts = time.time()
        self.metrics.last_sweep_duration_s = self.metrics.last_sweep_ts - started
        self.metrics.last_sweep_success = True
        self.metrics.published_generation = report.published.generation if report.published else None
        self.metrics.nccl_version = report.nccl_version or self.metrics.nccl_version
        self.metrics.busbw = {}
        for row in report.rows:
            self.metrics.busbw[(row["size_bytes"], "default")] = row["default_busbw_gbps"]
            self.metrics.busbw[(row["size_bytes"], "published")] = row["tuned_busbw_gbps"]
        log.info("sweep done in %.0f s: %s", report.wall_s, report.summary)
        self._refresh_tuning_fingerprint()
        self.verify_due = True
        self.status("idle")

    def maybe_verify(self) -> None:
        due = self.verify_due or self.clock() - self.last_verify >= self.cfg.daemon.verify_interval_s
        if not due or self.need_sweep or self.may_sweep_now():
            return
        self.verify_due = False
        self.last_verify = self.clock()
        self.status("verifying")
        try:
            result = run_verify(self.cfg, demo=self.opts.demo, python=self.opts.python, node=self.node,
                                abort_check=self._abort_check)
        except (TrialAborted, BusyError) as exc:
            log.info("verify skipped: %s", exc)
            self.status(self._idle_status())
            return
        except NccltuneError as exc:
            log.warning("verify could not run: %s", exc)
            self.status(self._idle_status())
            return
        self.metrics.last_verify_ts = time.time()
        self.metrics.last_verify_success = result.passed
        self.metrics.verify_drift = {r.size_bytes: (r.drift_pct or 0.0) / 100.0 for r in result.rows
                                     if r.drift_pct is not None}
        if result.passed:
            log.info("verify passed (%s)", result.expectation)
        else:
            log.warning("verify: bus bandwidth drifted: %s; scheduling a re-sweep", result.reason)
            self.need_sweep = "verify found drift"
        self.status(self._idle_status())

    def _update_node_metrics(self) -> None:
        assert self.node is not None
        self.metrics.fingerprint = self.node.fingerprint
        self.metrics.gpus = len(self.node.topo.gpus)
        self.metrics.driver_version = self.node.topo.driver_version

    def write_metrics(self) -> None:
        directory = self.cfg.metrics_dir
        if directory is None or self.node is None:
            return
        try:
            findings = diagnose(self.node.topo, self.node.paths, env=dict(os.environ),
                                publish_dir=self.cfg.publish_dir, conf_files=default_conf_files(os.environ))
            self.metrics.doctor = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
            write_metrics(directory, self.metrics)
        except (OSError, NccltuneError) as exc:
            log.warning("cannot write metrics to %s: %s", directory, exc)


def _own_descendants() -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()
