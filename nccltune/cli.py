"""Command line: argument parsing and rendering only. `main(argv=None) -> int`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .collectives import NAMES as COLLECTIVE_NAMES
from .errors import EXIT_OK, CheckFailed, NccltuneError, UnavailableError, UsageError

if TYPE_CHECKING:
    from .config import Config
    from .doctor import Finding
    from .node import Node
    from .records import TrialResult
    from .store import RunRecord, Store, TrialRecord
    from .trials.launch import LaunchRequest

log = logging.getLogger(__name__)

# Where a demo (`sweep --demo`, bringup.sh without GPUs) keeps its state, relative to the working directory.
DEMO_STATE_DIR = "nccltune-demo"


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
        raise UsageError(f"{self.prog}: {message}", hint=_did_you_mean(self, message))


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str | None:
    """One suggestion for a mistyped subcommand, the closest of the parser's commands (difflib)."""
    import difflib
    import re

    m = re.search(r"invalid choice: '?([^' ]+)'?", message)
    if m is None:
        return None
    names = [name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
             for name in action.choices]
    close = difflib.get_close_matches(m.group(1), names, n=1)
    return f"did you mean `{parser.prog} {close[0]}`?" if close else None


# What each subcommand does and one example, shown by `nccltune COMMAND --help`.
_DESCRIBED: dict[str, tuple[str, str]] = {
    "compare": ("Compare run B with run A (ids from `nccltune history`), size by size and collective by "
                "collective. Exit 1 when B is slower than A beyond the noise at any size.",
                "nccltune compare 12 15 --side defaults"),
    "topo": ("Show the topology NCCL will see on this node: GPUs, NICs, the path type between each pair "
             "(the nvidia-smi topo -m matrix) and modelled bandwidths; optionally write NCCL's topology XML.",
             "nccltune topo --xml /tmp/topo.xml"),
    "topo record": ("Capture this node's NVML and sysfs readings as a snapshot that replays anywhere "
                    "(--input, --demo, tests).", "nccltune topo record node.json --description '8x H100 SXM'"),
    "topo check": ("Run a small NCCL job with NCCL_TOPO_FILE set to XML and report whether NCCL loaded it "
                   "and what it saw.", "nccltune topo check /tmp/topo.xml"),
    "topo diff": ("The semantic differences between two topologies (snapshots or NCCL XML); exit 1 when "
                  "they differ.", "nccltune topo diff nodeA.json nodeB.xml"),
    "sweep": ("Measure NCCL's defaults and the candidate settings this topology allows, choose the best "
              "beyond noise, and publish it for jobs (nccl.sh, nccl.env, nccl.json).", "nccltune sweep --plan"),
    "env": ("Print the published environment exactly as launchers read it, after checking the published set.",
            "nccltune env --format env > /etc/default/nccl"),
    "exec": ("Run a command with the published environment; variables already set in the calling "
             "environment win.", "nccltune exec -- torchrun --nproc-per-node 8 train.py"),
    "history": ("List past sweeps and verifications, or one run's trials.", "nccltune history --run 3"),
    "daemon": ("The node service (systemd Type=notify): sweeps when the topology, the driver or NCCL "
               "changes, verifies periodically, never while jobs hold the GPUs.",
               "nccltune daemon --demo --max-polls 3"),
    "doctor": ("Find harmful NCCL settings (environment, /etc/nccl.conf, published files) and node problems "
               "on this topology; exit 1 on an error finding.", "nccltune doctor --json"),
    "verify": ("A quick all-reduce with the published environment, compared with what the sweep measured; "
               "exit 1 on drift beyond the threshold.", "nccltune verify --floor 300"),
    "install": ("Install the systemd units, the example config, the torchrun wrapper and the Slurm prolog, "
                "and enable the service.", "nccltune install --dry-run"),
    "uninstall": ("Remove what `nccltune install` wrote, by its manifest: files changed since stay (and are "
                  "named); the state directory (history, published settings) is never touched.",
                  "nccltune uninstall --dry-run"),
    "report": ("The last (or a given) sweep's table size by size, a plot of bus bandwidth against size, or "
               "nccl-tests' JSON document (-J, format version 3) of one collective of a run.",
               "nccltune report --format nccl-tests-json --run 3 > run3.json"),
    "import": ("Read a JSON document an nccl-tests *_perf binary wrote (-J FILE.json, format version 3) into the "
               "history as a run of kind import, for `report` and `compare` beside nccltune's own runs. Never "
               "taken for a sweep's result.", "nccltune import all_reduce_perf.json"),
    "export": ("This node's sweep measurements as one JSON document, the input of `nccltune fleet decide`.",
               "nccltune export --out $(hostname).json"),
    "fleet": ("Decisions for a class of identical nodes, from their exports.",
              "nccltune fleet decide node*.json --out class.json"),
    "fleet decide": ("Pool the exports of one node class into a class profile that `nccltune apply` publishes.",
                     "nccltune fleet decide node1.json node2.json --out class.json"),
    "apply": ("Publish a class profile on this node after checking that it was decided for this node's class.",
              "nccltune apply /shared/profiles/"),
}


