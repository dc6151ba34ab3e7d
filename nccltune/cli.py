"""Command line: argument parsing and rendering only. `main(argv=None) -> int`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .errors import EXIT_OK, NccltuneError, UsageError

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="config file (default /etc/nccltune/config.yaml)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory (default /var/lib/nccltune)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nccltune", description="Topology-aware NCCL tuning for GPU nodes.")
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
    return parser


def _add_sweep_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Commands beyond `topo`; filled in as their pieces exist."""


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
    except KeyboardInterrupt:
        print("nccltune: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


def out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def resolve_path(p: str | None) -> Path | None:
    return Path(p) if p else None


# -- dispatch ----------------------------------------------------------------------------------------


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
    if args.xml:
        from .topology.ncclxml import write_xml

        write_xml(topo, Path(args.xml))
        log.info("wrote %s", args.xml)
    if args.json:
        doc = topology_doc(topo, paths)
        if args.xml:
            doc["xml"] = str(args.xml)
        out(dumps(doc))
    else:
        out(topology_text(topo, paths))
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
    raise UsageError("topo check is not available yet")


_HANDLERS = {
    "topo": cmd_topo,
}
