"""`nccltune daemon`: the service loop that carries out the scheduler's decisions.

Start-up: load and validate the config (exit 78, so systemd does not loop), take the daemon
lock (exit 75 when another daemon has it), remove what writers killed mid-write left (their
temp files), open the history (a corrupt one is moved aside),
read the node and the worker's NCCL, regenerate ncclTopology.xml, apply the class profile at
profile.path (if any), check what is published, notify READY. Then, until SIGTERM: wait as the
scheduler says, reload the config after SIGHUP (the old one is kept when the new one is
invalid), poll the watcher and act on its events (a changed topology republishes a safe
environment at once and schedules a sweep, or re-applies the class profile when the node is
still of its class), look at profile.path again, do what the scheduler decides (sweep, verify),
write the metrics and the heartbeat. The watchdog is pinged (and the heartbeat rewritten) while
waiting and between trials; during a sweep or a verification a job that takes the GPUs stops
the trials (workers killed, last published files kept).

The class profile: a valid one (for this node's class, these versions, publishable) is applied
when it is not what is published, at start, on reload, when its file changes and after the
node changes; while it is in force the daemon does not sweep (scheduler), and its verify
compares the node with the class (verify.py). One that is refused is logged with the reason,
counted in the metrics, and changes nothing: the node keeps what it had (a profile applied
before stays in force as long as it still fits the node). A profile of this node's kind made
under other NCCL or driver versions (an upgrade) is not refused: the node serves its safe part
(fleet/upgrade.py), never a choice of its own, and verifies nothing until the class has a profile
for its versions; on the class's canary alone the daemon sweeps once, narrowed to the profile's
values, and logs the upgrade gate's verdict by the rule of docs/upgrades.md.

Both clocks are injected: monotonic seconds for intervals, local wall time for the
maintenance window and for the timestamps in metrics and provenance.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import __version__
from ..errors import BusyError, InputError, NccltuneError
from ..fleet.gate import GateReading
from ..fleet.upgrade import upgrade_outcome
from . import actions, scheduler
from . import profile as safe
from .actions import Config, LiveState, LoadedProfile, NcclInfo, Node, ProfileRefused, SweepLock, TrialAborted
from .profile import ProfileStatus, SafePart, Stamp, stamp_of
from .scheduler import Action, Decision
from .sdnotify import Notifier, watchdog_interval_s
from .watcher import (
    ConfigRejected,
    Event,
    GpusBusy,
    GpusIdle,
    NcclChanged,
    NodeReadable,
    NodeUnreadable,
    TopologyChanged,
    Watcher,
    gpu_users,
)

log = logging.getLogger(__name__)

# How often, at most, trials ask whether a job has taken the GPUs.
ABORT_CHECK_EVERY_S = 2.0
# How often, at least, the heartbeat file is rewritten, in waits and during trials as well as at
# every poll: far within the probe's limit (deploy/kubernetes, 600 s) whatever the poll interval.
HEARTBEAT_EVERY_S = 30.0

NodeLoader = Callable[[Config, str | bool | None], Node]
NcclProbe = Callable[[Config, str | None], NcclInfo]
# What a publish of the class profile or of its safe part answers (its generation).
_Generation = TypeVar("_Generation")


@dataclass(frozen=True)
class _NotPublished:
    """A publish that could not happen now: `answer` is what the look at profile.path returns
    (True: a profile, or its safe part, is in force)."""

    answer: bool


@dataclass
class LiveCounters:
    """What the daemon process alone knows for its metrics; the rest comes from the history."""

    degraded: bool = False
    nccl_version: str | None = None
    topology_changes_total: int = 0


def release_memory() -> None:
    """Hand back to the kernel what a sweep or verify left free in the heap: the idle daemon should
    hold only what it needs between them (parsed results, the store's pages and the like are freed
    by then, but glibc keeps freed arenas mapped). Elsewhere than glibc, only the collection runs."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