def _describe(parser: argparse.ArgumentParser, path: str = "") -> None:
    """Give every subcommand its description and example (one table above), recursively."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, child in action.choices.items():
            key = f"{path} {name}".strip()
            if key in _DESCRIBED:
                description, example = _DESCRIBED[key]
                child.description = textwrap.fill(description, 100)
                child.epilog = f"example:\n  {example}"
                child.formatter_class = argparse.RawDescriptionHelpFormatter
            _describe(child, key)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="config file (default /etc/nccltune/config.yaml)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory (default /var/lib/nccltune)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    # SUPPRESS: an unset flag here leaves the global one (before the command) in place.
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="warnings and errors only (no progress or notes on stderr)")


def _demo_state(p: argparse.ArgumentParser) -> None:
    p.add_argument("--demo", action="store_true",
                   help=f"read the CPU demo's state in ./{DEMO_STATE_DIR}/ (also the fallback when the state "
                        "directory has no history and ./nccltune-demo/ has)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nccltune", description="Topology-aware NCCL tuning for GPU nodes.",
        epilog="exit codes: 0 ok, 1 check failed or I/O error (disk full), 2 usage, 69 no GPU/NVML/torch, "
               "75 busy (lock held or GPUs in use), 78 bad config or input, 126/127 (exec) command not "
               "runnable/not found, 130 SIGINT, 143 SIGTERM. Without GPUs: `nccltune sweep --demo`.")
    parser.add_argument("--version", action="version", version=f"nccltune {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="warnings and errors only (no progress or notes on stderr)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    topo = sub.add_parser("topo", help="show this node's topology, record it, check or diff NCCL XML")
    _common(topo)
    topo.add_argument("--input", metavar="FILE", help="a recorded snapshot or an NCCL topology XML")
    topo.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                      help="the bundled (or given) recorded node, for machines without GPUs")
    topo.add_argument("--xml", metavar="OUT", help="write NCCL's topology XML (for NCCL_TOPO_FILE) to OUT")
    topo.add_argument("--no-nics", action="store_true", help="leave NICs out of the matrix, the JSON and the XML")
    topo.add_argument("--json", action="store_true", help="print one JSON document")
    tsub = topo.add_subparsers(dest="topo_command", metavar="ACTION", parser_class=_Parser)
    rec = tsub.add_parser("record", help="capture this node's raw readings as a replayable snapshot")
    _common(rec)
    rec.add_argument("out", metavar="OUT", help="the snapshot file to write (JSON)")
    rec.add_argument("--description", help="one line saying what machine this is")
    chk = tsub.add_parser("check", help="run a small NCCL job with this XML and report whether NCCL loaded it")
    _common(chk)
    chk.add_argument("xml", metavar="XML", help="the NCCL topology XML to try (e.g. from `nccltune topo --xml`)")
    chk.add_argument("--json", action="store_true", help="print one JSON document")
    chk.add_argument("--python", metavar="PY", help="worker interpreter (default: bench.python or auto)")
    chk.add_argument("--dump", metavar="OUT", help="also keep NCCL's own re-dump of the topology here")
    dif = tsub.add_parser("diff", help="semantic differences between two topologies (snapshot or XML)")
    _common(dif)
    dif.add_argument("a", metavar="A", help="the first topology: a snapshot, a bundled name or an NCCL XML")
    dif.add_argument("b", metavar="B", help="the second topology, compared with A")
    dif.add_argument("--json", action="store_true", help="print one JSON document")

    _add_sweep_parsers(sub)
    _add_fleet_parsers(sub)
    _describe(parser)
    return parser


def _enable_completion(parser: argparse.ArgumentParser) -> None:
    """Shell completion where argcomplete is installed (the optional `completion` extra); a no-op
    unless the shell asks for completions, and nothing at all without argcomplete."""
    try:
        import argcomplete  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def _add_sweep_parsers(sub: argparse._SubParsersAction[_Parser]) -> None:
    sw = sub.add_parser("sweep", help="measure NCCL defaults and candidates, choose, publish")
    _common(sw)
    sw.add_argument("--plan", action="store_true", help="print the plan (measured, pruned and why, ETA) and stop")
    sw.add_argument("--profile", metavar="NAME", help="objective: balanced (default), large, small, ddp, fsdp, moe, "
                    "pipeline, or a custom one (sweep.profiles)")
    sw.add_argument("--json", action="store_true", help="print one JSON document")
    sw.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                    help="run on the CPU (gloo) over a recorded topology (default: the bundled 2-GPU node)")
    sw.add_argument("--force", action="store_true", help="sweep even while compute processes use the GPUs")
    sw.add_argument("--over-profile", action="store_true",
                    help="publish this node's own result even while a class profile is in force (by default "
                         "the result is recorded, and the profile stays published)")
    sw.add_argument("--exhaustive", action="store_true", help="measure the full grid instead of the staged search")
    sw.add_argument("--unpin", action="append", default=[], metavar="NAME",
                    help="sweep a variable although the environment or config sets it")
    sw.add_argument("--python", metavar="PY", help="worker interpreter (default: bench.python, or auto)")
    sw.add_argument("--nodes", type=int, default=1, metavar="N",
                    help="measure jobs of N nodes (this one coordinates; see --join)")
    sw.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                    help="torchrun's c10d rendezvous on this node (default: this host, port 29400; PORT+1 too)")
    sw.add_argument("--join", metavar="HOST:PORT",
                    help="run the trials of the sweep coordinated at HOST:PORT (its --rdzv-endpoint)")
    sw.add_argument("--loopback", action="store_true",
                    help="single-node NIC loopback: P2P and SHM off, so traffic goes through the NICs")
    sw.add_argument("--launcher", choices=("auto", "local", "torchrun", "srun"), default="auto",
                    help="how ranks start (auto: srun inside a Slurm allocation of several nodes, torchrun "
                         "with --nodes > 1, else local)")

    env = sub.add_parser("env", help="print the published environment")
    _common(env)
    _demo_state(env)
    env.add_argument("--format", choices=("sh", "env", "json"), default="sh",
                     help="nccl.sh (to source, default), nccl.env (EnvironmentFile=, --env-file) or nccl.json")
    env.add_argument("--json", action="store_true", help="the same as --format json: both parts, labelled")
    env.add_argument("--nnodes", type=_positive_int, metavar="N",
                     help="the job's node count: 1 adds the single-node part (default: NCCLTUNE_JOB_NNODES, "
                          "else the every-job part only)")

    ex = sub.add_parser("exec", help="run a command (e.g. torchrun) with the published environment")
    _common(ex)
    ex.add_argument("--nnodes", type=_positive_int, metavar="N",
                    help="the job's node count: 1 adds the single-node part (default: NCCLTUNE_JOB_NNODES, "
                         "else the every-job part only)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...",
                    help="the command and its arguments, after --")

    hist = sub.add_parser("history", help="past sweeps and verifications")
    _common(hist)
    _demo_state(hist)
    hist.add_argument("--limit", type=_positive_int, default=20, help="newest N runs (a positive number)")
    hist.add_argument("--run", type=int, metavar="ID", help="show one run's trials")
    hist.add_argument("--json", action="store_true", help="print one JSON document")

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
    doc.add_argument("--json", action="store_true", help="print one JSON document")

    ver = sub.add_parser("verify", help="quick run of the profile's collectives with the published environment "
                         "against the last sweep")
    _common(ver)
    ver.add_argument("--profile", metavar="NAME", help="whose collectives to check (default: sweep.profile)")
    ver.add_argument("--floor", type=float, metavar="GBPS", help="fail below this busbw at the largest size")
    ver.add_argument("--current", action="store_true", help="check the calling environment, not the published one")
    ver.add_argument("--threshold", type=float, metavar="PCT", help="allowed drift (daemon.drift_threshold_pct)")
    ver.add_argument("--demo", nargs="?", const=True, default=None, metavar="SNAPSHOT",
                     help="verify the CPU demo's published setting (state in ./nccltune-demo)")
    ver.add_argument("--force", action="store_true", help="verify even while compute processes use the GPUs")
    ver.add_argument("--python", metavar="PY", help="worker interpreter (default: bench.python, or auto)")
    ver.add_argument("--json", action="store_true", help="print one JSON document")
    ver.add_argument("--baseline", type=int, metavar="RUN",
                     help="also fail (exit 1) when slower than run RUN beyond noise at any size (upgrade pipelines)")

    ins = sub.add_parser("install", help="install the systemd units and enable the service")
    _common(ins)
    ins.add_argument("--prefix", metavar="DIR",
                     help="install below DIR (images, tests); implies --no-enable unless --enable")
    ins.add_argument("--no-enable", action="store_true", help="do not run systemctl daemon-reload/enable")
    ins.add_argument("--enable", action="store_true", help="run systemctl even with --prefix")
    ins.add_argument("--binary", metavar="PATH", help="nccltune executable for ExecStart (default: this one)")
    ins.add_argument("--dry-run", action="store_true", help="print what would be written and run; write nothing")

    uns = sub.add_parser("uninstall", help="remove what install wrote (unchanged files only; never the state)")
    _common(uns)
    uns.add_argument("--prefix", metavar="DIR", help="uninstall below DIR; implies --no-disable")
    uns.add_argument("--no-disable", action="store_true", help="do not run systemctl disable/daemon-reload")
    uns.add_argument("--dry-run", action="store_true", help="print what would be removed and run; remove nothing")

    rep = sub.add_parser("report", help="the last sweep's table, or a plot of bus bandwidth against size")
    _common(rep)
    _demo_state(rep)
    rep.add_argument("--run", type=int, metavar="ID", help="a run id from `nccltune history`")
    rep.add_argument("--plot", metavar="OUT.png", help="write a plot (needs matplotlib)")
    rep.add_argument("--json", action="store_true", help="print one JSON document (the same as --format json)")
    rep.add_argument("--format", choices=("text", "json", "nccl-tests-json"),
                     help="text (default), json, or nccl-tests-json: the document all_reduce_perf -J writes "
                          "(format version 3), for one collective of the run")
    rep.add_argument("--collective", choices=COLLECTIVE_NAMES, metavar="NAME",
                     help=f"with --format nccl-tests-json: which collective ({', '.join(COLLECTIVE_NAMES)}; "
                          "default all_reduce): nccl-tests writes one document per binary")
    rep.add_argument("--setting", choices=("published", "defaults"),
                     help="with --format nccl-tests-json: the trials of the published setting (default) or of NCCL's "
                          "defaults, per size the median over them (what report and compare show)")
    rep.add_argument("--trial", type=_positive_int, metavar="SEQ",
                     help="with --format nccl-tests-json: one trial's numbers (SEQ from `nccltune history --run ID`)")
    _add_compare_parser(sub)
    _add_import_parser(sub)


def _add_import_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    imp = sub.add_parser("import", help="read an nccl-tests -J document into the history (for report and compare)")
    _common(imp)
    imp.add_argument("--demo", action="store_true",
                     help=f"store it in the CPU demo's history in ./{DEMO_STATE_DIR}/ (also where it goes when the "
                          "state directory has no history and ./nccltune-demo/ has)")
    imp.add_argument("file", metavar="FILE",
                     help="the JSON document a *_perf binary wrote with -J FILE.json (format version 3)")
    imp.add_argument("--collective", choices=COLLECTIVE_NAMES, metavar="NAME",
                     help="the collective measured, where the document's binary (args[0]) is no *_perf binary "
                          "nccltune knows (a renamed build)")
    imp.add_argument("--json", action="store_true", help="print one JSON document")


def _add_compare_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    cmp = sub.add_parser("compare", help="two runs side by side: faster, slower or the same beyond noise per size")
    _common(cmp)
    cmp.add_argument("a", type=int, metavar="RUN_A", help="the reference run")
    cmp.add_argument("b", type=int, metavar="RUN_B", help="the run judged against it")
    cmp.add_argument("--side", choices=("published", "defaults"), default="published",
                     help="compare the published setting's trials (default) or NCCL's defaults'")
    cmp.add_argument("--json", action="store_true", help="print one JSON document")


def _setup_logging(verbosity: int) -> None:
    from .logsetup import setup_logging

    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    setup_logging(level)


def main(argv: Sequence[str] | None = None) -> int:
    global QUIET
    parser = build_parser()
    _enable_completion(parser)
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        if args.command is None:
            parser.print_help()
            return EXIT_OK
        QUIET = bool(args.quiet)
        _setup_logging(-1 if QUIET else getattr(args, "verbose", 0))
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


# --quiet: warnings and errors only. Set once by main(); notes and progress on stderr look at it.
QUIET = False


def note(text: str) -> None:
    """An informational line on stderr (what a command chose for the user), silenced by --quiet."""
    if not QUIET:
        print(f"nccltune: {text}", file=sys.stderr, flush=True)


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
    from .topology.source import load_topology, resolve_snapshot

    action = getattr(args, "topo_command", None)
    if action == "record":
        return cmd_topo_record(args)
    if action == "diff":
        return cmd_topo_diff(args)
    if action == "check":
        return cmd_topo_check(args)
    source = args.input or (str(resolve_snapshot(args.demo if isinstance(args.demo, str) else None))
                            if args.demo else None)
    demo_fallback: str | None = None
    try:
        topo = load_topology(source, with_nics=not args.no_nics)
    except UnavailableError:
        demo_fallback = None if source is not None else _demo_snapshot()
        if demo_fallback is None:
            raise
        note(f"cannot read this node ({sys.exc_info()[1]}); showing the CPU demo's recorded "
             f"topology {demo_fallback} (--demo SNAPSHOT or --input FILE to choose)")
        source = demo_fallback
        topo = load_topology(source, with_nics=not args.no_nics)
    paths = compute_paths(topo)
    from .fleet.node import DEMO_NCCL, WorkerNccl, worker_nccl
    from .topology.nodeclass import node_class, with_class_line

    # One class definition (fleet.node): the NCCL version is the worker's on this node; a
    # recording or an XML says nothing of the NCCL the node ran.
    if source is None:
        nccl = worker_nccl(load_cfg(args), False)
    elif args.demo or source == demo_fallback:
        nccl = WorkerNccl(None, DEMO_NCCL)
    else:
        nccl = WorkerNccl(None, "a recorded topology holds no NCCL version (the node's own class includes it)")
    cls = node_class(load_topology(source) if args.no_nics else topo,  # NICs count for the class
                     nccl_version=nccl.version)
    version_note = f"NCCL {nccl.version}, {nccl.source}" if nccl.version else f"no NCCL version: {nccl.source}"
    if args.xml:
        from .topology.ncclxml import write_xml

        write_xml(topo, Path(args.xml))
        log.info("wrote %s", args.xml)
    if args.json:
        doc = topology_doc(topo, paths, with_nics=not args.no_nics)
        doc["node_class"] = cls.as_dict()
        doc["node_class_nccl"] = {"version": nccl.version, "source": nccl.source}
        if args.xml:
            doc["xml"] = str(args.xml)
        out(dumps(doc))
    else:
        out(with_class_line(topology_text(topo, paths, with_nics=not args.no_nics), topo, cls, version_note))
        if args.xml:
            out(f"\nWrote NCCL topology file {args.xml} (use it with NCCL_TOPO_FILE={args.xml})")
    return EXIT_OK


def _demo_snapshot() -> str | None:
    """The recorded topology the newest run in ./nccltune-demo was measured on, if there is one."""
    from .store import Store

    path = Path(DEMO_STATE_DIR).resolve() / "history.db"
    if not path.exists():
        return None
    try:
        with Store(path) as store:
            runs = store.runs(limit=1, kinds=("sweep", "verify"))  # an import measured no demo topology
    except (NccltuneError, OSError) as exc:
        log.debug("cannot read %s: %s", path, exc)
        return None
    from .topology.source import resolve_snapshot

    # A demo run names its topology "snapshot:<name or path> (CPU demo)".
    source = str(runs[0].topology.get("source", "")) if runs else ""
    if not source.startswith("snapshot:"):
        return None
    snapshot = resolve_snapshot(source.removeprefix("snapshot:").split(" (", 1)[0])
    return str(snapshot) if snapshot.is_file() else None


def cmd_topo_record(args: argparse.Namespace) -> int:
    from .topology.snapshot import record_snapshot, save_snapshot

    snap = record_snapshot(description=args.description)
    save_snapshot(snap, Path(args.out))
    out(f"Recorded {len(snap.nvml.gpus)} GPU(s), {len(snap.sysfs.pci)} PCI device(s) and "
        f"{len(snap.sysfs.nics)} network device(s) into {args.out}")
    return EXIT_OK


def cmd_topo_diff(args: argparse.Namespace) -> int:
    from .render import dumps
    from .topology.diff import diff_trees, summary_line
    from .topology.source import load_topology

    a = load_topology(args.a)
    b = load_topology(args.b)
    d = diff_trees(a.system, b.system)
    summary = summary_line(d, a, b, args.a, args.b)
    if args.json:
        out(dumps({"kind": "topology-diff", "a": args.a, "b": args.b, "summary": summary, **d.as_dict()}))
    else:
        if summary:
            out(summary)
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
        overrides["state_dir"] = str(Path(DEMO_STATE_DIR).resolve())
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
    """A live progress line on a terminal; one line per trial otherwise (the journal). Always on
    stderr, so that `--json` keeps stdout for its one document and still shows the sweep moving."""

    def __init__(self, quiet: bool) -> None:
        self.tty = sys.stderr.isatty()
        self.quiet = quiet or QUIET
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
    from .trials.launch import LaunchRequest, parse_endpoint

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
    return request


def cmd_sweep_join(args: argparse.Namespace) -> int:
    """`nccltune sweep --join HOST:PORT`: this node runs the coordinator's trials until it stops."""
    from .trials.launch import join, parse_endpoint
    from .trials.runner import find_worker_python

    given = [flag for flag, on in (("--nodes", args.nodes != 1), ("--rdzv-endpoint", args.rdzv_endpoint),
                                   ("--loopback", args.loopback), ("--plan", args.plan),
                                   ("--launcher", args.launcher != "auto")) if on]
    if given:
        raise UsageError(f"--join takes its shape from the coordinator: drop {', '.join(given)}")
    endpoint = parse_endpoint(args.join, "--join")
    cfg = load_cfg(args, demo=bool(args.demo))
    python = find_worker_python(args.python or cfg.bench.python)
    trials = join(endpoint, python=python, base_env=dict(os.environ), work_dir=Path(cfg.state_dir) / "join")
    out(f"Ran {trials} trial(s) for the coordinator at {args.join}")
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    from .pipeline import SweepPipeline
    from .render import dumps, plan_doc, plan_text, sweep_doc, sweep_text

    if args.join:
        return cmd_sweep_join(args)
    request = sweep_launch_request(args, os.environ)
    _check_unpin(args.unpin)
    if args.python:
        from .trials.runner import check_python

        check_python(args.python)  # before the state directory is made or anything measured
    cfg = load_cfg(args, demo=bool(args.demo))
    progress = _Progress(quiet=False)  # --json included: progress goes to stderr, the document to stdout
    pipe = SweepPipeline(cfg, demo=args.demo, progress=progress, launch=request, over_profile=args.over_profile)
    if args.plan and not pipe.node().measurable:
        from .pipeline import UNMEASURED_SUMMARY

        plan, _search = pipe.plan()  # the same checks as for a plan that measures (config, publish dir)
        text = (f"{UNMEASURED_SUMMARY}: `nccltune sweep` runs no trial here and publishes the topology file "
                "and the policy values (and the config's pins) for every job.")
        out(dumps(plan_doc(plan, pipe.node(), 0, 0.0, pipe.profile, unmeasured=UNMEASURED_SUMMARY))
            if args.json else text)
        return EXIT_OK
    if args.plan:
        plan, search = pipe.plan()
        trials = pipe.estimate_trials(plan, search)
        seconds = pipe.estimate_seconds(plan, trials)
        if args.json:
            out(dumps(plan_doc(plan, pipe.node(), trials, seconds, pipe.profile, pipe.workload(plan))))
        else:
            out(plan_text(plan, pipe.node(), trials, seconds, pipe.profile, pipe.workload(plan)))
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
        _write_metrics(cfg, node, report.nccl_version if report is not None else None)
    stored = _run_trials(cfg, report.run_id)
    _upgrade_gate(cfg, report.run_id)
    out(dumps(sweep_doc(report, stored)) if args.json else sweep_text(report, stored))
    return EXIT_OK


