"""The node and its service: `doctor`, `verify`, `install`, `uninstall` and `daemon`."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EXIT_OK, NccltuneError, UsageError

if TYPE_CHECKING:
    from ..checks.doctor import Finding
    from ..config import Config

from . import context
from .context import load_cfg, out, setup_logging

log = logging.getLogger(__name__)


def cmd_daemon(args: argparse.Namespace) -> int:
    from ..daemon import Daemon, DaemonOptions

    overrides: dict[str, object] = {}
    state_dir = context.state_dir_flag(args, demo=bool(args.demo))
    if state_dir is not None:
        overrides["state_dir"] = state_dir
    opts = DaemonOptions(config_path=Path(args.config) if args.config else None, overrides=overrides,
                         demo=args.demo, python=args.python, max_polls=args.max_polls,
                         poll_interval_s=args.poll_interval)
    if args.verbose == 0 and not context.QUIET:
        setup_logging(1)  # a service logs what it does
    return Daemon(opts).run()


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..checks.doctor import diagnose
    from ..nccl.sitetuner import default_conf_files
    from ..report.machine import doctor_doc, doctor_text
    from ..topology.paths import compute_paths
    from ..topology.source import load_topology, resolve_snapshot

    cfg = load_cfg(args, demo=bool(args.demo))
    source = args.input or (str(resolve_snapshot(args.demo if isinstance(args.demo, str) else None))
                            if args.demo else cfg.topology.snapshot)
    topo = load_topology(source)
    findings = diagnose(topo, compute_paths(topo), env=dict(os.environ), publish_dir=cfg.publish_dir,
                        conf_files=default_conf_files(os.environ), tuner_mode=cfg.tuner.plugin)
    findings += _history_findings(cfg, topo)
    out(dumps_doc(doctor_doc(topo, findings)) if args.json else doctor_text(topo, findings))
    return 1 if any(f.severity == "error" for f in findings) else EXIT_OK


def _history_findings(cfg: Config, topo: object) -> list[Finding]:
    """What this node's history says: the upgrade gate's finding, a verify that found the node
    below its class."""
    from ..checks.doctor import history_findings
    from ..store import Store
    from ..topology.fingerprint import topology_fingerprint
    from ..topology.model import Topology

    path = cfg.state_path("history.db")
    if not path.exists() or not isinstance(topo, Topology):
        return []
    try:
        with Store(path) as store:
            return history_findings(store, topology_fingerprint(topo))
    except (OSError, NccltuneError) as exc:
        log.warning("cannot read the history for the upgrade and class checks: %s", exc)
        return []


def dumps_doc(doc: dict[str, object]) -> str:
    from ..report.jsondoc import dumps

    return dumps(doc)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..afterrun import write_metrics
    from ..checks.verify import run_verify
    from ..node import load_node
    from ..report.runs import verify_doc, verify_text

    cfg = load_cfg(args, demo=bool(args.demo))
    node = load_node(cfg, args.demo)
    # One GPU: verify checks what NCCL runs for the table's shapes N x 1 (checks/onegpu.py).
    result = run_verify(cfg, demo=args.demo, floor_gbps=args.floor, use_current=args.current,
                        threshold_pct=args.threshold, force=args.force, node=node, baseline_run=args.baseline,
                        quick=args.quick)
    write_metrics(cfg, node, nccl_version=result.nccl_version)
    out(dumps_doc(verify_doc(result)) if args.json else verify_text(result))
    return EXIT_OK if result.passed else 1


def cmd_install(args: argparse.Namespace) -> int:
    from ..install import install_units

    if args.enable and args.no_enable:
        raise UsageError("nccltune install: --enable and --no-enable contradict each other")
    # Below a prefix (an image, a test root) the running system's systemd is not the one to tell.
    enable = args.enable or (args.prefix is None and not args.no_enable)
    done = install_units(Path(args.prefix or "/"), binary=args.binary, enable=enable, dry_run=args.dry_run)
    for line in done:
        out(line)
    return EXIT_OK


def cmd_uninstall(args: argparse.Namespace) -> int:
    from ..install import uninstall

    done = uninstall(Path(args.prefix or "/"), disable=args.prefix is None and not args.no_disable,
                     dry_run=args.dry_run)
    for line in done:
        out(line)
    return EXIT_OK
