"""`nccltune sweep`: the coordinator, --plan, and --join on the other nodes of a multi-node sweep."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EXIT_OK, InputError, UsageError
from ..files.trust import ensure_dir

if TYPE_CHECKING:
    from ..config import Config
    from ..records import TrialResult
    from ..store import TrialRecord
    from ..trials.launch.base import LaunchRequest

from . import context
from .context import Terminated, load_cfg, out

log = logging.getLogger(__name__)


class _Progress:
    """A live progress line on a terminal; one line per trial otherwise (the journal). Always on
    stderr, so that `--json` keeps stdout for its one document and still shows the sweep moving."""

    def __init__(self, quiet: bool) -> None:
        self.tty = sys.stderr.isatty()
        self.quiet = quiet or context.QUIET
        self.started = time.monotonic()
        self.walls: list[float] = []

    def __call__(self, seq: int, total: int, phase: str, label: str, result: TrialResult | None) -> None:
        if result is None:
            if self.tty and not self.quiet:
                eta = ""
                if self.walls:
                    left = max(0, total - seq + 1) * (sum(self.walls) / len(self.walls))
                    eta = f" ~{int(left // 60)}m{int(left % 60):02d}s left"
                sys.stderr.write(f"\r\033[K[{seq}/~{total}]{eta} {phase}: {label}"[:200])
                sys.stderr.flush()
            return
        self.walls.append(result.wall_s)
        if self.tty and not self.quiet:
            if not result.ok:
                sys.stderr.write(f"\r\033[Ktrial {seq} ({label}) {result.status}: {result.reason}\n")
            return
        if not self.quiet or not result.ok:
            print(f"nccltune: trial {seq}/~{total} {phase} {label}: {result.status}"
                  + (f" ({result.reason})" if result.reason else "") + f" in {result.wall_s:.1f} s",
                  file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty and not self.quiet:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def sweep_launch_request(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchRequest | None:
    """--nodes, --rdzv-endpoint, --loopback and --launcher, checked together; None for today's
    single-node sweep. (--join is handled by cmd_sweep_join.)

    Raises:
        UsageError: a value or combination that cannot work (exit 2).
    """
    from ..trials.launch.base import LaunchRequest, parse_endpoint

    if args.nodes < 1:
        raise UsageError(f"--nodes {args.nodes}: at least 1")
    if args.loopback and args.nodes > 1:
        raise UsageError(f"--loopback measures this node alone: it does not go with --nodes {args.nodes}")
    if args.loopback and args.launcher not in ("auto", "local"):
        raise UsageError(f"--loopback measures this node alone: it does not go with --launcher {args.launcher}")
    endpoint = parse_endpoint(args.rdzv_endpoint) if args.rdzv_endpoint else None
    request = LaunchRequest(nodes=args.nodes, loopback=args.loopback, launcher=args.launcher, endpoint=endpoint,
                            env=dict(env))
    if request.single_node:
        if endpoint is not None:
            raise UsageError("--rdzv-endpoint is for sweeps over several nodes (--nodes N)")
        return None
    if request.authenticated and endpoint is None and not args.plan:
        raise UsageError(f"--nodes {args.nodes} with torchrun needs --rdzv-endpoint HOST:PORT: the address of this "
                         "node that the other nodes reach (the control channel listens there only)")
    return request


def _joiner_ranks(cfg: Config, demo: bool) -> int:
    """The most ranks a joining node runs: its GPUs (bench.gpus where set), or the demo's ranks.

    Raises:
        UnavailableError: no NVIDIA GPU here and no --demo (exit 69)."""
    if demo:
        return cfg.bench.nranks or 2
    from ..hw.nvml import read_nvml

    return len(cfg.bench.gpus or read_nvml().gpus)


def cmd_keygen(args: argparse.Namespace) -> int:
    """`nccltune keygen [PATH]`: a new multi-node key (default multinode.key_file), never over one."""
    from ..trials.launch.sealing import write_key

    path = args.path or load_cfg(args).multinode.key_file
    try:
        write_key(path)
    except OSError as exc:
        raise InputError(str(path), f"cannot write the key: {exc.strerror}") from exc
    out(f"Wrote a new multi-node key to {path} (mode 0600): copy it to every node of the job, as the Slurm munge "
        "key is")
    return EXIT_OK


def cmd_sweep_join(args: argparse.Namespace) -> int:
    """`nccltune sweep --join HOST:PORT`: this node runs the coordinator's trials until it stops."""
    from ..delivery.jobenv import from_published
    from ..trials.launch.base import parse_endpoint
    from ..trials.launch.torchrun import join
    from ..trials.runner import find_worker_python

    given = [flag for flag, on in (("--nodes", args.nodes != 1), ("--rdzv-endpoint", args.rdzv_endpoint),
                                   ("--loopback", args.loopback), ("--plan", args.plan),
                                   ("--launcher", args.launcher != "auto")) if on]
    if given:
        raise UsageError(f"--join takes its shape from the coordinator: drop {', '.join(given)}")
    endpoint = parse_endpoint(args.join, "--join")
    cfg = load_cfg(args, demo=bool(args.demo))
    # bench.image: this node's agent and ranks run in the job's image, as the coordinator's do.
    container = None
    if cfg.bench.image:
        from ..trials.container import IMAGE_PYTHON, from_config

        container = from_config(cfg.bench, demo=bool(args.demo))
    python = IMAGE_PYTHON if container is not None else find_worker_python(args.python or cfg.bench.python)
    # The state directory rule of `sweep` (trust.ensure_dir): a joiner writes its trials' files
    # there as root, so none of it may be another user's, nor reached through her link.
    work_dir = ensure_dir(ensure_dir(Path(cfg.state_dir), "state directory") / "join", "join directory")
    # Its trials start from its own environment as the job set it: what this node's published set
    # put there is no more the job's here than on the coordinator (delivery.jobenv.from_published).
    own = from_published(os.environ, cfg.publish_dir).own(os.environ)
    trials = join(endpoint, python=python, base_env=own, work_dir=work_dir, user=cfg.bench.user,
                  max_ranks=_joiner_ranks(cfg, bool(args.demo)), key_file=cfg.multinode.key_file,
                  container=container)
    out(f"Ran {trials} trial(s) for the coordinator at {args.join}")
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    from ..afterrun import upgrade_check, write_metrics
    from ..pipeline import SweepPipeline
    from ..report.jsondoc import dumps
    from ..report.sweep import plan_doc, plan_text, sweep_doc, sweep_text

    if args.join:
        return cmd_sweep_join(args)
    request = sweep_launch_request(args, os.environ)
    _check_unpin(args.unpin)
    if args.python:
        from ..trials.runner import check_python

        check_python(args.python)  # before the state directory is made or anything measured
    cfg = load_cfg(args, demo=bool(args.demo))
    if request is not None and request.authenticated:
        from dataclasses import replace

        from ..images import parse_image
        from ..trials.launch.sealing import load_key

        request = replace(request, key_file=cfg.multinode.key_file,
                          image=parse_image(cfg.bench.image[0]).digest if cfg.bench.image else None)
        if not args.plan:
            load_key(cfg.multinode.key_file)  # exit 78 now, not after the planning
    progress = _Progress(quiet=False)  # --json included: progress goes to stderr, the document to stdout
    pipe = SweepPipeline(cfg, demo=args.demo, progress=progress, launch=request, over_profile=args.over_profile)
    if args.plan and not pipe.measurable():
        from ..pipeline import UNMEASURED_SUMMARY

        plan, _search = pipe.plan()  # the same checks as for a plan that measures (config, publish dir)
        text = (f"{UNMEASURED_SUMMARY}: `nccltune sweep` runs no trial here and publishes the topology file "
                "and the policy values (and the config's pins) for every job.")
        out(dumps(plan_doc(plan, pipe.node(), 0, 0.0, pipe.profile, unmeasured=UNMEASURED_SUMMARY))
            if args.json else text)
        return EXIT_OK
    if args.plan:
        plan, search = pipe.plan()
        trials, most_trials = pipe.trial_bounds(plan, search)
        per_trial = pipe.estimate_seconds(plan, 1)  # each trial alike: one read of this node's history
        seconds = trials * per_trial
        most = (most_trials, most_trials * per_trial)
        if args.json:
            out(dumps(plan_doc(plan, pipe.node(), trials, seconds, pipe.profile, pipe.workload(plan), most=most)))
        else:
            out(plan_text(plan, pipe.node(), trials, seconds, pipe.profile, pipe.workload(plan), most=most))
        return EXIT_OK
    node = pipe.node()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    report = None
    try:
        report = pipe.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.done()
        # A failed or interrupted sweep is history too.
        write_metrics(cfg, node, nccl_version=report.nccl_version if report is not None else None)
    stored = _run_trials(cfg, report.run_id)
    upgrade_check(cfg, report.run_id)
    out(dumps(sweep_doc(report, stored)) if args.json else sweep_text(report, stored))
    return EXIT_OK


def _run_trials(cfg: Config, run_id: int | None) -> list[TrialRecord]:
    """The stored trials of a run this command just made (for the document's failed-trial codes)."""
    from ..store import Store

    if run_id is None:
        return []
    with Store(cfg.state_path("history.db")) as store:
        return list(store.trials(run_id))


def _check_unpin(names: list[str]) -> None:
    """--unpin takes the name of a variable the sweep knows; anything else is a usage error (2)."""
    from ..report.jsondoc import shown
    from ..sweep.space import CATALOGUE, unknown_variable_hint

    for name in names:
        if name not in CATALOGUE:
            raise UsageError(f"--unpin {shown(name)!s}: not a variable nccltune sweeps",
                             hint=unknown_variable_hint(name))


def _raise_interrupt(signum: int, frame: object) -> None:
    raise Terminated