def _upgrade_gate(cfg: Config, run_id: int | None) -> None:
    """After a sweep: warn (stderr, the journal) where it is slower than the last sweep of the
    previous NCCL/driver/torch versions beyond noise (the daemon calls the same compare.upgrade_gate)."""
    from .compare import upgrade_gate
    from .store import Store

    with Store(cfg.state_path("history.db")) as store:
        upgrade_gate(store, run_id)


def _run_trials(cfg: Config, run_id: int | None) -> list[TrialRecord]:
    """The stored trials of a run this command just made (for the document's failed-trial codes)."""
    from .store import Store

    if run_id is None:
        return []
    with Store(cfg.state_path("history.db")) as store:
        return list(store.trials(run_id))


def _write_metrics(cfg: Config, node: Node, nccl_version: str | None) -> None:
    """Rewrite the node_exporter textfile from the history (publish.metrics_dir), as the daemon does,
    with the node's class (as `nccltune topo` shows it) on every series. `nccl_version` is what
    this command's worker reported; without one, the newest run of this topology that recorded one.

    A file that cannot be written is a warning: what the run published stays good.
    """
    directory = cfg.metrics_dir
    if directory is None:
        return
    from .fleet.node import fleet_node_of
    from .metrics import write_metrics_from_store
    from .store import Store

    try:
        with Store(cfg.state_path("history.db")) as store:
            if nccl_version is None and not node.demo:
                recorded = [r.nccl_version for r in store.runs(limit=None) if r.fingerprint == node.fingerprint
                            and r.nccl_version]
                nccl_version = recorded[0] if recorded else None
            write_metrics_from_store(directory, store, fingerprint=node.fingerprint,
                                     node_class=fleet_node_of(cfg, node).node_class(nccl_version).id,
                                     publish_dir=cfg.publish_dir)
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

    cfg = reading_cfg(args)
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


