"""One run's trials, shared by the sweep and verify: each trial numbered, run in fresh rank
processes, reported to the progress callback and stored with its measurements as it ends.

The session also remembers what the trials told about the software (NCCL and torch versions,
the measuring method, as the first trial that says) and which trials failed, for the run's
summary. It owns the run's record from start to finish: `start_run` opens it, `finish` or
`abandon` closes it, and `close_dead_runs` closes the runs of processes that died;
`remove_leftover_temps` removes the temp files of writers that died mid-write.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import Config, config_to_dict
from ..errors import InputError, NccltuneError, UnavailableError
from ..files import trust
from ..files.atomicfile import remove_dead_temps
from ..names import short_hostname
from ..node import Node, iterations
from ..publish import GENERATIONS_DIR, read_set
from ..publish.cdi import SPEC_NAME as CDI_SPEC_NAME
from ..records import ReportRow, TrialResult
from ..store import Phase, PublishedRun, RunKind, RunStatus, RunSummary, Store
from .runner import Runner, find_worker_python

log = logging.getLogger(__name__)

# progress(seq, expected total, phase, label, result): result is None as a trial starts.
ProgressFn = Callable[[int, int, str, str, "TrialResult | None"], None]


@dataclass(frozen=True)
class Engine:
    """What measures: the worker under `python`, or all_reduce_perf at `nccl_tests`."""

    python: str
    nccl_tests: str | None = None


def resolve_engine(cfg: Config, node: Node, collectives: Sequence[str] = ("all_reduce",)) -> Engine:
    """The measuring engine bench.engine names, with its interpreter (bench.python, else found).
    For nccl-tests, the `*_perf` binary of each of `collectives` must be beside all_reduce_perf.

    Raises:
        InputError: nccl-tests asked for in the CPU demo (exit 78).
        UnavailableError: a `*_perf` binary, or an interpreter with torch, not found (exit 69).
    """
    if cfg.bench.engine != "nccl-tests":
        if cfg.bench.image:
            # The image's python3 runs the worker (trials.container): the host needs no torch.
            return Engine(cfg.bench.python or sys.executable)
        return Engine(find_worker_python(cfg.bench.python))
    from .nccltests import find_binary

    if node.demo:
        raise InputError(cfg.path or "config", "bench.engine nccl-tests measures NCCL on GPUs; the CPU demo "
                         "needs the torch worker (bench.engine: torch)", line=cfg.lines.get("bench.engine"))
    binary = find_binary(cfg.bench.nccl_tests_dir)
    if binary is None:
        raise UnavailableError("all_reduce_perf (nccl-tests) not found in bench.nccl_tests_dir or on PATH",
                               hint="build nccl-tests, or set bench.engine: torch")
    from .nccltests import binary_for

    missing = [Path(path).name for path in (binary_for(binary, name) for name in collectives)
               if not Path(path).exists()]
    if missing:
        raise UnavailableError(f"{', '.join(missing)} (nccl-tests) not found beside {binary}",
                               hint="build every nccl-tests binary the profile measures, or set bench.engine: torch")
    for path in sorted({binary, *(binary_for(binary, name) for name in collectives)}):
        # Root runs them: the trust rule of bench.python, over the whole chain to each binary.
        trust.trusted_file(path, "nccl-tests binary (bench.nccl_tests_dir)")
    return Engine(cfg.bench.python or sys.executable, binary)


def start_run(store: Store, *, kind: RunKind, cfg: Config, node: Node, profile: str | None,
              topology: Mapping[str, Any]) -> int:
    """Record a run of this node as started; its id. The topology record gets the ranks this
    node's trials run (`nranks`), which the nccl-tests document of a run states."""
    return store.start_run(
        kind=kind, fingerprint=node.fingerprint, backend=node.backend, demo=node.demo, profile=profile,
        nccl_version=None, driver_version=node.topo.driver_version, torch_version=None,
        nccltune_version=__version__, hostname=short_hostname(), topology={**topology, "nranks": node.nranks},
        config=config_to_dict(cfg))


def close_dead_runs(store: Store, publish_dir: Path) -> int:
    """Close the runs left 'running' by a process that died; the caller holds the sweep lock, so
    no live sweep or verify owns one. THE rule, for the sweep's start and the command line alike:
    the run the current generation's provenance names, in this very history, died after its
    publish and before it closed its record, and is recorded as having published that generation
    (the set every job gets is its result); every other one as interrupted. Returns how many
    were closed.
    """
    return store.mark_interrupted(_published_run(store, publish_dir))


def leftover_temp_places(cfg: Config) -> list[tuple[Path, frozenset[str] | None]]:
    """Where nccltune writes files through temp files for this config, each with the names whose
    temps are nccltune's there (None: any, in a directory only nccltune writes): the state
    directory, the publish directory and its generations/, each run's, verify's and a joining
    node's directory; and, in a directory shared with other programs, only the temps of its own
    file: the stable topology copy, the metrics, the CDI spec, the NCCL conf file (and the file
    its link points to)."""
    state = Path(cfg.state_dir)
    places: list[tuple[Path, frozenset[str] | None]] = [
        (state, None), (Path(cfg.publish_dir), None), (Path(cfg.publish_dir) / GENERATIONS_DIR, None),
        (state / "verify", None), (state / "join", None)]
    try:
        with os.scandir(state / "runs") as runs:
            places += [(Path(r.path), None) for r in runs if r.is_dir(follow_symlinks=False)]
    except OSError:
        pass  # no run yet
    places.append((cfg.topology_file.parent, frozenset({cfg.topology_file.name})))
    if cfg.metrics_dir is not None:
        from ..metrics import DAEMON_FILENAME, FILENAME  # prometheus_client, where metrics are on

        places.append((cfg.metrics_dir, frozenset({FILENAME, DAEMON_FILENAME})))
    if cfg.cdi_dir is not None:
        places.append((cfg.cdi_dir, frozenset({CDI_SPEC_NAME})))
    if cfg.nccl_conf is not None:
        real = Path(os.path.realpath(cfg.nccl_conf))
        places += [(cfg.nccl_conf.parent, frozenset({cfg.nccl_conf.name})), (real.parent, frozenset({real.name}))]
    return list(dict.fromkeys(places))


