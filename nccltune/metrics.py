"""node_exporter textfile metrics, built from the stored history, in two files of disjoint series.

`<metrics_dir>/nccltune.prom` holds every series that describes a sweep, a verify or what is
published, read back from the history database (and the published nccl.json), never from what one
process happens to remember: `nccltune sweep`, `nccltune verify` and the daemon all rebuild it whole
from the same history, so whichever wrote last wrote the same file, and the daemon's rewrite at
every poll replaces an older view within a minute. `<metrics_dir>/nccltune-daemon.prom` holds what
only a running daemon knows (`LiveState`: its state, heartbeat, compute processes of others on the
GPUs, doctor's counts, the class profile it watches, degraded) and only the daemon writes it, so a
one-shot command never hides the daemon's series. The textfile collector reads every `*.prom` of
the directory and refuses a series that two files both carry; keeping the two sets of names
disjoint, each file renamed into place whole, needs no lock and no parsing of the other's file.

Names carry the `nccltune_` prefix and base units (bytes per second, seconds, ratios). Every
series carries a `class` label (the node class fingerprint) once one is known, so that fleet
rules can compare a node with the other nodes of its kind. Each exposition is rendered by
prometheus_client from its own registry and written as every file nccltune writes
(files.atomicfile: a temp file of nccltune's name, renamed into place; what a killed writer
left is removed at the next start).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from . import __version__
from .compare import upgrade_check
from .errors import NccltuneError
from .files.atomicfile import atomic_write
from .files.trust import ensure_dir
from .names import DEFAULTS_LABEL
from .publish import read_set
from .store import RunKind, RunRecord, RunStatus, Store

log = logging.getLogger(__name__)

FILENAME = "nccltune.prom"
# What only a running daemon knows; written by the daemon alone.
DAEMON_FILENAME = "nccltune-daemon.prom"
# What a running daemon is doing; `nccltune_daemon_state` has one series per state (1 for the current one).
# "stopped" is the last write of a daemon asked to stop (SIGTERM, a planned `systemctl stop`): its
# heartbeat ages from then on without the daemon being stalled.
DAEMON_STATES = ("starting", "idle", "sweep_pending", "sweeping", "verifying", "degraded", "stopping", "stopped")
SEVERITIES = ("error", "warning", "info")
# The class profile a daemon watches (profile.path): none there for this node, applied, its safe
# part served after an upgrade (fleet/upgrade.py), or refused.
PROFILE_STATES = ("absent", "in_force", "safe_part", "refused")
# While the safe part is served: the node's role in the class's upgrade, and the verdicts of the
# canary's re-measurement by the upgrade rule (fleet.upgrade.upgrade_outcome, without a new profile).
UPGRADE_ROLES = ("canary", "member")
CANARY_OUTCOMES = ("keep", "safe")
_GBPS = 1e9  # GB/s as the store keeps it, to bytes per second
# How many of the newest verifies are read to count the failures in a row: a count this high is
# "at least this many".
VERIFY_FAILURES_SCAN = 64
# What stands for the generation directory in the published values when they are digested: the
# same setting published as generation 3 on one node and 7 on another digests alike.
GENERATION_TOKEN = "${NCCLTUNE_GENERATION_DIR}"


@dataclass(frozen=True)
class LiveState:
    """What only a running daemon knows; everything else comes from the history.

    `heartbeat_ts` is unix time (the write itself), `doctor` counts findings by severity.
    """

    state: str
    busy_processes: int  # compute processes of others on the node's GPUs
    heartbeat_ts: float
    degraded: bool = False
    doctor: Mapping[str, int] | None = None
    gpus: int | None = None
    driver_version: str | None = None
    nccl_version: str | None = None
    topology_changes_total: int = 0
    # With profile.path set: PROFILE_STATES, and why the profile there is refused (a word such as
    # "stale" or "other_class"; fleet.apply.REFUSAL_CODES).
    profile_state: str | None = None
    profile_refused: str | None = None
    # With profile_state "safe_part": UPGRADE_ROLES, and on the canary once it has re-measured,
    # CANARY_OUTCOMES.
    upgrade_role: str | None = None
    upgrade_outcome: str | None = None

    def __post_init__(self) -> None:
        if self.state not in DAEMON_STATES:
            raise ValueError(f"LiveState.state must be one of {', '.join(DAEMON_STATES)}; got {self.state!r}")
        if self.profile_state is not None and self.profile_state not in PROFILE_STATES:
            raise ValueError(f"LiveState.profile_state must be one of {', '.join(PROFILE_STATES)}; "
                             f"got {self.profile_state!r}")
        for name, value, allowed in (("upgrade_role", self.upgrade_role, UPGRADE_ROLES),
                                     ("upgrade_outcome", self.upgrade_outcome, CANARY_OUTCOMES)):
            if value is not None and value not in allowed:
                raise ValueError(f"LiveState.{name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class PublishedInfo:
    """What is in force in the publish directory, as the fleet rules compare it between nodes."""

    generation: int | None
    demo: bool
    state: str  # what is published: publish.setting.PUBLISHED_STATES ("tuned", "defaults", "safe")
    decision: str  # "node" (this node's own sweep) or "class" (a class profile)
    env_digest: str  # same values a job gets (generation directory normalised) <=> same digest, on any node
    # The class profile's identity (the start of its sha256: every node applying the same file
    # has the same); "" for a node-local decision.
    profile_generation: str


@dataclass
class Snapshot:
    """Everything one textfile holds. Sizes in bytes; bandwidths in GB/s (converted on output)."""

    node_class: str = ""
    fingerprint: str = ""
    gpus: int | None = None
    driver_version: str | None = None
    nccl_version: str | None = None
    degraded: bool = False
    last_sweep_ts: float | None = None
    last_sweep_duration_s: float | None = None
    last_sweep_success: bool | None = None
    last_successful_sweep_ts: float | None = None
    # The latest sweep that published or verify that passed: when the published tuning was last
    # shown to be current.
    last_confirmed_ts: float | None = None
    sweeps_total: int = 0
    published: PublishedInfo | None = None
    # (collective, size_bytes, "default"|"published") -> GB/s of the latest ok sweep
    busbw_gbps: dict[tuple[str, int, str], float] = field(default_factory=dict)
    # (collective, size_bytes) -> relative run-to-run noise of the defaults in that sweep
    noise_ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    tuned_ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    last_verify_ts: float | None = None
    last_verify_success: bool | None = None
    # The newest verifies that failed in a row (0 when the latest passed), whatever their cadence.
    verify_consecutive_failures: int | None = None
    # (collective, size_bytes) -> measured/expected - 1, and the drift verify allowed there (positive)
    verify_drift_ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    verify_allowed_drift_ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    # (collective, size_bytes, "default"|"published") -> new over old busbw minus 1, at the sizes the
    # latest ok sweep is slower than the last sweep of the previous NCCL/driver/torch beyond noise
    upgrade_regression: dict[tuple[str, int, str], float] = field(default_factory=dict)
    # The latest verify, when it compared the node with its class (a class profile in force):
    # (collective, size_bytes) -> the node's best run over the class median, and whether it was below.
    class_ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    class_outlier: bool | None = None
    # The latest verify's reading of NCCL's own log (nccl.ran): whether it passed, and each finding's code.
    verify_nccl_ran_passed: bool | None = None
    verify_nccl_ran_codes: tuple[str, ...] = ()
    doctor: Mapping[str, int] | None = None  # severity -> count; None: not known to the writer
    topology_changes_total: int | None = None  # a daemon process's own count
    live: LiveState | None = None


# ---------------------------------------------------------------------------------------------
# From the history


def _unix(iso: str | None) -> float | None:
    return None if iso is None else datetime.fromisoformat(iso).timestamp()


def _latest_finished(store: Store, fingerprint: str, kind: RunKind, statuses: tuple[RunStatus, ...]
                     ) -> RunRecord | None:
    """The most recently started run of this kind that ended with one of these statuses.

    One indexed query per status, not a scan of the history: the daemon writes every poll and
    verify runs pile up. Runs marked interrupted after a crash have no end time and do not count.
    """
    found = [r for st in statuses if (r := store.latest_run(fingerprint, kind=kind, status=st)) is not None
             and r.finished_at is not None]
    return max(found, key=lambda r: (r.started_at, r.id), default=None)


def env_digest(env: Mapping[str, str], single_node_env: Mapping[str, str] | None = None,
               generation_dir: Path | None = None) -> str:
    """A short digest of what a job gets from a published set: nodes that publish the same values
    agree on it. Both parts count (a single-node job gets the second); the generation directory in
    a value (NCCL_TOPO_FILE, the tuner's plugin and table name the generation's own copies) is
    replaced by `GENERATION_TOKEN`, so the generation number and the publish directory do not."""
    def normal(values: Mapping[str, str]) -> dict[str, str]:
        if generation_dir is None:
            return dict(sorted(values.items()))
        prefix = str(generation_dir).rstrip("/") + "/"
        return {k: v.replace(prefix, GENERATION_TOKEN + "/") for k, v in sorted(values.items())}

    doc: object = normal(env) if not single_node_env else {"every_job": normal(env),
                                                           "single_node": normal(single_node_env)}
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:16]


def verify_failures_in_a_row(store: Store, fingerprint: str) -> int | None:
    """How many of this node's newest finished verifies failed in a row (0 when the latest passed;
    None without any); an interrupted verify (a job took the GPUs) neither passes nor fails."""
    statuses = [status for fp, status, finished in store.run_outcomes("verify", VERIFY_FAILURES_SCAN)
                if fp == fingerprint and finished and status in ("ok", "failed")]
    if not statuses:
        return None
    failed = 0
    for status in statuses:
        if status == "ok":
            break
        failed += 1
    return failed


def _published(publish_dir: Path | None, store: Store, fingerprint: str) -> PublishedInfo | None:
    """nccl.json's provenance when it can be read (what launchers get), else the latest ok sweep's."""
    if publish_dir is not None:
        try:
            got = read_set(publish_dir)
        except NccltuneError as exc:
            log.warning("metrics: the published files cannot be read (%s); using the history", exc)
            got = None
        if got is not None:
            prov = got.provenance
            generation = prov.get("generation")
            class_profile = prov.get("class_profile")
            digest = class_profile.get("sha256") if isinstance(class_profile, dict) else None
            return PublishedInfo(
                generation=generation if isinstance(generation, int) and not isinstance(generation, bool) else None,
                demo=prov.get("demo") is True, state=str(prov.get("state") or "tuned"),
                decision="class" if class_profile else "node",
                env_digest=env_digest(got.env, got.single_node_env, got.directory),
                profile_generation=str(digest)[:16] if isinstance(digest, str) else "")
    latest = store.latest_published(fingerprint)
    if latest is None:
        return None
    run = store.run(latest.run_id)
    # The sweep's own record: a run that chose NCCL's defaults (pipeline/choice.py's label) published them.
    chosen = run.sweep_summary.chosen if run is not None else None
    state = "defaults" if chosen == DEFAULTS_LABEL else "tuned"
    return PublishedInfo(generation=latest.generation, demo=bool(run and run.demo), state=state, decision="node",
                         env_digest=env_digest(latest.env), profile_generation="")


def snapshot_from_store(store: Store, *, fingerprint: str, node_class: str | None = None,
                        live: LiveState | None = None, publish_dir: Path | None = None) -> Snapshot:
    """The textfile's content for this node (`fingerprint`) from its history, plus `live` values."""
    snap = Snapshot(node_class=node_class or "", fingerprint=fingerprint, live=live,
                    degraded=live.degraded if live is not None else False)
    snap.sweeps_total = store.run_count("sweep")
    last = _latest_finished(store, fingerprint, "sweep", ("ok", "failed", "interrupted"))
    if last is not None:
        snap.last_sweep_ts = _unix(last.finished_at)
        started = _unix(last.started_at)
        if snap.last_sweep_ts is not None and started is not None:
            snap.last_sweep_duration_s = round(snap.last_sweep_ts - started, 3)
        snap.last_sweep_success = last.status == "ok"
    ok = _latest_finished(store, fingerprint, "sweep", ("ok",))
    newest = store.latest_run(fingerprint, kind="sweep", status=None)
    if newest is not None:
        snap.driver_version = newest.driver_version
        gpus = newest.topology.get("gpus")
        snap.gpus = gpus if isinstance(gpus, int) else None
    if ok is not None:
        snap.last_successful_sweep_ts = _unix(ok.finished_at)
        snap.nccl_version = ok.sweep_summary.nccl_version or ok.nccl_version
        for row in ok.rows:
            key = (row.collective, row.size_bytes)
            snap.busbw_gbps[(row.collective, row.size_bytes, "default")] = row.default_busbw_gbps
            snap.busbw_gbps[(row.collective, row.size_bytes, "published")] = row.tuned_busbw_gbps
            snap.noise_ratio[key] = round(row.default_noise_pct / 100.0, 6)
            snap.tuned_ratio[key] = row.ratio
        snap.upgrade_regression = upgrade_regressions(store, ok)
    verify = _latest_finished(store, fingerprint, "verify", ("ok", "failed"))
    if verify is not None:
        snap.last_verify_ts = _unix(verify.finished_at)
        snap.last_verify_success = verify.status == "ok"
        snap.verify_consecutive_failures = verify_failures_in_a_row(store, fingerprint)
        verified = verify.verify_summary
        for checked in verified.rows or ():
            key = (checked.collective, checked.size_bytes)
            if not checked.verifiable:
                continue  # verify left it out: its noise allows a drop no measurement can show
            if checked.drift_pct is not None:
                snap.verify_drift_ratio[key] = round(checked.drift_pct / 100.0, 6)
            if checked.allowed_pct is not None:
                snap.verify_allowed_drift_ratio[key] = round(checked.allowed_pct / 100.0, 6)
        if verified.reference == "class":
            # The rows compared with the class carry its median as their expectation.
            for checked in verified.rows or ():
                if checked.measured_gbps is not None and checked.expected_gbps:
                    snap.class_ratio[(checked.collective, checked.size_bytes)] = round(
                        checked.measured_gbps / checked.expected_gbps, 6)
            snap.class_outlier = verified.code == "below_class"
        ran = verified.nccl_ran
        if ran is not None:
            snap.verify_nccl_ran_passed = bool(ran.get("passed"))
            snap.verify_nccl_ran_codes = tuple(sorted({str(f.get("code")) for f in ran.get("findings", [])}))
    passed = _latest_finished(store, fingerprint, "verify", ("ok",))
    confirmed = [t for t in (snap.last_successful_sweep_ts, _unix(passed.finished_at) if passed else None)
                 if t is not None]
    snap.last_confirmed_ts = max(confirmed, default=None)
    snap.published = _published(publish_dir, store, fingerprint)
    if live is not None:
        snap.doctor = live.doctor
        snap.topology_changes_total = live.topology_changes_total
        snap.gpus = live.gpus if live.gpus is not None else snap.gpus
        snap.driver_version = live.driver_version or snap.driver_version
        snap.nccl_version = live.nccl_version or snap.nccl_version
    return snap