def reading_cfg(args: argparse.Namespace) -> Config:
    """The config of a command that only reads the state (history, report, env, topo's fallback).

    `--demo` reads ./nccltune-demo. Without it and without `--state-dir`, a state directory that
    has no history while ./nccltune-demo has one is the situation right after `bash bringup.sh`
    on a machine without GPUs: the demo's state is read, and stderr says so, so the commands a
    newcomer types next find what the sweep wrote.
    """
    demo = bool(getattr(args, "demo", False))
    cfg = load_cfg(args, demo=demo)
    if demo or args.state_dir:
        return cfg
    demo_dir = Path(DEMO_STATE_DIR).resolve()
    if not cfg.state_path("history.db").exists() and (demo_dir / "history.db").exists():
        note(f"no history in {cfg.state_dir}; reading the CPU demo's state in {demo_dir} "
             "(--state-dir DIR to choose another)")
        return with_state_dir(cfg, demo_dir)
    return cfg


def with_state_dir(cfg: Config, directory: Path) -> Config:
    from .config import with_overrides

    return with_overrides(cfg, state_dir=str(directory))


def _history(args: argparse.Namespace) -> Store:
    """The results store of the configured state directory; CheckFailed when there is none yet."""
    from .store import Store

    path = reading_cfg(args).state_path("history.db")
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

    fmt = _report_format(args)
    with _history(args) as store:
        runs = [store.run(args.run)] if args.run is not None else store.runs(limit=1, kind="sweep")
        run = runs[0] if runs else None
        if fmt == "nccl-tests-json" or (run is not None and run.kind == "import"):
            if run is None:
                raise CheckFailed("no finished sweep to report on")
            return _report_perf(args, fmt, run, store.trials(run.id))
        if run is not None and _measured_nothing(run):
            if args.plot:
                raise CheckFailed(f"sweep {run.id} measured nothing, so there is nothing to plot: "
                                  f"{(run.summary or {}).get('summary', '')}")
            out(dumps(report_doc(run, [], plot=None)) if fmt == "json" else
                f"Sweep {run.id} of {run.started_at} ({run.status}), fingerprint {run.fingerprint}: "
                f"{(run.summary or {}).get('summary', 'nothing measured')}.\nNo table: it ran no trial.")
            return EXIT_OK
        # A sweep's rows are a table of the store; a verification keeps its own in its summary.
        if run is None or not (run.rows if run.kind == "sweep" else (run.summary or {}).get("rows")):
            raise CheckFailed("no finished sweep to report on")
        trials = store.trials(run.id)
    if run.kind == "verify":
        if args.plot:
            raise UsageError(f"run {run.id} is a verification: --plot needs a sweep run")
        out(dumps(report_doc(run, trials, plot=None)) if fmt == "json" else _verify_report_text(run))
        return EXIT_OK
    if args.plot:
        from .plot import plot_run

        plot_run(run, trials, Path(args.plot))
    if fmt == "json":
        out(dumps(report_doc(run, trials, plot=args.plot)))
    else:
        out(report_text(run, trials))
        if args.plot:
            out(f"Plot written to {args.plot}")
    return EXIT_OK


