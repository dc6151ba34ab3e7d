"""The daemon's one door to the rest of nccltune: configuration, node, NCCL probe, sweep, verify,
publish, history, lock and metrics.

Everything the daemon asks of the measurement and publishing code goes through a function here
(but for the steps after an upgrade, which daemon/profile.py takes from fleet/upgrade.py),
and comes back as one of the small records below, so that a change in those modules' shapes
is met in this file alone. The functions do the work of one step each; when and why to call
them is the scheduler's and the service's business.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..afterrun import upgrade_check, write_metrics
from ..checks.verify import VerifyCode, run_verify
from ..config import DEFAULT_CONFIG_PATH, Config, load_config, with_overrides
from ..errors import BusyError, NccltuneError, UnavailableError
from ..files.lock import SweepLock
from ..files.trust import ensure_dir
from ..fleet.apply import LoadedProfile, ProfileRefused, check_profile, file_for, load_profile, publish_loaded
from ..fleet.member import fleet_node_of
from ..metrics import LiveState
from ..pipeline import POLICY_VAR, Node, SweepPipeline, load_node, probe_nccl, tuning_fingerprint
from ..publish import (
    TOPO_FILE_VAR,
    Setting,
    atomic_write,
    build_provenance,
    names_own_topology,
    node_topology_pin,
    publish_setting,
    read_published,
    topology_env,
)
from ..publish.publisher import refresh_topology_copy
from ..publish.setting import DECIDED_STATES
from ..store import Store
from ..topology.ncclxml import render_xml
from ..trials.runner import TrialAborted, find_worker_python
from ..trials.session import remove_leftover_temps as _remove_leftover_temps

log = logging.getLogger(__name__)

__all__ = [
    "HEARTBEAT_FILE", "Config", "LiveState", "LoadedProfile", "NcclInfo", "Node", "ProfileRefused",
    "PublishedState", "SweepLock", "SweepOutcome", "TrialAborted", "VerifyOutcome", "daemon_lock",
    "load_class_profile", "node_class_id", "open_history", "prepare_state_dir", "probe_worker_nccl",
    "profile_file_for", "profile_still_valid", "publish_class_profile", "read_config", "read_node",
    "read_published_state", "refresh_topology_file", "republish_safe", "run_sweep", "run_verification",
    "tuning_fingerprint_of", "write_heartbeat", "write_metrics",
]

# In the state directory: the liveness file (time, pid, state), replaced atomically at every poll
# and every half minute during waits and trials; a probe reads its age (deploy/kubernetes).
HEARTBEAT_FILE = "daemon.heartbeat"

ProgressFn = Callable[[int, int, str, str, Any], None]
AbortCheck = Callable[[], str | None]


@dataclass(frozen=True)
class NcclInfo:
    """NCCL as the worker interpreter loads it; all None when it has no torch (nccl-tests engine)."""

    version: str | None = None
    library: str | None = None
    # (size in bytes, mtime in whole seconds) of the library file when it was probed
    library_stat: tuple[int, int] | None = None


@dataclass(frozen=True)
class PublishedState:
    """What nccl.json says, as far as the daemon cares. `unreadable` holds the error, if any."""

    exists: bool
    topology_fingerprint: str | None = None
    tuning_fingerprint: str | None = None
    state: str | None = None
    unreadable: str | None = None
    class_profile_sha256: str | None = None  # the class profile it came from, if any

    @property
    def decided(self) -> bool:
        """A decision is published ("tuned" or "defaults"), not the safe stand-in for a pending tuning."""
        return self.state in DECIDED_STATES


@dataclass(frozen=True)
class SweepOutcome:
    """A finished sweep, as the log reports it (the metrics read the history)."""

    run_id: int | None
    published_generation: int | None
    nccl_version: str | None
    wall_s: float = 0.0
    summary: str = ""


@dataclass(frozen=True)
class VerifyOutcome:
    passed: bool
    expectation: str
    reason: str
    code: VerifyCode = "passed"


# -- configuration, lock, history -----------------------------------------------------------------


def read_config(path: Path | None, overrides: dict[str, object]) -> Config:
    """The configuration file (the default one, optional, when no path is given) with overrides.

    Raises:
        InputError: the file or an override is invalid (exit 78).
    """
    cfg = load_config(path or DEFAULT_CONFIG_PATH, required=path is not None)
    if overrides:
        cfg = with_overrides(cfg, **overrides)
    return cfg


def prepare_state_dir(state_dir: Path) -> None:
    """Create the state directory (history, locks, published files by default) if it is missing,
    0755, and refuse one another user could write (trust.ensure_dir)."""
    ensure_dir(state_dir, "state directory")


def daemon_lock(state_dir: Path) -> SweepLock:
    """The held lock that makes this the only daemon on the state directory.

    Raises:
        BusyError: another daemon holds it (exit 75).
    """
    lock = SweepLock(state_dir / "daemon.lock")
    try:
        lock.acquire()
    except BusyError as exc:
        raise BusyError(str(exc).replace("another sweep", "another daemon")) from exc
    return lock


def remove_leftover_temps(cfg: Config) -> int:
    """What writers killed mid-write left where nccltune writes (trials.session.remove_leftover_temps),
    once the daemon holds its lock."""
    return _remove_leftover_temps(cfg)


def open_history(state_dir: Path) -> None:
    """Open the history once: a corrupt one is moved aside now, and a database of a newer schema
    stops the start with its message instead of failing every sweep later."""
    with Store(state_dir / "history.db"):
        pass


# -- the node and NCCL ----------------------------------------------------------------------------


def read_node(cfg: Config, demo: str | bool | None) -> Node:
    """The whole node: NVML (or the snapshot standing in for it), sysfs, topology and paths."""
    return load_node(cfg, demo)


def probe_worker_nccl(cfg: Config, python: str | None) -> NcclInfo:
    """torch's NCCL in the worker interpreter (a child process: the daemon never imports torch),
    or in bench.image, where the sweep measures (its NCCL library is a file in the image)."""
    if cfg.bench.image:
        from ..trials.container import probe_image

        try:
            return NcclInfo(version=probe_image(cfg.bench)[1].get("nccl_version"))
        except UnavailableError as exc:
            log.info("bench.image did not answer (%s); NCCL version unknown to the daemon", exc.message)
            return NcclInfo()
    try:
        info = probe_nccl(find_worker_python(python or cfg.bench.python))
    except UnavailableError as exc:
        log.info("no torch for the worker (%s); NCCL version unknown to the daemon", exc.message)
        return NcclInfo()
    stat = info.get("nccl_lib_stat")
    return NcclInfo(version=info.get("nccl_version"), library=info.get("nccl_lib"),
                    library_stat=(int(stat[0]), int(stat[1])) if stat else None)


def tuning_fingerprint_of(cfg: Config, node: Node, nccl: NcclInfo) -> str:
    """Everything a published tuning depends on besides the topology, hashed with it."""
    return tuning_fingerprint(cfg, node.fingerprint, nccl.version, node.demo)


# -- published files ------------------------------------------------------------------------------


def read_published_state(publish_dir: Path) -> PublishedState:
    try:
        published = read_published(publish_dir)
    except NccltuneError as exc:
        return PublishedState(exists=True, unreadable=str(exc))
    if published is None:
        return PublishedState(exists=False)
    _env, prov = published
    profile = prov.get("class_profile")
    digest = profile.get("sha256") if isinstance(profile, dict) else None
    return PublishedState(exists=True, topology_fingerprint=prov.get("topology_fingerprint"),
                     tuning_fingerprint=prov.get("tuning_fingerprint"), state=prov.get("state"),
                     class_profile_sha256=digest if isinstance(digest, str) else None)


def refresh_topology_file(cfg: Config, node: Node) -> None:
    """Keep the stable topology copy equal to this node's XML while the published tuning is for this
    topology (publish.refresh_topology_copy: the publisher's own write of that file)."""
    refresh_topology_copy(cfg, render_xml(node.topo.system), node.fingerprint)


def republish_safe(cfg: Config, node: Node, nccl: NcclInfo, why: str, created_at: _dt.datetime) -> int:
    """Publish the new topology file and the policy values, nothing measured on the old topology,
    as every decider publishes (publish_setting: the generation's own topology file, the stable
    copy, the nccl.conf block). A topology file the config or the site pins wins, as under a
    sweep (publish.node_topology_pin): the config's is published as its path, the site's is left
    to NCCL, and nccltune's own XML is published only where nothing pins one.

    Returns the published generation.
    """
    env = {POLICY_VAR: str(cfg.sweep.async_error_handling), **cfg.sweep.pin}
    env.pop(TOPO_FILE_VAR, None)
    env.update(topology_env(node_topology_pin(cfg.sweep.pin, cfg.sweep.unpin, os.environ)))
    prov = build_provenance(
        created_at=created_at, topology_fingerprint=node.fingerprint, nccl_version=nccl.version,
        backend=node.backend, demo=node.demo, note=f"safe environment: {why}; tuning pending", state="safe")
    xml = render_xml(node.topo.system) if names_own_topology(env) else None
    return publish_setting(cfg, Setting(env, prov, topology_xml=xml, where="safe republish")).generation


# -- the class profile ----------------------------------------------------------------------------


def node_class_id(cfg: Config, node: Node, nccl: NcclInfo) -> str:
    """The class id `nccltune topo` shows for this node (fleet.member): the metrics' `class` label."""
    return fleet_node_of(cfg, node).node_class(nccl.version).id


def profile_file_for(path: Path, cfg: Config, node: Node, nccl: NcclInfo) -> Path:
    """The file profile.path stands for on this node (a directory: its class's `<class id>.json`)."""
    return file_for(path, node_class_id(cfg, node, nccl))


def load_class_profile(path: Path, cfg: Config, node: Node, nccl: NcclInfo) -> LoadedProfile:
    """The profile at profile.path for this node (a directory: its class's file), read and checked.

    Raises:
        ProfileRefused: missing, untrusted, malformed, for another class, stale, or unsafe (exit-78 text).
    """
    return load_profile(path, fleet_node_of(cfg, node), nccl.version)


def profile_still_valid(loaded: LoadedProfile, cfg: Config, node: Node, nccl: NcclInfo) -> ProfileRefused | None:
    """Why a profile applied before no longer fits this node (after a change of NCCL or of the
    topology), or None when it still does."""
    try:
        check_profile(loaded.doc, str(loaded.path), fleet_node_of(cfg, node), nccl.version)
    except ProfileRefused as exc:
        return exc
    return None


def publish_class_profile(cfg: Config, node: Node, nccl: NcclInfo, loaded: LoadedProfile,
                          created_at: _dt.datetime) -> int:
    """Publish a profile load_class_profile accepted (as `nccltune apply` does); returns the generation.

    Raises:
        InputError, PublishError, BusyError: as fleet.apply.publish_loaded; nothing was published.
    """
    got = publish_loaded(cfg, fleet_node_of(cfg, node), nccl.version, loaded,
                         now=created_at.astimezone(_dt.timezone.utc))
    return got.published.generation


def _with_python(cfg: Config, python: str | None) -> Config:
    """The config with the daemon's --python folded in, as the sweep and verify take it."""
    return with_overrides(cfg, **{"bench.python": python}) if python else cfg


def run_sweep(cfg: Config, demo: str | bool | None, python: str | None, progress: ProgressFn,
              abort_check: AbortCheck) -> SweepOutcome:
    """One full sweep, published when it finds something.

    Raises:
        TrialAborted: abort_check answered a reason (a job started, the service stops).
        BusyError: another sweep holds the sweep lock; nothing ran.
        NccltuneError: the sweep failed; the published files are unchanged.
    """
    report = SweepPipeline(_with_python(cfg, python), demo=demo, progress=progress, abort_check=abort_check).run()
    upgrade_check(cfg, report.run_id)
    return SweepOutcome(run_id=report.run_id,
                        published_generation=report.published.generation if report.published else None,
                        nccl_version=report.nccl_version, wall_s=report.wall_s, summary=report.summary)


def run_verification(cfg: Config, demo: str | bool | None, python: str | None, node: Node,
                     abort_check: AbortCheck) -> VerifyOutcome:
    """Measure the published environment against its expectation.

    Raises:
        TrialAborted, BusyError: as run_sweep; NccltuneError: verify could not run.
    """
    result = run_verify(_with_python(cfg, python), demo=demo, node=node, abort_check=abort_check)
    return VerifyOutcome(passed=result.passed, expectation=result.expectation, reason=result.reason,
                         code=result.code)


# -- liveness ---------------------------------------------------------------------------


def write_heartbeat(state_dir: Path, *, state: str, pid: int, now: float) -> Path:
    """`<state_dir>/daemon.heartbeat`, replaced atomically: a probe that reads it never sees half a
    file, and its mtime is the time it was written.

    Raises:
        NccltuneError: the file cannot be written (FileError, exit 1).
    """
    path = state_dir / HEARTBEAT_FILE
    doc = {"time": round(now, 3), "time_iso": _dt.datetime.fromtimestamp(now, _dt.timezone.utc)
           .isoformat(timespec="seconds"), "pid": pid, "state": state}
    atomic_write(path, json.dumps(doc, sort_keys=True) + "\n")
    return path