def remove_leftover_temps(cfg: Config) -> int:
    """Remove what writers killed mid-write left in the places nccltune writes for this config
    (leftover_temp_places; atomicfile.remove_dead_temps: only nccltune's temp names of writers
    that are gone, in directories of ours, never through a link). For the start of a sweep, a
    verify and the daemon; the publisher does the same in the publish directory under its lock.
    Returns how many were removed; never raises."""
    return sum(len(remove_dead_temps(directory, names)) for directory, names in leftover_temp_places(cfg))


def _published_run(store: Store, publish_dir: Path) -> PublishedRun | None:
    """The run of this history that published the current generation, from its provenance."""
    try:
        current = read_set(publish_dir)
    except (NccltuneError, OSError) as exc:
        # An unreadable set names no run: its runs are interrupted, as before the provenance had them.
        log.debug("the published set cannot be read (%s); no run recovered as published", exc)
        return None
    if current is None:
        return None
    prov = current.provenance
    run_id, history, created = prov.get("run_id"), prov.get("history"), prov.get("created_at")
    if isinstance(run_id, bool) or not isinstance(run_id, int) or not isinstance(history, str):
        return None
    # The same run id in another state directory's history is another run.
    if os.path.realpath(history) != os.path.realpath(store.path):
        return None
    try:
        published_at = _dt.datetime.fromisoformat(created) if isinstance(created, str) else None
    except ValueError:
        published_at = None
    if published_at is None or published_at.tzinfo is None:
        return None
    return PublishedRun(run_id=run_id, generation=current.generation, published_at=published_at,
                        env=current.env)


class TrialSession:
    """The trials of one run, in order."""

    def __init__(self, store: Store, run_id: int, runner: Runner, sizes: Sequence[int], *, cfg: Config,
                 node: Node, progress: ProgressFn | None = None,
                 expected_trials: Callable[[], int] | None = None,
                 collectives: Sequence[str] = ("all_reduce",)) -> None:
        """`collectives`: what every trial measures, each over all `sizes`, in one worker run."""
        self.store = store
        self.collectives = tuple(collectives)
        self.run_id = run_id
        self.runner = runner
        self.sizes = list(sizes)
        self.warmup, self.iters = iterations(cfg, node)
        self.progress = progress
        self.expected_trials = expected_trials or (lambda: 0)
        self.seq = 0
        self.failed: list[tuple[str, str]] = []
        self.nccl_version: str | None = None
        self.torch_version: str | None = None
        self.method: str | None = None
        # collective -> why the backend could not measure it, as the trials reported
        self.not_measured: dict[str, str] = {}
        # Every trial with the candidate it ran, for what the trials say beyond their busbw
        # (which algorithm and protocol NCCL used per size).
        self.results: list[tuple[dict[str, str], TrialResult]] = []

    def trial(self, env: Mapping[str, str], phase: Phase, label: str) -> TrialResult:
        """Run and store one trial of the candidate `env` (its own variables only; nccltune's
        topology file as the marker publish.OWN_TOPOLOGY, which the history records as the run's
        own file)."""
        recorded = self.runner.recorded(env)
        self.seq += 1
        total = max(self.expected_trials(), self.seq)
        if self.progress:
            self.progress(self.seq, total, phase, label, None)
        result = self.runner.run(env, self.sizes, warmup=self.warmup, iters=self.iters, label=label,
                                 collectives=self.collectives)
        self.not_measured.update(result.not_measured)
        self.nccl_version = self.nccl_version or result.nccl_version
        self.torch_version = self.torch_version or result.torch_version
        self.method = self.method or result.method
        self.store.add_trial(self.run_id, seq=self.seq, phase=phase, label=label, env=recorded, status=result.status,
                             reason=result.reason, wall_s=result.wall_s, nccl=result.nccl,
                             measurements=result.sizes)
        if self.progress:
            self.progress(self.seq, total, phase, label, result)
        if not result.ok:
            self.failed.append((label, result.reason or result.status))
        self.results.append((recorded, result))
        return result

    def finish(self, status: RunStatus, summary: RunSummary, *, chosen_env: Mapping[str, str] | None = None,
               published_generation: int | None = None, rows: Sequence[ReportRow] = ()) -> None:
        """Close the run with what it found."""
        self.store.finish_run(self.run_id, status=status, summary=summary, chosen_env=chosen_env,
                              published_generation=published_generation, rows=rows)

    def abandon(self, status: RunStatus, summary: RunSummary) -> None:
        """Stop whatever trial runs (its rank processes are killed) and close the run as ended early."""
        self.runner.kill()
        self.store.finish_run(self.run_id, status=status, summary=summary)