def _measured_nothing(run: RunRecord) -> bool:
    """A finished sweep that ran no trial (one GPU: nothing between GPUs to measure)."""
    return run.kind == "sweep" and run.status == "ok" and not run.rows and (run.summary or {}).get("trials") == 0


def _report_format(args: argparse.Namespace) -> str:
    """--format, with --json as its short form; the nccl-tests options only go with that format.

    Raises:
        UsageError: contradicting or misplaced options (exit 2).
    """
    fmt = str(args.format or ("json" if args.json else "text"))
    if args.json and fmt != "json":
        raise UsageError(f"nccltune report: --json and --format {fmt} contradict each other")
    misplaced = [flag for flag, value in (("--collective", args.collective), ("--setting", args.setting),
                                          ("--trial", args.trial)) if value is not None]
    if misplaced and fmt != "nccl-tests-json":
        raise UsageError(f"nccltune report: {', '.join(misplaced)} only with --format nccl-tests-json")
    if args.trial is not None and args.setting is not None:
        raise UsageError("nccltune report: --trial names one trial, --setting a setting's trials: one of them")
    if args.plot and fmt == "nccl-tests-json":
        raise UsageError("nccltune report: --plot and --format nccl-tests-json: one output at a time")
    return fmt


def _report_perf(args: argparse.Namespace, fmt: str, run: RunRecord, trials: Sequence[TrialRecord]) -> int:
    """An nccl-tests document of the run (--format nccl-tests-json), or the report of an import."""
    import json

    from .nccltests_json import run_document
    from .render import dumps, import_text, report_doc

    if run.kind == "import" and args.plot:
        raise UsageError(f"run {run.id} is an import: --plot needs a sweep run")
    collective = args.collective or str((run.summary or {}).get("collective") or "all_reduce")
    doc = run_document(run, trials, collective=collective, trial_seq=args.trial, setting=args.setting or "published")
    if fmt == "nccl-tests-json":
        which = f"run {run.id}" + ("" if args.run is not None else " (the last sweep; --run ID for another)")
        note(f"{which}, {collective}: {doc['nccltune']['shows']}")
        out(json.dumps(doc, indent=2))
    elif fmt == "json":
        out(dumps(report_doc(run, trials, plot=None, perf=doc)))
    else:
        out(import_text(run, doc))
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


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare_runs
    from .render import compare_doc, compare_text, dumps

    with _history(args) as store:
        try:
            comparison = compare_runs(store, args.a, args.b, args.side)
        except KeyError as exc:
            raise UsageError(f"no run {exc.args[0]} in the history", hint="see `nccltune history`") from None
    out(dumps(compare_doc(comparison)) if args.json else compare_text(comparison))
    return 1 if comparison.slower else EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from .atomicfile import FileError
    from .nccltests_json import import_document, read_document, run_document
    from .render import dumps, import_doc, import_text
    from .store import Store
    from .trust import ensure_dir

    doc = read_document(Path(args.file), collective=args.collective)
    cfg = reading_cfg(args)
    path = cfg.state_path("history.db")
    try:
        ensure_dir(path.parent, "state directory")
    except OSError as exc:
        raise FileError(path.parent, exc, action="cannot create the state directory") from None
    fingerprint = doc.fingerprint or _node_fingerprint(cfg, doc.hostname)
    with Store(path) as store:
        run_id = import_document(store, doc, fingerprint=fingerprint)
        run = store.run(run_id)
        trials = store.trials(run_id)
    assert run is not None
    perf = run_document(run, trials, collective=doc.collective)
    if args.json:
        out(dumps(import_doc(run, perf)))
        return EXIT_OK
    out(import_text(run, perf))
    out(f"Stored as run {run_id} in {path}: `nccltune report --run {run_id}`, `nccltune compare RUN {run_id}` "
        "(RUN from `nccltune history`)")
    return EXIT_OK