def upgrade_regressions(store: Store, run: RunRecord) -> dict[tuple[str, int, str], float]:
    """The upgrade gate's regressions of sweep `run`, for `nccltune_upgrade_regression`."""
    check = upgrade_check(store, run, warn=False)
    if check is None:
        return {}
    return {(s.collective, s.size_bytes, "default" if side == "defaults" else "published"):
            round((s.change_pct or 0.0) / 100.0, 6) for side, s in check.regressions}


# ---------------------------------------------------------------------------------------------
# Exposition


class _SnapshotCollector(Collector):
    """Yields the families of one file of a snapshot (`daemon`: the daemon's own file, else the
    history's); registered in a registry of its own for one write."""

    def __init__(self, snap: Snapshot, *, daemon: bool = False) -> None:
        self.snap = snap
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        s = self.snap
        # Prometheus stores an empty label as no label: a node without a class has none in the file either.
        cls = {"class": s.node_class} if s.node_class else {}

        def gauge(name: str, doc: str, samples: list[tuple[dict[str, str], float]]) -> Iterator[Metric]:
            if not samples:
                return
            labels = sorted({*cls, *samples[0][0]})
            fam = GaugeMetricFamily(name, doc, labels=labels)
            for extra, value in samples:
                merged = {**cls, **extra}
                fam.add_metric([merged[k] for k in labels], value)
            yield fam

        def one(name: str, doc: str, value: float | bool | None) -> Iterator[Metric]:
            if value is not None:
                yield from gauge(name, doc, [({}, float(value))])

        def per_size(values: Mapping[tuple[str, int], float]) -> list[tuple[dict[str, str], float]]:
            return [({"collective": c, "size_bytes": str(size)}, v) for (c, size), v in sorted(values.items())]

        if self.daemon:
            yield from self._daemon_series(gauge, one)
            return
        yield from gauge("nccltune_build_info", "nccltune version (always 1)", [({"version": __version__}, 1.0)])
        yield from gauge("nccltune_topology_info", "topology of this node (always 1)", [({
            "fingerprint": s.fingerprint, "gpus": "" if s.gpus is None else str(s.gpus),
            "driver_version": s.driver_version or "", "nccl_version": s.nccl_version or "",
            "demo": "1" if s.published is not None and s.published.demo else "0"}, 1.0)])
        yield from one("nccltune_last_sweep_timestamp_seconds", "end of the latest finished sweep (unix time)",
                       s.last_sweep_ts)
        yield from one("nccltune_last_sweep_duration_seconds", "wall time of the latest finished sweep",
                       s.last_sweep_duration_s)
        yield from one("nccltune_last_sweep_success", "1 if the latest finished sweep published, else 0",
                       s.last_sweep_success)
        yield from one("nccltune_last_successful_sweep_timestamp_seconds",
                       "end of the latest sweep that published (unix time)", s.last_successful_sweep_ts)
        yield from one("nccltune_last_confirmed_timestamp_seconds", "end of the latest sweep that published or "
                       "verify that passed (unix time): when the published tuning was last shown current",
                       s.last_confirmed_ts)
        p = s.published
        if p is not None:
            yield from one("nccltune_published_generation",
                           "generation of the published environment (this node's count)", p.generation)
            yield from one("nccltune_published_demo", "1 when the published environment comes from the CPU demo",
                           p.demo)
            if p.env_digest:
                yield from gauge("nccltune_published_info", "what is published: state, decision (node|class), "
                                 "digest of the variables, class profile generation (always 1)",
                                 [({"state": p.state, "decision": p.decision, "env_digest": p.env_digest,
                                    "profile_generation": p.profile_generation}, 1.0)])
        yield from gauge("nccltune_busbw_bytes_per_second", "bus bandwidth measured by the latest ok sweep, "
                         "for NCCL's defaults and the published setting",
                         [({"collective": c, "size_bytes": str(size), "setting": which}, _scaled(bw, _GBPS))
                          for (c, size, which), bw in sorted(s.busbw_gbps.items())])
        yield from gauge("nccltune_busbw_noise_ratio", "run-to-run noise of the defaults' bus bandwidth in the "
                         "latest ok sweep (relative)",
                         [({**labels, "setting": "default"}, v) for labels, v in per_size(s.noise_ratio)])
        yield from gauge("nccltune_tuned_ratio", "published over default bus bandwidth", per_size(s.tuned_ratio))
        yield from gauge("nccltune_upgrade_regression", "latest ok sweep over the last sweep of the previous "
                         "NCCL/driver/torch versions, minus 1, where slower beyond the noise of both",
                         [({"collective": c, "size_bytes": str(size), "setting": which}, v)
                          for (c, size, which), v in sorted(s.upgrade_regression.items())])
        yield from one("nccltune_last_verify_timestamp_seconds", "end of the latest verify (unix time)",
                       s.last_verify_ts)
        yield from one("nccltune_last_verify_success", "1 if the latest verify passed", s.last_verify_success)
        yield from one("nccltune_verify_consecutive_failures", "the newest verifies that failed in a row (0 when "
                       "the latest passed)", s.verify_consecutive_failures)
        yield from gauge("nccltune_verify_drift_ratio", "latest verify: measured over expected bus bandwidth, minus 1",
                         per_size(s.verify_drift_ratio))
        yield from gauge("nccltune_verify_allowed_drift_ratio", "latest verify: the drop below expectation it "
                         "allowed (threshold or twice the noise, whichever is larger)",
                         per_size(s.verify_allowed_drift_ratio))
        yield from gauge("nccltune_class_ratio", "latest verify with a class profile in force: this node's bus "
                         "bandwidth over its class median", per_size(s.class_ratio))
        yield from one("nccltune_class_outlier", "1 when the latest verify found this node below its class beyond "
                       "noise (class profile in force)", s.class_outlier)
        yield from one("nccltune_verify_nccl_ran_passed", "1 when NCCL's own log of the latest verify showed the "
                       "published variables, tuner plugin and table in effect", s.verify_nccl_ran_passed)
        if s.verify_nccl_ran_passed is not None:
            from .nccl.ran import CODES

            yield from gauge("nccltune_verify_nccl_ran_finding", "latest verify: 1 for each finding code NCCL's "
                             "log gave (nccl.ran.CODES), else 0",
                             [({"code": code}, float(code in s.verify_nccl_ran_codes)) for code in CODES])
        sweeps = CounterMetricFamily("nccltune_sweeps", "sweeps recorded in the history", labels=list(cls))
        sweeps.add_metric(list(cls.values()), float(s.sweeps_total))
        yield sweeps

    def _daemon_series(self, gauge: Callable[[str, str, list[tuple[dict[str, str], float]]], Iterator[Metric]],
                       one: Callable[[str, str, float | bool | None], Iterator[Metric]]) -> Iterator[Metric]:
        """The daemon's file: what only a running daemon knows (`Snapshot.live`, doctor's counts)."""
        s, live = self.snap, self.snap.live
        if live is None:
            return
        cls = {"class": s.node_class} if s.node_class else {}
        if s.doctor is not None:
            yield from gauge("nccltune_doctor_findings", "doctor findings by severity",
                             [({"severity": sev}, float(s.doctor.get(sev, 0))) for sev in SEVERITIES])
        if s.topology_changes_total is not None:
            changes = CounterMetricFamily("nccltune_topology_changes",
                                          "fingerprint changes seen by this daemon process", labels=list(cls))
            changes.add_metric(list(cls.values()), float(s.topology_changes_total))
            yield changes
        yield from one("nccltune_degraded", "1 when NVML failed or a GPU is lost; the last safe files are kept",
                       s.degraded)
        yield from gauge("nccltune_daemon_state", "1 for what the daemon is doing now, 0 for the other states",
                         [({"state": st}, 1.0 if st == live.state else 0.0) for st in DAEMON_STATES])
        yield from one("nccltune_busy_compute_processes", "compute processes of others on this node's GPUs",
                       live.busy_processes)
        yield from one("nccltune_heartbeat_timestamp_seconds", "when the daemon last wrote this file (unix time)",
                       live.heartbeat_ts)
        if live.profile_state is not None:
            yield from gauge("nccltune_profile_state", "the class profile at profile.path: 1 for absent (none for "
                             "this node), in_force, safe_part (its safe part after an upgrade) or refused, "
                             "0 for the others",
                             [({"state": st}, 1.0 if st == live.profile_state else 0.0) for st in PROFILE_STATES])
        if live.profile_refused is not None:
            yield from gauge("nccltune_profile_refused_info", "why the class profile at profile.path is refused "
                             "(always 1)", [({"reason": live.profile_refused}, 1.0)])
        yield from _upgrade_series(live, gauge)


