"""Command line: argument parsing and rendering only. `main(argv=None) -> int`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .errors import EXIT_OK, CheckFailed, NccltuneError, UsageError

if TYPE_CHECKING:
    from .config import Config
    from .records import TrialResult
    from .store import Store

log = logging.getLogger(__name__)


# A command ended by a signal exits 128 + its number, as shells report it.
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM during a sweep: unwinds like Ctrl-C (ranks killed, run recorded as interrupted),
    but is named for what it is in the history and exits 143."""

    def __str__(self) -> str:
        return "terminated (SIGTERM)"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="config file (default /etc/nccltune/config.yaml)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory (default /var/lib/nccltune)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nccltune", description="Topology-aware NCCL tuning for GPU nodes.",
        epilog="exit codes: 0 ok, 1 check failed or I/O error (disk full), 2 usage, 69 no GPU/NVML/torch, "
               "75 busy (lock held or GPUs in use), 78 bad config or input, 126/127 (exec) command not "
               "runnable/not found, 130 SIGINT, 143 SIGTERM. Without GPUs: `nccltune sweep --demo`.")
    parser.add_argument("--version", action="version", version=f"nccltune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    topo = sub.add_parser("topo", help="show this node's topology, record it, check or diff NCCL XML")
    _common(topo)
    topo.add_argument("--input", metavar="FILE", help="a recorded snapshot or an NCCL topology XML")
    topo.add_argument("--xml", metavar="OUT", help="write NCCL's topology XML (for NCCL_TOPO_FILE) to OUT")
    topo.add_argument("--no-nics", action="store_true", help="leave NICs out of the XML")
    topo.add_argument("--json", action="store_true", help="print one JSON document")
    tsub = topo.add_subparsers(dest="topo_command", metavar="ACTION", parser_class=_Parser)
    rec = tsub.add_parser("record", help="capture this node's raw readings as a replayable snapshot")
    _common(rec)
    rec.add_argument("out", metavar="OUT")
    rec.add_argument("--description", help="one line saying what machine this is")
    chk = tsub.add_parser("check", help="run a small NCCL job with this XML and report whether NCCL loaded it")
    _common(chk)
    chk.add_argument("xml", metavar="XML")
    chk.add_argument("--json", action="store_true")
    chk.add_argument("--python", metavar="PY", help="worker interpreter (default: bench.python or auto)")
    chk.add_argument("--dump", metavar="OUT", help="also keep NCCL's own re-dump of the topology here")
    dif = tsub.add_parser("diff", help="semantic differences between two topologies (snapshot or XML)")
    _common(dif)
    dif.add_argument("a", metavar="A")
    dif.add_argument("b", metavar="B")
    dif.add_argument("--json", action="store_true")

    _add_sweep_parsers(sub)
    _add_fleet_parsers(sub)
    return parser


def _add_sweep_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    sw = sub.add_parser("sweep", help="measure NCCL defaults and candidates, choose, publish")
    _common(sw)
    sw.add_argument("--plan", action="store_true", help="print the plan (measured, pruned and why, ETA) and stop")
    sw.add_argument("--profile", metavar="NAME", help="objective: balanced (default), large, small, or a custom one")
    sw.add_argument("--json", action="store_true", help="print one JSON document")
    sw.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                    help="run on the CPU (gloo) over a recorded topology (default: the bundled 2-GPU node)")
    sw.add_argument("--force", action="store_true", help="sweep even while compute processes use the GPUs")
    sw.add_argument("--exhaustive", action="store_true", help="measure the full grid instead of the staged search")
    sw.add_argument("--unpin", action="append", default=[], metavar="NAME",
                    help="sweep a variable although the environment or config sets it")
    sw.add_argument("--python", metavar="PY", help="worker interpreter (default: bench.python, or auto)")

    env = sub.add_parser("env", help="print the published environment")
    _common(env)
    env.add_argument("--format", choices=("sh", "env", "json"), default="sh")
    env.add_argument("--json", action="store_true", help="the same as --format json: both parts, labelled")
    env.add_argument("--nnodes", type=_positive_int, metavar="N",
                     help="the job's node count: 1 adds the single-node part (default: NCCLTUNE_JOB_NNODES, "
                          "else the every-job part only)")

    ex = sub.add_parser("exec", help="run a command (e.g. torchrun) with the published environment")
    _common(ex)
    ex.add_argument("--nnodes", type=_positive_int, metavar="N",
                    help="the job's node count: 1 adds the single-node part (default: NCCLTUNE_JOB_NNODES, "
                         "else the every-job part only)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")

    hist = sub.add_parser("history", help="past sweeps and verifications")
    _common(hist)
    hist.add_argument("--limit", type=_positive_int, default=20, help="newest N runs (a positive number)")
    hist.add_argument("--run", type=int, metavar="ID", help="show one run's trials")
    hist.add_argument("--json", action="store_true")

    dm = sub.add_parser("daemon", help="the node service (systemd Type=notify)")
    _common(dm)
    dm.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                    help="the same service loop on the CPU over a recorded topology")
    dm.add_argument("--python", metavar="PY", help="worker interpreter (default: bench.python, or auto)")
    dm.add_argument("--poll-interval", type=float, metavar="S", help="seconds between polls (daemon.poll_interval_s)")
    dm.add_argument("--max-polls", type=int, metavar="N", help="stop after N polls (bring-up scripts, tests)")

    doc = sub.add_parser("doctor", help="find harmful NCCL settings and node problems")
    _common(doc)
    doc.add_argument("--input", metavar="FILE", help="judge a recorded snapshot instead of this node")
    doc.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                     help="judge the bundled (or given) snapshot, for machines without GPUs")
    doc.add_argument("--json", action="store_true")

    ver = sub.add_parser("verify", help="quick all-reduce with the published environment against the baseline")
    _common(ver)
    ver.add_argument("--floor", type=float, metavar="GBPS", help="fail below this busbw at the largest size")
    ver.add_argument("--current", action="store_true", help="check the calling environment, not the published one")
    ver.add_argument("--threshold", type=float, metavar="PCT", help="allowed drift (daemon.drift_threshold_pct)")
    ver.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT")
    ver.add_argument("--force", action="store_true", help="verify even while compute processes use the GPUs")
    ver.add_argument("--python", metavar="PY")
    ver.add_argument("--json", action="store_true")

    ins = sub.add_parser("install", help="install the systemd units and enable the service")
    _common(ins)
    ins.add_argument("--prefix", default="/", metavar="DIR", help="install below DIR (for images and tests)")
    ins.add_argument("--no-enable", action="store_true", help="do not run systemctl enable/daemon-reload")
    ins.add_argument("--binary", metavar="PATH", help="nccltune executable for ExecStart (default: this one)")

    rep = sub.add_parser("report", help="the last sweep's table, or a plot of bus bandwidth against size")
    _common(rep)
    rep.add_argument("--run", type=int, metavar="ID", help="a run id from `nccltune history`")
    rep.add_argument("--plot", metavar="OUT.png", help="write a plot (needs matplotlib)")
    rep.add_argument("--json", action="store_true")