@dataclass
class DaemonOptions:
    config_path: Path | None
    overrides: dict[str, object]
    demo: str | bool | None = None
    python: str | None = None
    max_polls: int | None = None  # stop after this many polls (bring-up scripts and tests)
    poll_interval_s: float | None = None


def policy_of(cfg: Config, poll_interval_s: float | None = None) -> scheduler.Policy:
    """The scheduling settings of a configuration; `poll_interval_s` (from the CLI) wins."""
    d = cfg.daemon
    return scheduler.Policy(poll_interval_s=poll_interval_s or d.poll_interval_s, quiet_period_s=d.quiet_period_s,
                            verify_interval_s=d.verify_interval_s, sweep_on_start=d.sweep_on_start,
                            window=d.window, window_text=d.maintenance_window)


class Daemon:
    """The node service. `run()` is the whole life; the other public methods are its steps.

    node_loader and nccl_probe default to the real node and the worker's real NCCL; they are
    injectable for callers that bring their own readings.
    """

    def __init__(self, opts: DaemonOptions, notifier: Notifier | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], _dt.datetime] = _dt.datetime.now, *,
                 node_loader: NodeLoader = actions.read_node,
                 nccl_probe: NcclProbe = actions.probe_worker_nccl) -> None:
        self.opts = opts
        self.notifier = notifier or Notifier()
        self.clock = clock
        self.wall_clock = wall_clock  # local time, naive, as datetime.now() gives it
        self.cfg = actions.read_config(opts.config_path, opts.overrides)
        self.metrics = LiveCounters()
        self.watcher = Watcher(
            load_node=lambda: node_loader(self.cfg, opts.demo),
            probe_nccl=lambda: nccl_probe(self.cfg, opts.python),
            gpu_users=self.gpus_busy,
            load_config=lambda: actions.read_config(opts.config_path, opts.overrides),
        )
        self.state = scheduler.State(last_verify_s=clock())
        self.tuning_fp: str | None = None
        self.status_text = "starting"
        self.busy_processes = 0  # compute processes of others on the GPUs, as last seen
        self.wake = threading.Event()
        self.stop_requested = False
        self.reload_requested = False
        self.watchdog_s = watchdog_interval_s()
        self._last_ping_s = 0.0
        self._last_busy_check_s = 0.0
        self._last_beat_s: float | None = None
        self._lock: SweepLock | None = None
        # The class profile at profile.path: the last look, its file's stamp, the one in force.
        self.profile = ProfileStatus("absent")
        self.profile_in_force: LoadedProfile | None = None
        self._profile_stamp: Stamp | None = None
        self._profile_logged: tuple[str | None, str | None] | None = None
        # After an upgrade: the profile whose safe part is served, and what the canary measured.
        self.safe_part: SafePart | None = None
        self.canary_outcome: str | None = None
        self._safe_stamp: Stamp | None = None  # of the file whose safe part is served
        self._part_before = False  # a safe part was served when the last look began

    # -- readings ---------------------------------------------------------------------------------

    @property
    def policy(self) -> scheduler.Policy:
        return policy_of(self.cfg, self.opts.poll_interval_s)

    def now(self) -> scheduler.Now:
        return scheduler.Now(self.clock(), self.wall_clock().time())

    def _epoch_s(self) -> float:
        return self.wall_clock().timestamp()

    def gpus_busy(self, node: Node) -> list[int]:
        """Compute processes on the node's GPUs that are not this daemon's own trial ranks."""
        return gpu_users(node, state_dir=Path(self.cfg.state_dir), snapshot=self.cfg.topology.snapshot)

    def decide(self) -> Decision:
        return scheduler.decide(self.state, self.policy, self.now())

    # -- notify, watchdog, signals ----------------------------------------------------------------

    def status(self, text: str) -> None:
        if text != self.status_text:
            self.notifier.status(text)
        self.status_text = text

    def _idle_status(self) -> str:
        if self.state.one_gpu:
            return f"idle, {scheduler.ONE_GPU_WAIT}"
        if self.state.safe_part:
            return f"idle, safe part of class profile {self.state.profile} after an upgrade"
        if self.state.profile is not None:
            return f"idle, class profile {self.state.profile} in force"
        if self.state.sweep_pending:
            return f"idle, sweep pending ({self.state.sweep_pending})"
        return "idle"

    def ping(self) -> None:
        if self.watchdog_s and self.clock() - self._last_ping_s >= self.watchdog_s / 2:
            self.notifier.watchdog()
            self._last_ping_s = self.clock()
        if self._last_beat_s is not None and self.clock() - self._last_beat_s >= HEARTBEAT_EVERY_S:
            self.beat()

    def beat(self) -> None:
        """Rewrite the heartbeat file (time, pid, state); a failure is logged, never fatal."""
        self._last_beat_s = self.clock()
        try:
            actions.write_heartbeat(Path(self.cfg.state_dir), state=self._metrics_state(), pid=os.getpid(),
                                    now=self._epoch_s())
        except NccltuneError as exc:
            log.warning("cannot write the heartbeat: %s", exc)

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

    def _sleep(self, seconds: float) -> None:
        """Wait, pinging the watchdog; a signal ends the wait early."""
        end = self.clock() + seconds
        while not self.stop_requested and not self.reload_requested:
            left = end - self.clock()
            if left <= 0:
                return
            self.wake.wait(min(left, HEARTBEAT_EVERY_S, self.watchdog_s / 2 if self.watchdog_s else left))
            self.wake.clear()
            self.ping()

    # -- the life ---------------------------------------------------------------------------------

    def run(self) -> int:
        self.install_signals()
        try:
            self.start()
            wait = scheduler.first_wait(self.state, self.policy)
            polls = 0
            while not self.stop_requested:
                self._sleep(wait.wait_s)
                if self.stop_requested:
                    break
                if self.reload_requested:
                    self.reload()
                self.poll()
                wait = self.act()
                self.write_metrics()
                polls += 1
                if self.opts.max_polls is not None and polls >= self.opts.max_polls:
                    log.info("stopping after %d poll(s) as asked", polls)
                    break
            # Asked to stop (SIGTERM, max_polls): the last write says so, and the heartbeat's age no
            # longer means a stall. After an error it stays "stopping", as a stall would look.
            self.status_text = "stopped"
        finally:
            self.notifier.stopping("stopping")
            if self.status_text != "stopped":
                self.status_text = "stopping"
            self.write_metrics()
            self.close()
        return 0

    def close(self) -> None:
        """Release the daemon lock (start() took it)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def start(self) -> None:
        state_dir = Path(self.cfg.state_dir)
        actions.prepare_state_dir(state_dir)
        self._lock = actions.daemon_lock(state_dir)
        actions.remove_leftover_temps(self.cfg)
        actions.open_history(state_dir)
        self.watcher.start()
        node = self.watcher.node
        self.metrics.nccl_version = self.watcher.nccl.version
        self._update_node_metrics()
        self._refresh_tuning_fingerprint()
        actions.refresh_topology_file(self.cfg, node)
        self.sync_profile(force=True)
        self.check_published()
        self.status(self._idle_status())
        self.beat()
        self.notifier.ready(self.status_text)
        log.info("nccltune %s daemon ready: %d GPU(s), fingerprint %s, NCCL %s%s", __version__,
                 len(node.topo.gpus), node.fingerprint, self.watcher.nccl.version or "n/a",
                 " (CPU demo)" if node.demo else "")

    def reload(self) -> None:
        self.reload_requested = False
        self.notifier.reloading("reloading configuration")
        event = self.watcher.reload_config()
        if isinstance(event, ConfigRejected):
            log.error("new configuration is invalid, keeping the old one: %s", event.why)
            self.notifier.ready(self.status_text)
            return
        self.cfg = event.cfg
        log.info("configuration reloaded")
        if self.watcher.started:
            self._refresh_tuning_fingerprint()
            # New sweep settings make the published tuning stale, as they do at start-up; a class
            # profile (perhaps another profile.path) is re-read and re-applied for them.
            try:
                self.sync_profile(force=True)
                self.check_published()
            except NccltuneError as exc:  # a failed safe republish: the config itself is fine
                log.error("cannot republish a safe environment: %s", exc)
            self.status(self._idle_status() if not self.state.degraded else self.status_text)
        self.notifier.ready(self.status_text)

    def check_published(self) -> None:
        """Schedule a sweep unless a tuning for this topology and these settings is published (or
        a class profile is in force: sync_profile keeps that published)."""
        if self.state.profile is not None:
            return
        node = self.watcher.node
        published = actions.read_published_state(self.cfg.publish_dir)
        why: str | None = None
        if published.unreadable is not None:
            # The sweep replaces it (publishing tolerates a corrupt nccl.json); exit 78 here would
            # keep systemd from restarting the service at all.
            log.error("the published files cannot be read: %s", published.unreadable)
            why = "the published files cannot be read"
        elif not published.exists:
            why = "nothing is published yet"
        elif published.topology_fingerprint != node.fingerprint:
            why = "the published tuning is for another topology"
            self.state = scheduler.sweep_needed(self.state, why)
            self.republish_safe("the published tuning was measured on another topology")
        elif published.tuning_fingerprint != self.tuning_fp:
            why = "NCCL, nccltune or the sweep settings changed since the published tuning"
        elif published.state == "safe":
            why = "only a safe environment is published"
        if why is not None and self.state.one_gpu:
            # No sweep will come: what fits every job (topology file, policy) is all there is.
            if not published.exists or published.unreadable is not None:
                # The one-GPU node's normal outcome, as `nccltune sweep` there publishes it: no warning.
                self.republish_safe(scheduler.ONE_GPU_WAIT, expected=published.unreadable is None)
            return
        if why is not None:
            self.state = scheduler.sweep_needed(self.state, why)

    def republish_safe(self, why: str, *, expected: bool = False) -> None:
        """Publish what fits every job (topology file, policy, pins). `expected`: the node's normal
        state (one GPU, nothing published yet), said as information rather than a warning."""
        generation = actions.republish_safe(self.cfg, self.watcher.node, self.watcher.nccl, why, self.wall_clock())
        if expected:
            log.info("published what fits every job (generation %d): %s", generation, why)
        else:
            log.warning("republished a safe environment (generation %d): %s", generation, why)

    # -- the class profile ------------------------------------------------------------------------

    def sync_profile(self, *, force: bool) -> bool:
        """Look at profile.path and keep a valid class profile published; True when one is in force.

        Unless `force` (start, reload, a change of the node or of NCCL), the file is read only when
        its stamp changed since the last look.
        """
        path = self.cfg.profile_path
        was = self.profile_in_force
        self._part_before = self.safe_part is not None
        if path is None:
            self.profile, self.profile_in_force, self._profile_stamp = ProfileStatus("absent"), None, None
            self.safe_part = None
            if was is not None:
                log.warning("profile.path is no longer set: %s is not kept in force any more", was.path)
            return self._profile_settled(was)
        node, nccl = self.watcher.node, self.watcher.nccl
        stamp = stamp_of(actions.profile_file_for(path, self.cfg, node, nccl))
        part = self.safe_part
        if not force and stamp == self._profile_stamp and part is not None:
            # The safe part's own file is looked at too: in a directory it is not the file of
            # this node's class id, which is the one the stamp above follows.
            if stamp_of(part.upgraded.loaded.path) == self._safe_stamp:
                if safe.safe_part_in_place(self.cfg, node, part):
                    return True
                log.warning("the published files no longer carry the safe part of %s: serving it again", part.name)
                return self._serve_safe_part(path, part)
        elif not force and stamp == self._profile_stamp:
            kept = self.profile_in_force
            if kept is None or actions.read_published_state(self.cfg.publish_dir).class_profile_sha256 == kept.sha256:
                return kept is not None
            # Something else published here (a `nccltune sweep` or `apply` by hand): the configured
            # profile is the class's decision, and goes back in force.
            log.warning("the published files no longer carry the class profile %s: applying it again", kept.path)
        self._profile_stamp = stamp
        try:
            loaded = actions.load_class_profile(path, self.cfg, node, nccl)
        except ProfileRefused as exc:
            part = self._upgraded(path) if exc.code in ("stale", "missing") else None
            if part is not None:
                return self._serve_safe_part(path, part)
            self._profile_refused(path, exc)
            return self._profile_settled(was)
        published = actions.read_published_state(self.cfg.publish_dir)
        if not (published.class_profile_sha256 == loaded.sha256 and published.tuning_fingerprint == self.tuning_fp
                and published.topology_fingerprint == node.fingerprint and published.decided):
            generation = self._publish_or_wait(
                path, f"the class profile {loaded.path}", was, self.profile_in_force is not None,
                lambda: actions.publish_class_profile(self.cfg, node, nccl, loaded, self.wall_clock()))
            if isinstance(generation, _NotPublished):
                return generation.answer
            log.info("applied %s: generation %d", loaded.note, generation)
        self.profile = ProfileStatus("in_force", str(loaded.path))
        self.profile_in_force, self.safe_part = loaded, None
        self._profile_logged = None
        return self._profile_settled(was)

    def _publish_or_wait(self, path: Path, what: str, was: LoadedProfile | None, in_force: bool,
                         publish: Callable[[], _Generation]) -> _Generation | _NotPublished:
        """`publish()`'s answer, or what this look at profile.path answers when it cannot publish
        `what` (the profile at `path`, or its safe part) now. `was`: what was in force before the
        look; `in_force`: whether something of the profile is in force now."""
        try:
            return publish()
        except InputError as exc:  # a config pin that cannot go with it: refused, as apply refuses it
            self._profile_refused(path, ProfileRefused.wrapping(exc, "unsafe"))
            return _NotPublished(self._profile_settled(was))
        except NccltuneError as exc:  # busy or a full disk: the next poll tries again
            log.error("cannot publish %s now: %s; keeping what is published", what, exc)
            self._profile_stamp = None
            return _NotPublished(in_force)

    # -- after an upgrade: the safe part, the canary ----------------------------------------------

    def _upgraded(self, path: Path) -> SafePart | None:
        """The profile at `path` of this node's kind under other versions, or None (then the
        refusal at hand stands)."""
        try:
            return safe.find_safe_part(path, self.cfg, self.watcher.node, self.watcher.nccl)
        except ProfileRefused:
            return None

    def _serve_safe_part(self, path: Path, part: SafePart) -> bool:
        """Publish `part`'s safe part (unless published) and tell the scheduler; True: it is served."""
        was, node, nccl = self.profile_in_force, self.watcher.node, self.watcher.nccl
        changes = "; ".join(part.upgraded.changes)
        generation = self._publish_or_wait(
            path, f"the safe part of {part.name}", was, self.safe_part is not None,
            lambda: safe.publish_safe_part(self.cfg, node, nccl, part, self.wall_clock()))
        if isinstance(generation, _NotPublished):
            return generation.answer
        if generation is not None:
            role = ("this node is the class's canary: it re-measures the profile's values under the new versions"
                    if part.canary else f"the class's canary {part.upgraded.canary or '(none in the profile)'} "
                    "re-measures; this node waits for the class's profile for its versions")
            log.warning("class profile %s was measured under other versions (%s): serving its safe part "
                        "(generation %d), not a choice of this node's own; %s", part.name, changes, generation, role)
        self.profile = ProfileStatus("safe_part", str(part.upgraded.loaded.path), None, changes)
        self.profile_in_force, self.safe_part = None, part
        self._safe_stamp = stamp_of(part.upgraded.loaded.path)
        self._profile_logged = None
        return self._profile_settled(was)

    def _canary_sweep(self, part: SafePart) -> str | None:
        """Why the canary sweeps now, or None: not the canary, or it has re-measured (then the
        gate's verdict is logged once)."""
        if not part.canary:
            self.canary_outcome = None
            return None
        try:
            measured = safe.canary_gate(self.cfg, self.watcher.node, self.watcher.nccl)
        except (OSError, NccltuneError) as exc:
            log.error("cannot read the history for the canary's measurement: %s", exc)
            return None
        if measured is None:
            return f"canary: re-measure class profile {part.name} under the new versions"
        self._canary_verdict(part, *measured)
        return None

    def _canary_verdict(self, part: SafePart, run_id: int, gate: GateReading | None) -> None:
        outcome, why = upgrade_outcome(gate, None)
        if outcome != self.canary_outcome:
            level = logging.INFO if outcome == "keep" else logging.WARNING
            log.log(level, "canary run %d against class profile %s: %s (%s); `nccltune export` and `nccltune fleet "
                    "decide` of this node make the class's profile for these versions", run_id, part.name,
                    {"keep": "the old profile holds", "safe": "the safe part stays"}.get(outcome, outcome), why)
        self.canary_outcome = outcome

    def _profile_refused(self, path: Path, exc: ProfileRefused) -> None:
        self.safe_part = None
        state = "absent" if exc.code == "missing" else "refused"
        self.profile = ProfileStatus(state, str(path), exc.code, str(exc))
        if self._profile_logged != (exc.code, str(exc)):
            self._profile_logged = (exc.code, str(exc))
            if state == "absent":
                log.info("no class profile for this node at %s: %s", path, exc.message)
            else:
                log.error("class profile refused (%s), keeping what is published: %s", exc.code, exc)
        self._keep_if_valid()

    def _keep_if_valid(self) -> None:
        """After a refusal: the profile applied before stays in force while it still fits the node."""
        kept = self.profile_in_force
        if kept is None:
            return
        why = actions.profile_still_valid(kept, self.cfg, self.watcher.node, self.watcher.nccl)
        if why is not None:
            log.warning("the class profile in force (%s) no longer fits this node: %s", kept.path, why.message)
            self.profile_in_force = None
        elif self.profile.state == "absent":
            log.warning("%s is gone; the class profile applied from it stays published and in force", kept.path)

    def _profile_settled(self, was: LoadedProfile | None) -> bool:
        """Tell the scheduler; when the node falls back to its own decisions, schedule what the
        published files need (check_published)."""
        now, part = self.profile_in_force, self.safe_part
        if now is None and part is not None:
            self.state = scheduler.safe_part_in_force(self.state, part.name, self._canary_sweep(part))
            return True
        self.canary_outcome = None
        self.state = scheduler.profile_in_force(self.state, now.path.name if now is not None else None)
        if (was is not None or self._part_before) and now is None:
            log.warning("no class profile in force any more: the daemon decides for this node again")
            self.check_published()
        return now is not None

    # -- one poll ---------------------------------------------------------------------------------

    def poll(self) -> None:
        self.state = scheduler.polled(self.state)
        for event in self.watcher.poll():
            self._on_event(event)
        if not self.state.degraded:
            try:
                self.sync_profile(force=False)
            except NccltuneError as exc:  # the node or the publish directory: the next poll tries again
                log.error("cannot check the class profile: %s", exc)
            self.status(self._idle_status())
        self.beat()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, NodeUnreadable):
            if not self.state.degraded:
                log.error("degraded: %s; keeping the last published files", event.why)
            self.state = scheduler.node_readable(self.state, False)
            self.metrics.degraded = True
            self.status(f"degraded: {event.why}")
        elif isinstance(event, NodeReadable):
            log.warning("node readable again; leaving degraded state")
            self.state = scheduler.node_readable(self.state, True)
            self.metrics.degraded = False
        elif isinstance(event, (GpusBusy, GpusIdle)):
            self.busy_processes = len(event.pids) if isinstance(event, GpusBusy) else 0
            self.state = scheduler.gpus_seen(self.state, isinstance(event, GpusBusy), self.clock())
        elif isinstance(event, TopologyChanged):
            log.warning("topology changed (%s -> %s): %s", event.old_fingerprint, event.new_fingerprint,
                        "; ".join(event.changes) or "details unknown")
            self.metrics.topology_changes_total += 1
            self._update_node_metrics()
            self._refresh_tuning_fingerprint()
            had_profile = self.profile_in_force is not None
            if self.sync_profile(force=True):
                log.warning("the node is still of the class of its profile: re-applied it for the new topology")
                return
            if had_profile:
                return  # the profile left: check_published has republished and scheduled for the new topology
            self.state = scheduler.sweep_needed(self.state, "topology changed")
            try:
                self.republish_safe("topology changed: " + "; ".join(event.changes[:3]))
            except NccltuneError as exc:
                # The sweep (still scheduled) publishes for the new topology; until then the
                # old files stay, which the log and `nccltune doctor` flag as stale.
                log.error("cannot republish a safe environment: %s", exc)
        elif isinstance(event, NcclChanged):
            self.metrics.nccl_version = event.new_version
            log.warning("NCCL library %s changed (version %s -> %s)", event.library, event.old_version,
                        event.new_version)
            self._refresh_tuning_fingerprint()
            if not self.sync_profile(force=True):
                self.state = scheduler.sweep_needed(self.state, "NCCL changed")

    def act(self) -> Decision:
        """Carry out the scheduler's decisions for this poll; returns the final one (a wait)."""
        decision = self.decide()
        if decision.sweep_pending is not None:
            log.info("sweep pending (%s) but not now: %s", decision.sweep_pending, decision.reason)
        worked = False
        while decision.action is not Action.WAIT:
            if decision.action is Action.SWEEP:
                self.sweep(decision.reason)
            else:
                self.verify()
            worked = True
            decision = self.decide()
        if worked:
            release_memory()
        log.debug("next poll in %.3g s: %s", decision.wait_s, decision.reason)
        return decision

    # -- trials -----------------------------------------------------------------------------------

    def abort_check(self) -> str | None:
        """Asked between and during trials: a reason to stop them, or None."""
        self.ping()
        if self.stop_requested:
            return "the service is stopping"
        now_s = self.clock()
        if now_s - self._last_busy_check_s < ABORT_CHECK_EVERY_S:
            return None
        self._last_busy_check_s = now_s
        seen = self.watcher.check_busy()
        if seen is None:
            return None
        self.state = scheduler.gpus_seen(self.state, isinstance(seen, GpusBusy), now_s)
        if isinstance(seen, GpusBusy):
            return f"a job started on the GPUs (pid {', '.join(map(str, seen.pids))})"
        return None

    def _progress(self, seq: int, total: int, phase: str, label: str, result: Any) -> None:
        if result is None:
            self.status(f"sweeping {seq}/{total}: {phase} {label}")
        else:
            log.info("trial %d/%d %s %s: %s%s", seq, total, phase, label, result.status,
                     f" ({result.reason})" if result.reason else "")
        self.ping()

    def sweep(self, why: str) -> None:
        log.info("sweeping: %s", why)
        part = self.safe_part if self.safe_part is not None and self.safe_part.canary else None
        try:
            # The canary measures the profile's values against NCCL's new defaults; its result is
            # recorded, not published (the profile's copy is in force with the safe part).
            cfg = safe.canary_config(self.cfg, part) if part is not None else self.cfg
            outcome = actions.run_sweep(cfg, self.opts.demo, self.opts.python, self._progress, self.abort_check)
        except TrialAborted as exc:
            log.warning("sweep stopped: %s; the published files are unchanged", exc)
            self.state = scheduler.sweep_kept_pending(self.state)
            self.status(self._idle_status())
            return
        except BusyError as exc:
            log.warning("sweep not started: %s", exc)
            self.state = scheduler.sweep_kept_pending(self.state)
            self.status(self._idle_status())
            return
        except NccltuneError as exc:
            log.error("sweep failed: %s; the published files are unchanged", exc)
            self.state = scheduler.sweep_failed(self.state)
            self.status(self._idle_status())
            return
        except Exception:
            # A bug or an OS error inside the sweep must not end the service: the published
            # files are still good, and a restart would only re-run the same sweep into the error.
            log.exception("sweep failed unexpectedly; the published files are unchanged")
            self.state = scheduler.sweep_failed(self.state)
            self.status(self._idle_status())
            return
        self.state = scheduler.sweep_done(self.state)
        self.metrics.nccl_version = outcome.nccl_version or self.metrics.nccl_version
        log.info("sweep done in %.0f s (run %s): %s", outcome.wall_s, outcome.run_id, outcome.summary)
        self._refresh_tuning_fingerprint()
        if part is not None:
            self._canary_sweep(part)
        self.status("idle")

    def verify(self) -> None:
        self.state = scheduler.verify_started(self.state, self.clock())
        self.status("verifying")
        try:
            outcome = actions.run_verification(self.cfg, self.opts.demo, self.opts.python, self.watcher.node,
                                               self.abort_check)
        except (TrialAborted, BusyError) as exc:
            log.info("verify skipped: %s", exc)
            self.status(self._idle_status())
            return
        except NccltuneError as exc:
            log.warning("verify could not run: %s", exc)
            self.status(self._idle_status())
            return
        if outcome.passed:
            log.info("verify passed (%s)", outcome.expectation)
        elif outcome.code == "below_class":
            # The node, not the class's decision, is what is wrong: a sweep would change nothing.
            log.warning("verify: this node is below its class beyond noise: %s (see `nccltune doctor`)",
                        outcome.reason)
        elif outcome.code == "not_verifiable":
            # Nothing was found slower: a sweep would measure the same noise again.
            log.warning("verify: %s; no re-sweep for it", outcome.reason)
        elif self.state.profile is not None:
            log.warning("verify failed (%s): %s; a class profile is in force, so no re-sweep", outcome.code,
                        outcome.reason)
        else:
            log.warning("verify: bus bandwidth drifted: %s; scheduling a re-sweep", outcome.reason)
            self.state = scheduler.sweep_needed(self.state, "verify found drift")
        self.status(self._idle_status())

    # -- bookkeeping ------------------------------------------------------------------------------

    def _refresh_tuning_fingerprint(self) -> None:
        self.tuning_fp = actions.tuning_fingerprint_of(self.cfg, self.watcher.node, self.watcher.nccl)

    def _update_node_metrics(self) -> None:
        self.state = scheduler.ranks_counted(self.state, self.watcher.node.nranks)

    def _metrics_state(self) -> str:
        """The daemon's state as the metrics name it (metrics.DAEMON_STATES)."""
        text = self.status_text
        for state in ("starting", "sweeping", "verifying", "stopping", "stopped", "degraded"):
            if text.startswith(state):
                return state
        return "sweep_pending" if self.state.sweep_pending and not self.state.one_gpu else "idle"

    def write_metrics(self) -> None:
        if not self.watcher.started:
            return
        node, configured = self.watcher.node, self.cfg.profile_path is not None
        part = self.safe_part if configured else None
        live = LiveState(state=self._metrics_state(), busy_processes=self.busy_processes, heartbeat_ts=self._epoch_s(),
                         degraded=self.metrics.degraded, gpus=len(node.topo.gpus),
                         driver_version=node.topo.driver_version, nccl_version=self.metrics.nccl_version,
                         topology_changes_total=self.metrics.topology_changes_total,
                         profile_state=self.profile.state if configured else None,
                         profile_refused=self.profile.code if configured and self.profile.state == "refused" else None,
                         upgrade_role=None if part is None else ("canary" if part.canary else "member"),
                         upgrade_outcome=self.canary_outcome if part is not None and part.canary else None)
        actions.write_metrics(self.cfg, node, nccl_version=self.watcher.nccl.version, live=live)