def _upgrade_series(live: LiveState, gauge: Callable[[str, str, list[tuple[dict[str, str], float]]],
                                                     Iterator[Metric]]) -> Iterator[Metric]:
    """While the daemon serves its class profile's safe part after an upgrade: its role, and the
    canary's verdict once it has re-measured."""
    if live.upgrade_role is not None:
        yield from gauge("nccltune_upgrade_safe_part_info", "the class profile's safe part is served after an "
                         "NCCL or driver upgrade; role canary re-measures, member waits for the class's profile "
                         "(always 1)", [({"role": live.upgrade_role}, 1.0)])
    if live.upgrade_outcome is not None:
        yield from gauge("nccltune_upgrade_canary_outcome", "the canary's re-measurement by the upgrade rule: 1 "
                         "for keep (no size slower beyond noise) or safe (slower, or nothing compared), 0 for the "
                         "other", [({"outcome": o}, 1.0 if o == live.upgrade_outcome else 0.0)
                                   for o in CANARY_OUTCOMES])


def _scaled(value: float, scale: float) -> float:
    """value * scale without binary noise: 0.535 GB/s is 535000000 B/s, not 535000000.00000006."""
    if scale == 1.0:
        return value
    return float(f"{value * scale:.12g}")


def registry_for(snap: Snapshot, *, daemon: bool = False) -> CollectorRegistry:
    """A registry of its own (not the process-global one), holding exactly one file of this snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap, daemon=daemon))
    return registry


def render(snap: Snapshot, *, daemon: bool = False) -> str:
    """The text exposition of one file of a snapshot: the history's (nccltune.prom), or with
    `daemon` the daemon's (nccltune-daemon.prom; empty without `snap.live`)."""
    return generate_latest(registry_for(snap, daemon=daemon)).decode("utf-8")


