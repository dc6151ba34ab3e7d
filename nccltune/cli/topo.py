"""`nccltune topo` and its actions: show, record, diff, check."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..errors import EXIT_OK, EXIT_UNAVAILABLE, NccltuneError, UnavailableError
from .context import DEMO_STATE_DIR, absolute, load_cfg, out, output_file

log = logging.getLogger(__name__)


def cmd_topo(args: argparse.Namespace) -> int:
    from ..report.jsondoc import dumps
    from ..report.machine import topology_doc, topology_text
    from ..topology.paths import compute_paths
    from ..topology.source import load_topology, resolve_snapshot

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
        # Shown so that a user without a GPU sees what topo prints, but never as this node's
        # reading: a script that asked for the node gets 69 (EX_UNAVAILABLE) either way.
        print(f"nccltune: cannot read this node ({sys.exc_info()[1]}); showing the CPU demo's recorded "
              f"topology {demo_fallback} instead, NOT this node's, and exiting 69 (--demo SNAPSHOT or "
              "--input FILE to choose a recording)", file=sys.stderr, flush=True)
        source = demo_fallback
        topo = load_topology(source, with_nics=not args.no_nics)
    paths = compute_paths(topo)
    from ..fleet.member import DEMO_NCCL, WorkerNccl, worker_nccl
    from ..topology.nodeclass import node_class, with_class_line

    # One class definition (fleet.member): the NCCL version is the worker's on this node; a
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
        from ..topology.ncclxml import write_xml

        write_xml(topo, output_file(args.xml, "topology XML"))
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
    return EXIT_UNAVAILABLE if demo_fallback is not None else EXIT_OK


def _demo_snapshot() -> str | None:
    """The recorded topology the newest run in ./nccltune-demo was measured on, if there is one."""
    from ..store import Store

    path = absolute(DEMO_STATE_DIR) / "history.db"
    if not path.exists():
        return None
    try:
        with Store(path) as store:
            runs = store.runs(limit=1, kinds=("sweep", "verify"))  # an import measured no demo topology
    except (NccltuneError, OSError) as exc:
        log.debug("cannot read %s: %s", path, exc)
        return None
    from ..topology.source import resolve_snapshot

    # A demo run names its topology "snapshot:<name or path> (CPU demo)".
    source = str(runs[0].topology.get("source", "")) if runs else ""
    if not source.startswith("snapshot:"):
        return None
    snapshot = resolve_snapshot(source.removeprefix("snapshot:").split(" (", 1)[0])
    return str(snapshot) if snapshot.is_file() else None


def cmd_topo_record(args: argparse.Namespace) -> int:
    from ..topology.snapshot import record_snapshot, save_snapshot

    target = output_file(args.out, "snapshot file")
    snap = record_snapshot(description=args.description)
    save_snapshot(snap, target)
    out(f"Recorded {len(snap.nvml.gpus)} GPU(s), {len(snap.sysfs.pci)} PCI device(s) and "
        f"{len(snap.sysfs.nics)} network device(s) into {args.out}")
    return EXIT_OK


def cmd_topo_diff(args: argparse.Namespace) -> int:
    from ..report.jsondoc import dumps
    from ..topology.diff import diff_trees, summary_line
    from ..topology.source import load_topology

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
    from ..checks.topocheck import check_topology_file
    from ..report.jsondoc import dumps
    from ..report.machine import topocheck_doc, topocheck_text

    bench = load_cfg(args).bench
    check = check_topology_file(Path(args.xml), python=bench.python, bench_user=bench.user,
                                keep_dump=output_file(args.dump, "topology re-dump") if args.dump else None)
    out(dumps(topocheck_doc(check)) if args.json else topocheck_text(check))
    return EXIT_OK if check.passed else 1