def _setup_logging(verbosity: int) -> None:
    from .logsetup import setup_logging

    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    setup_logging(level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        if args.command is None:
            parser.print_help()
            return EXIT_OK
        _setup_logging(getattr(args, "verbose", 0))
        return dispatch(args)
    except NccltuneError as exc:
        print(f"nccltune: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("nccltune: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_SIGTERM
    except KeyboardInterrupt:
        print("nccltune: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except BrokenPipeError:
        return EXIT_OK


def out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def dispatch(args: argparse.Namespace) -> int:
    handler = _HANDLERS.get(args.command)
    if handler is None:  # pragma: no cover - argparse only accepts known commands
        raise UsageError(f"unknown command {args.command}")
    return handler(args)


def cmd_topo(args: argparse.Namespace) -> int:
    from .render import dumps, topology_doc, topology_text
    from .topology.paths import compute_paths
    from .topology.source import load_topology

    action = getattr(args, "topo_command", None)
    if action == "record":
        return cmd_topo_record(args)
    if action == "diff":
        return cmd_topo_diff(args)
    if action == "check":
        return cmd_topo_check(args)
    topo = load_topology(args.input, with_nics=not args.no_nics)
    paths = compute_paths(topo)
    from .topology.nodeclass import node_class, with_class_line

    cls = node_class(load_topology(args.input) if args.no_nics else topo)  # NICs count for the class
    if args.xml:
        from .topology.ncclxml import write_xml

        write_xml(topo, Path(args.xml))
        log.info("wrote %s", args.xml)
    if args.json:
        doc = topology_doc(topo, paths)
        doc["node_class"] = cls.as_dict()
        if args.xml:
            doc["xml"] = str(args.xml)
        out(dumps(doc))
    else:
        out(with_class_line(topology_text(topo, paths), topo, cls))
        if args.xml:
            out(f"\nWrote NCCL topology file {args.xml} (use it with NCCL_TOPO_FILE={args.xml})")
    return EXIT_OK


def cmd_topo_record(args: argparse.Namespace) -> int:
    from .topology.snapshot import record_snapshot, save_snapshot

    snap = record_snapshot(description=args.description)
    save_snapshot(snap, Path(args.out))
    out(f"Recorded {len(snap.nvml.gpus)} GPU(s), {len(snap.sysfs.pci)} PCI device(s) and "
        f"{len(snap.sysfs.nics)} network device(s) into {args.out}")
    return EXIT_OK


def cmd_topo_diff(args: argparse.Namespace) -> int:
    from .render import dumps
    from .topology.diff import diff_trees
    from .topology.source import load_topology

    a = load_topology(args.a)
    b = load_topology(args.b)
    d = diff_trees(a.system, b.system)
    if args.json:
        out(dumps({"kind": "topology-diff", "a": args.a, "b": args.b, **d.as_dict()}))
    else:
        if d.same:
            out(f"No semantic difference between {args.a} and {args.b}.")
        for p in d.only_a:
            out(f"- {p} (only in {args.a})")
        for p in d.only_b:
            out(f"+ {p} (only in {args.b})")
        for c in d.changed:
            out(f"~ {c}")
        if d.filled:
            out(f"({len(d.filled)} attribute(s) on one side only are ones NCCL fills in by itself; --json lists them)")
    return EXIT_OK if d.same else 1


def cmd_topo_check(args: argparse.Namespace) -> int:
    from .render import dumps, topocheck_doc, topocheck_text
    from .topocheck import check_topology_file

    check = check_topology_file(Path(args.xml), python=load_cfg(args).bench.python,
                                keep_dump=Path(args.dump) if args.dump else None)
    out(dumps(topocheck_doc(check)) if args.json else topocheck_text(check))
    return EXIT_OK if check.passed else 1


_HANDLERS = {
    "topo": cmd_topo,
}


# -- sweep and what it publishes ---------------------------------------------------------------------


def load_cfg(args: argparse.Namespace, *, demo: bool = False) -> Config:
    """Config file plus every command-line flag that has a config twin, folded in here once:
    nothing further down merges a flag with its setting. A demo keeps its state in ./nccltune-demo.
    """
    from .config import DEFAULT_CONFIG_PATH, load_config, with_overrides

    cfg = load_config(Path(args.config) if args.config else DEFAULT_CONFIG_PATH, required=bool(args.config))
    overrides: dict[str, object] = {}
    if args.state_dir:
        overrides["state_dir"] = str(Path(args.state_dir).resolve())
    elif demo:
        overrides["state_dir"] = str(Path("nccltune-demo").resolve())
    if getattr(args, "python", None):
        overrides["bench.python"] = args.python
    if getattr(args, "profile", None):
        overrides["sweep.profile"] = args.profile
    if getattr(args, "exhaustive", False):
        overrides["sweep.strategy"] = "exhaustive"
    if args.command == "sweep" and args.force:
        overrides["sweep.force"] = True
    unpin = [n for n in dict.fromkeys(getattr(args, "unpin", None) or []) if n not in cfg.sweep.unpin]
    if unpin:
        # --unpin sweeps a variable "although the environment or config sets it": a config pin of
        # the same name gives way (the config file itself may not name one variable in both).
        overrides["sweep.unpin"] = [*cfg.sweep.unpin, *unpin]
        if any(n in cfg.sweep.pin for n in unpin):
            overrides["sweep.pin"] = {k: v for k, v in cfg.sweep.pin.items() if k not in unpin}
    return with_overrides(cfg, **overrides) if overrides else cfg


class _Progress:
    """A live progress line on a terminal; one line per trial otherwise (the journal)."""

    def __init__(self, quiet: bool) -> None:
        self.tty = sys.stderr.isatty()
        self.quiet = quiet
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


def cmd_sweep(args: argparse.Namespace) -> int:
    from .pipeline import SweepPipeline
    from .render import dumps, plan_doc, plan_text, pruned_list, sweep_doc, sweep_text

    _check_unpin(args.unpin)
    if args.python:
        from .trials.runner import check_python

        check_python(args.python)  # before the state directory is made or anything measured
    cfg = load_cfg(args, demo=bool(args.demo))
    progress = _Progress(quiet=args.json)
    pipe = SweepPipeline(cfg, demo=args.demo, progress=progress)
    if args.plan and not pipe.node().measurable:
        from .pipeline import UNMEASURED_SUMMARY

        plan, _search = pipe.plan()  # the same checks as for a plan that measures (config, publish dir)
        text = (f"{UNMEASURED_SUMMARY}: `nccltune sweep` runs no trial here and publishes the topology file "
                "and the policy values (and the config's pins) for every job.")
        out(dumps({"kind": "plan", "trials": 0, "measured": [], "reason": UNMEASURED_SUMMARY,
                   "pruned": pruned_list(plan)}) if args.json else text)
        return EXIT_OK
    if args.plan:
        plan, search = pipe.plan()
        trials = search.estimate_trials()
        seconds = pipe.estimate_seconds(plan, trials)
        if args.json:
            out(dumps(plan_doc(plan, pipe.node(), trials, seconds, pipe.profile)))
        else:
            out(plan_text(plan, pipe.node(), trials, seconds, pipe.profile))
        return EXIT_OK
    fingerprint = pipe.node().fingerprint
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        report = pipe.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.done()
        _write_metrics(cfg, fingerprint)  # a failed or interrupted sweep is history too
    out(dumps(sweep_doc(report)) if args.json else sweep_text(report))
    return EXIT_OK


def _write_metrics(cfg: Config, fingerprint: str) -> None:
    """Rewrite the node_exporter textfile from the history (publish.metrics_dir), as the daemon does.

    A file that cannot be written is a warning: what the run published stays good.
    """
    directory = cfg.metrics_dir
    if directory is None:
        return
    from .metrics import write_metrics_from_store
    from .store import Store

    try:
        with Store(cfg.state_path("history.db")) as store:
            write_metrics_from_store(directory, store, fingerprint=fingerprint, publish_dir=cfg.publish_dir)
    except (OSError, NccltuneError) as exc:
        log.warning("cannot write metrics to %s: %s", directory, exc)


def _check_unpin(names: list[str]) -> None:
    """--unpin takes the name of a variable the sweep knows; anything else is a usage error (2)."""
    from .render import shown
    from .sweep.space import CATALOGUE, unknown_variable_hint

    for name in names:
        if name not in CATALOGUE:
            raise UsageError(f"--unpin {shown(name)!s}: not a variable nccltune sweeps",
                             hint=unknown_variable_hint(name))


def _raise_interrupt(signum: int, frame: object) -> None:
    raise Terminated


def _job_nnodes(args: argparse.Namespace) -> int | None:
    """--nnodes, else NCCLTUNE_JOB_NNODES, else None (the job does not say)."""
    from .publish import job_nnodes

    return args.nnodes if args.nnodes is not None else job_nnodes(os.environ)


def cmd_env(args: argparse.Namespace) -> int:
    """Print what is published, byte for byte as launchers read it, after checking the whole set:
    trusted owner and mode, every line one nccltune writes, one generation throughout.

    The every-job part always; the single-node part as assignments for a job known to be
    single-node (--nnodes 1), otherwise as comments that say which jobs get it (so the output
    can still be sourced or used as an env file). --format json is nccl.json: both parts, labelled.
    """
    from .publish import ENV_NAME, JSON_NAME, SH_NAME, SINGLE_ENV_NAME, SINGLE_SH_NAME, read_set
    from .render import single_node_comment

    cfg = load_cfg(args)
    nnodes = _job_nnodes(args)
    got = read_set(cfg.publish_dir)
    if got is None:
        raise CheckFailed(f"nothing is published in {cfg.publish_dir}", hint="run `nccltune sweep` first")
    fmt = "json" if args.json else args.format
    if fmt == "json":
        sys.stdout.write(got.texts[JSON_NAME])
        return EXIT_OK
    name, single_name = {"sh": (SH_NAME, SINGLE_SH_NAME), "env": (ENV_NAME, SINGLE_ENV_NAME)}[fmt]
    sys.stdout.write(got.texts[name])
    if got.single_node_env and nnodes == 1:
        sys.stdout.write(got.texts[single_name])
    elif got.single_node_env:
        sys.stdout.write(single_node_comment(got.single_node_env, nnodes))
    return EXIT_OK


# What shells return for a command that is missing (127) or cannot be run (126).
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command with the published environment: the every-job part, plus the single-node
    part when the job is known to span one node (--nnodes 1, or NCCLTUNE_JOB_NNODES=1)."""
    from .publish import job_env, read_set

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("nccltune exec: give a command after --, e.g. nccltune exec -- torchrun train.py")
    cfg = load_cfg(args)
    nnodes = _job_nnodes(args)
    got = read_set(cfg.publish_dir)
    env = dict(os.environ)
    if got is None:
        print(f"nccltune: nothing published in {cfg.publish_dir}; running with the current environment",
              file=sys.stderr)
    else:
        # The every-job part always; the single-node part only for a job known to run on one node.
        for name, value in job_env(got, nnodes).items():
            if name in env and env[name] != value:
                print(f"nccltune: {name}={env[name]} from the environment overrides the published {value}",
                      file=sys.stderr)
            else:
                env[name] = value
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"nccltune: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_RUN
    return EXIT_OK  # pragma: no cover - exec does not return


def _history(args: argparse.Namespace) -> Store:
    """The results store of the configured state directory; CheckFailed when there is none yet."""
    from .store import Store

    path = load_cfg(args).state_path("history.db")
    if not path.exists():
        raise CheckFailed(f"no history at {path}", hint="run `nccltune sweep` first")
    store = Store(path)
    _mark_dead_runs(store, path.with_name("sweep.lock"))
    return store


def _mark_dead_runs(store: Store, lock_path: Path) -> None:
    """A run still 'running' while nobody holds the sweep lock was killed (kill -9, power loss):
    record it as interrupted now rather than at the next sweep. Taking the lock proves no sweep or
    verify is live; a user who may not take it (or write the history) just sees the record as is."""
    from .lock import SweepLock, is_held

    if is_held(lock_path):
        return
    try:
        with SweepLock(lock_path):
            store.mark_interrupted()
    except (NccltuneError, OSError) as exc:
        log.debug("cannot check for interrupted runs: %s", exc)


def cmd_history(args: argparse.Namespace) -> int:
    from .render import dumps, history_doc, history_text, trials_text

    with _history(args) as store:
        if args.run is not None:
            run = store.run(args.run)
            if run is None:
                raise UsageError(f"no run {args.run} in the history")
            trials = store.trials(args.run)
            out(dumps(history_doc([run], trials)) if args.json else trials_text(run, trials))
            return EXIT_OK
        runs = store.runs(limit=args.limit)
    out(dumps(history_doc(runs, None)) if args.json else history_text(runs))
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from .render import dumps, report_doc, report_text

    with _history(args) as store:
        runs = [store.run(args.run)] if args.run is not None else store.runs(limit=1, kind="sweep")
        run = runs[0] if runs else None
        if run is None or not run.rows:
            raise CheckFailed("no finished sweep to report on")
        trials = store.trials(run.id)
    if run.kind == "verify":
        if args.plot:
            raise UsageError(f"run {run.id} is a verification: --plot needs a sweep run")
        out(dumps(report_doc(run, trials, plot=None)) if args.json else _verify_report_text(run))
        return EXIT_OK
    if args.plot:
        from .plot import plot_run

        plot_run(run, trials, Path(args.plot))
    if args.json:
        out(dumps(report_doc(run, trials, plot=args.plot)))
    else:
        out(report_text(run))
        if args.plot:
            out(f"Plot written to {args.plot}")
    return EXIT_OK


def _verify_report_text(run: object) -> str:
    """A verification's table: measured against expected bus bandwidth per size."""
    from .render import fmt_bw

    summary = getattr(run, "summary", None) or {}
    lines = [f"Verification {getattr(run, 'id', '?')} of {getattr(run, 'started_at', '?')} "
             f"({getattr(run, 'status', '?')}): {summary.get('reason', '')}"]
    for row in summary.get("rows", []):
        drift = row.get("drift_pct")
        lines.append(f"  {row.get('size_bytes')} B: measured {fmt_bw(row.get('measured_gbps'))}, expected "
                     f"{fmt_bw(row.get('expected_gbps'))}" + (f", drift {drift:+.1f}%" if drift is not None else ""))
    return "\n".join(lines)


_HANDLERS.update({
    "sweep": cmd_sweep,
    "env": cmd_env,
    "exec": cmd_exec,
    "history": cmd_history,
    "report": cmd_report,
})


# -- the service and its checks ----------------------------------------------------------------------


def cmd_daemon(args: argparse.Namespace) -> int:
    from .daemon import Daemon, DaemonOptions

    overrides: dict[str, object] = {}
    if args.state_dir:
        overrides["state_dir"] = str(Path(args.state_dir).resolve())
    elif args.demo:
        overrides["state_dir"] = str(Path("nccltune-demo").resolve())
    opts = DaemonOptions(config_path=Path(args.config) if args.config else None, overrides=overrides,
                         demo=args.demo, python=args.python, max_polls=args.max_polls,
                         poll_interval_s=args.poll_interval)
    if args.verbose == 0:
        _setup_logging(1)  # a service logs what it does
    return Daemon(opts).run()


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import default_conf_files, diagnose
    from .render import doctor_doc, doctor_text
    from .topology.paths import compute_paths
    from .topology.source import load_topology, resolve_snapshot

    cfg = load_cfg(args, demo=bool(args.demo))
    source = args.input or (str(resolve_snapshot(args.demo if isinstance(args.demo, str) else None))
                            if args.demo else cfg.topology.snapshot)
    topo = load_topology(source)
    findings = diagnose(topo, compute_paths(topo), env=dict(os.environ), publish_dir=cfg.publish_dir,
                        conf_files=default_conf_files(os.environ))
    out(dumps_doc(doctor_doc(topo, findings)) if args.json else doctor_text(topo, findings))
    return 1 if any(f.severity == "error" for f in findings) else EXIT_OK


def dumps_doc(doc: dict[str, object]) -> str:
    from .render import dumps

    return dumps(doc)


def cmd_verify(args: argparse.Namespace) -> int:
    from .node import load_node
    from .render import verify_doc, verify_text
    from .verify import NOTHING_TO_VERIFY, run_verify

    cfg = load_cfg(args, demo=bool(args.demo))
    node = load_node(cfg, args.demo)
    if not node.measurable:
        # Documented: exit 0, nothing measured and nothing recorded (README, "One-GPU nodes").
        out(dumps_doc({"kind": "verify", "passed": True, "measured": False, "reason": NOTHING_TO_VERIFY})
            if args.json else NOTHING_TO_VERIFY)
        return EXIT_OK
    result = run_verify(cfg, demo=args.demo, floor_gbps=args.floor, use_current=args.current,
                        threshold_pct=args.threshold, force=args.force, node=node)
    _write_metrics(cfg, result.fingerprint)
    out(dumps_doc(verify_doc(result)) if args.json else verify_text(result))
    return EXIT_OK if result.passed else 1


def cmd_install(args: argparse.Namespace) -> int:
    from .install import install_units

    done = install_units(Path(args.prefix), binary=args.binary, enable=not args.no_enable)
    for line in done:
        out(line)
    return EXIT_OK


_HANDLERS.update({"daemon": cmd_daemon, "doctor": cmd_doctor, "verify": cmd_verify, "install": cmd_install})


# -- one decision per class of node --------------------------------------------------------------------


def _add_fleet_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    exp = sub.add_parser("export", help="this node's sweep measurements as one JSON document (for fleet decide)")
    _common(exp)
    exp.add_argument("--run", type=int, metavar="ID", help="one run (default: every ok sweep of this topology)")
    exp.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                     help="a demo node: its state in ./nccltune-demo, its topology from the snapshot")
    exp.add_argument("--out", metavar="FILE", help="write here (atomically) instead of standard output")

    fl = sub.add_parser("fleet", help="decide for a class of nodes from their exports")
    fsub = fl.add_subparsers(dest="fleet_command", metavar="ACTION", parser_class=_Parser, required=True)
    dec = fsub.add_parser("decide", help="pool the exports of one node class into a class profile")
    _common(dec)
    dec.add_argument("exports", nargs="+", metavar="EXPORT")
    dec.add_argument("--out", required=True, metavar="PROFILE", help="the class profile to write")
    dec.add_argument("--profile", metavar="NAME", help="objective (default: the one the nodes swept for)")

    app = sub.add_parser("apply", help="publish a class profile on this node after checking it is for it")
    _common(app)
    # Not `profile`: that name is the sweep objective (sweep.profile) everywhere else.
    app.add_argument("profile_path", metavar="PROFILE",
                     help="a class profile, or a directory of them named <class id>.json")
    app.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                     help="a demo node: its state in ./nccltune-demo, its class from the snapshot")
    app.add_argument("--python", metavar="PY",
                     help="interpreter whose NCCL the node's jobs load (default: bench.python)")


def cmd_export(args: argparse.Namespace) -> int:
    from .fleet.export import build_export, dumps_export, node_identity
    from .fleet.node import load_fleet_node
    from .publish import atomic_write

    cfg = load_cfg(args, demo=bool(args.demo))
    node = load_fleet_node(cfg, args.demo)
    with _history(_with_state(args, cfg)) as store:
        doc = build_export(store, node_identity(node), args.run)
    text = dumps_export(doc)
    if args.out:
        atomic_write(Path(args.out), text)
        print(f"nccltune: exported {len(doc['runs'])} run(s) of {doc['hostname']} to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _with_state(args: argparse.Namespace, cfg: Config) -> argparse.Namespace:
    """`args` with the state directory the demo chose, for helpers that read it from args."""
    return argparse.Namespace(**{**vars(args), "state_dir": cfg.state_dir})


def cmd_fleet(args: argparse.Namespace) -> int:
    from .fleet.decide import decide, dumps_profile, load_exports, pool, rules_from
    from .publish import atomic_write

    cfg = load_cfg(args)
    exports = load_exports([Path(p) for p in args.exports])
    rules = rules_from(args.profile, pool(exports).profiles, min_gain_pct=cfg.sweep.min_gain_pct,
                       max_regression_pct=cfg.sweep.max_regression_pct, custom=cfg.sweep.profiles)
    doc = decide(exports, rules)
    atomic_write(Path(args.out), dumps_profile(doc))
    out(f"Class {doc['node_class']['id']}: {doc['evidence']['verdict']}")
    out(f"{len(exports)} node(s); profile written to {args.out}")
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    from .fleet.apply import apply_profile

    cfg = load_cfg(args, demo=bool(args.demo))
    got = apply_profile(cfg, Path(args.profile_path), demo=args.demo, python=args.python)
    out(f"Applied {got.note}: generation {got.published.generation} in {cfg.publish_dir}")
    return EXIT_OK


_HANDLERS.update({"export": cmd_export, "fleet": cmd_fleet, "apply": cmd_apply})