def write_snapshot(directory: Path, snap: Snapshot) -> Path:
    """Write `<directory>/nccltune.prom`, and with `snap.live` (the daemon) `nccltune-daemon.prom`,
    each atomically (written beside it, renamed over it); return the path of the first.

    node_exporter often runs as another user, hence mode 0644 whatever the umask.

    The directory is created where missing under the trust rule (trust.ensure_dir): the temporary
    file's name is predictable (atomicfile's, with the writer's pid), so a directory another user could
    write in, or reach through a link, would have it written through a link of theirs.

    Raises:
        InputError: the directory, or a component on its way, may not be trusted (exit 78).
        FileError: a file cannot be written.
    """
    ensure_dir(directory, "metrics directory")
    path = directory / FILENAME
    for name, daemon in ((FILENAME, False), (DAEMON_FILENAME, True)):
        if daemon and snap.live is None:
            continue
        atomic_write(directory / name, generate_latest(registry_for(snap, daemon=daemon)), 0o644)
    return path


def write_metrics_from_store(directory: Path, store: Store, *, fingerprint: str, node_class: str | None = None,
                             live: LiveState | None = None, publish_dir: Path | None = None) -> Path:
    """Build the textfile from the history (and `live`, from a running daemon) and write it.

    Called by `nccltune sweep` and `nccltune verify` after their run (the history's file only), and
    by the daemon, with `live`, at start, every poll and after every sweep, verify or publish (both
    files). Raises OSError when a file cannot be written.
    """
    snap = snapshot_from_store(store, fingerprint=fingerprint, node_class=node_class, live=live,
                               publish_dir=publish_dir)
    return write_snapshot(directory, snap)
