"""What the history holds: `history`, `report`, `compare`, `import` and `export`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EXIT_OK, CheckFailed, NccltuneError, UsageError

if TYPE_CHECKING:
    from ..config import Config
    from ..store import RunRecord, TrialRecord

from .context import load_cfg, note, open_history, out, output_file, reading_cfg


def cmd_history(args: argparse.Namespace) -> int:
    from ..report.jsondoc import dumps
    from ..report.runs import history_doc, history_text, trials_text

    with open_history(args) as store:
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
    from ..report.jsondoc import dumps
    from ..report.runs import report_doc, report_text, verify_run_text

    fmt = _report_format(args)
    with open_history(args) as store:
        runs = [store.run(args.run)] if args.run is not None else store.runs(limit=1, kind="sweep")
        run = runs[0] if runs else None
        if fmt == "nccl-tests-json" or (run is not None and run.kind == "import"):
            if run is None:
                raise CheckFailed("no finished sweep to report on")
            return _report_perf(args, fmt, run, store.trials(run.id))
        if run is not None and _measured_nothing(run):
            if args.plot:
                raise CheckFailed(f"sweep {run.id} measured nothing, so there is nothing to plot: "
                                  f"{run.sweep_summary.line or ''}")
            out(dumps(report_doc(run, [], plot=None)) if fmt == "json" else
                f"Sweep {run.id} of {run.started_at} ({run.status}), fingerprint {run.fingerprint}: "
                f"{run.sweep_summary.line or 'nothing measured'}.\nNo table: it ran no trial.")
            return EXIT_OK
        # A sweep's rows are a table of the store; a verification keeps its own in its summary.
        if run is None or not (run.rows if run.kind == "sweep" else run.verify_summary.rows):
            raise CheckFailed("no finished sweep to report on")
        trials = store.trials(run.id)
    if run.kind == "verify":
        if args.plot:
            raise UsageError(f"run {run.id} is a verification: --plot needs a sweep run")
        out(dumps(report_doc(run, trials, plot=None)) if fmt == "json" else verify_run_text(run))
        return EXIT_OK
    if args.plot:
        from ..report.plot import plot_run

        plot_run(run, trials, output_file(args.plot, "plot"))
    if fmt == "json":
        out(dumps(report_doc(run, trials, plot=args.plot)))
    else:
        out(report_text(run, trials))
        if args.plot:
            out(f"Plot written to {args.plot}")
    return EXIT_OK


def _measured_nothing(run: RunRecord) -> bool:
    """A finished sweep that ran no trial (one GPU: nothing between GPUs to measure)."""
    return run.kind == "sweep" and run.status == "ok" and not run.rows and run.sweep_summary.trials == 0


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

    from ..report.jsondoc import dumps
    from ..report.nccltests_json import run_document
    from ..report.runs import import_text, report_doc

    if run.kind == "import" and args.plot:
        raise UsageError(f"run {run.id} is an import: --plot needs a sweep run")
    recorded = run.import_summary.collective if run.kind == "import" else None
    collective = args.collective or recorded or "all_reduce"
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


def cmd_compare(args: argparse.Namespace) -> int:
    from ..compare import NothingComparable, compare_runs, nothing_comparable
    from ..report.jsondoc import dumps
    from ..report.runs import compare_doc, compare_text

    with open_history(args) as store:
        try:
            comparison = compare_runs(store, args.a, args.b, args.side)
        except KeyError as exc:
            raise UsageError(f"no run {exc.args[0]} in the history", hint="see `nccltune history`") from None
        empty = nothing_comparable(store, comparison)
    out(dumps(compare_doc(comparison)) if args.json else compare_text(comparison))
    if empty is not None:
        raise NothingComparable(empty, hint="compare runs of two or more ranks that measured the same sizes")
    return 1 if comparison.slower else EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from ..files.atomicfile import FileError
    from ..files.trust import ensure_dir
    from ..report.jsondoc import dumps
    from ..report.nccltests_json import import_document, read_document, run_document
    from ..report.runs import import_doc, import_text
    from ..store import Store

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
    from ..names import short_hostname
    from ..node import load_node

    if hostname.split(".")[0] != short_hostname():
        note(f"the document was measured on {hostname}, not on this node: its topology is recorded as unknown")
        return "unknown"
    try:
        return load_node(cfg, None).fingerprint
    except (NccltuneError, OSError) as exc:
        note(f"cannot read this node's topology ({getattr(exc, 'message', exc)}): the import's topology is "
             "recorded as unknown")
        return "unknown"


def cmd_export(args: argparse.Namespace) -> int:
    """The document streamed from the history (fleet.export.write_export), through a temp file:
    --out's, renamed over it once whole; for stdout an unnamed one, copied out once whole. An
    export fleet decide would refuse is refused, and nothing is written."""
    import shutil
    import tempfile

    from ..files.atomicfile import atomic_stream
    from ..fleet.export import node_identity, write_export
    from ..fleet.member import load_fleet_node

    cfg = load_cfg(args, demo=bool(args.demo))
    target = output_file(args.out, "export file") if args.out else None
    node = load_fleet_node(cfg, args.demo)
    with open_history(_with_state(args, cfg)) as store:
        if target is not None:
            with atomic_stream(target) as fh:
                written = write_export(store, node_identity(node), fh, args.run)
            print(f"nccltune: exported {written.runs} run(s) of {written.hostname} to {args.out}", file=sys.stderr)
            return EXIT_OK
        with tempfile.TemporaryFile() as tmp:
            write_export(store, node_identity(node), tmp, args.run)
            tmp.seek(0)
            sys.stdout.flush()
            shutil.copyfileobj(tmp, sys.stdout.buffer)
            sys.stdout.buffer.flush()
    return EXIT_OK


def _with_state(args: argparse.Namespace, cfg: Config) -> argparse.Namespace:
    """`args` with the state directory the demo chose, for helpers that read it from args."""
    return argparse.Namespace(**{**vars(args), "state_dir": cfg.state_dir})