def _node_fingerprint(cfg: Config, hostname: str) -> str:
    """This node's topology fingerprint, for a document measured here (its hostname is this
    node's); "unknown" for one from elsewhere, or where the node cannot be read (no NVML)."""
    from .names import short_hostname
    from .node import load_node

    if hostname.split(".")[0] != short_hostname():
        note(f"the document was measured on {hostname}, not on this node: its topology is recorded as unknown")
        return "unknown"
    try:
        return load_node(cfg, None).fingerprint
    except (NccltuneError, OSError) as exc:
        note(f"cannot read this node's topology ({getattr(exc, 'message', exc)}): the import's topology is "
             "recorded as unknown")
        return "unknown"


_HANDLERS.update({
    "import": cmd_import,
    "compare": cmd_compare,
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
        overrides["state_dir"] = str(Path(DEMO_STATE_DIR).resolve())
    opts = DaemonOptions(config_path=Path(args.config) if args.config else None, overrides=overrides,
                         demo=args.demo, python=args.python, max_polls=args.max_polls,
                         poll_interval_s=args.poll_interval)
    if args.verbose == 0 and not QUIET:
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
                        conf_files=default_conf_files(os.environ), tuner_mode=cfg.tuner.plugin)
    findings += _history_findings(cfg, topo)
    out(dumps_doc(doctor_doc(topo, findings)) if args.json else doctor_text(topo, findings))
    return 1 if any(f.severity == "error" for f in findings) else EXIT_OK


def _history_findings(cfg: Config, topo: object) -> list[Finding]:
    """What this node's history says: the upgrade gate's finding, a verify that found the node
    below its class."""
    from .doctor import history_findings
    from .store import Store
    from .topology.fingerprint import topology_fingerprint
    from .topology.model import Topology

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
                        threshold_pct=args.threshold, force=args.force, node=node, baseline_run=args.baseline)
    _write_metrics(cfg, node, result.nccl_version)
    out(dumps_doc(verify_doc(result)) if args.json else verify_text(result))
    return EXIT_OK if result.passed else 1


def cmd_install(args: argparse.Namespace) -> int:
    from .install import install_units

    if args.enable and args.no_enable:
        raise UsageError("nccltune install: --enable and --no-enable contradict each other")
    # Below a prefix (an image, a test root) the running system's systemd is not the one to tell.
    enable = args.enable or (args.prefix is None and not args.no_enable)
    done = install_units(Path(args.prefix or "/"), binary=args.binary, enable=enable, dry_run=args.dry_run)
    for line in done:
        out(line)
    return EXIT_OK


def cmd_uninstall(args: argparse.Namespace) -> int:
    from .install import uninstall

    done = uninstall(Path(args.prefix or "/"), disable=args.prefix is None and not args.no_disable,
                     dry_run=args.dry_run)
    for line in done:
        out(line)
    return EXIT_OK


_HANDLERS.update({"daemon": cmd_daemon, "doctor": cmd_doctor, "verify": cmd_verify, "install": cmd_install,
                  "uninstall": cmd_uninstall})


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
    dec.add_argument("exports", nargs="+", metavar="EXPORT", help="files written by `nccltune export` on each node")
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
    from .config import profile_collectives
    from .fleet.decide import decide, dumps_profile, load_exports, pool, rules_from
    from .publish import atomic_write

    cfg = load_cfg(args)
    exports = load_exports([Path(p) for p in args.exports])
    # The weights per collective and size a node's sweep uses for the same profile.
    custom = {name: profile_collectives(p) for name, p in cfg.sweep.profiles.items()}
    rules = rules_from(args.profile, pool(exports).profiles, min_gain_pct=cfg.sweep.min_gain_pct,
                       max_regression_pct=cfg.sweep.max_regression_pct, custom=custom)
    doc = decide(exports, rules)
    atomic_write(Path(args.out), dumps_profile(doc))
    out(f"Class {doc['node_class']['id']}: {doc['evidence']['verdict']}")
    out(f"Tuner table: {doc['evidence']['table']['status']}")
    out(f"{len(exports)} node(s), job shape {doc['job_shape']['label']}; profile written to {args.out}")
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    from .fleet.apply import apply_profile

    cfg = load_cfg(args, demo=bool(args.demo))
    got = apply_profile(cfg, Path(args.profile_path), demo=args.demo, python=args.python)
    out(f"Applied {got.note}: generation {got.published.generation} in {cfg.publish_dir}")
    return EXIT_OK


_HANDLERS.update({"export": cmd_export, "fleet": cmd_fleet, "apply": cmd_apply})
