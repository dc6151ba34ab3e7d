"""`nccltune fleet decide`: one class profile from the exports of a class of nodes."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import EXIT_OK
from .context import load_cfg, out, output_file


def cmd_fleet(args: argparse.Namespace) -> int:
    if args.fleet_command == "status":
        return _status(args)
    from ..config import profile_collectives
    from ..files.atomicfile import atomic_write
    from ..fleet.decide import decide, dumps_profile, load_exports, rules_from
    from ..fleet.parts import summary_lines

    cfg = load_cfg(args)
    target = output_file(args.out, "class profile")
    exports = load_exports([Path(p) for p in args.exports])
    # The weights per collective and size a node's sweep uses for the same profile.
    custom = {name: profile_collectives(p) for name, p in cfg.sweep.profiles.items()}
    swept_for = {run["profile"] for e in exports for run in e.doc["runs"]}  # the objectives, as pool() reads them
    rules = rules_from(args.profile, swept_for, min_gain_pct=cfg.sweep.min_gain_pct,
                       max_regression_pct=cfg.sweep.max_regression_pct, custom=custom)
    # --parts (cli/parser.py): a part per measured node count, each decided from its own sweeps.
    doc = decide(exports, rules, by_node_count=args.parts)
    atomic_write(target, dumps_profile(doc))
    out(f"Class {doc['node_class']['id']}: {doc['evidence']['verdict']}")
    out(f"Tuner table: {doc['evidence']['table']['status']}")
    for line in summary_lines(doc):
        out(line)
    out(f"{len(exports)} node(s), job shape {doc['job_shape']['label']}; profile written to {args.out}")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    import json
    import sys

    from ..fleet.status import document, export_paths, fleet_status, render

    classes = fleet_status(export_paths([Path(p) for p in args.exports]),
                           None if args.profiles is None else Path(args.profiles))
    if args.json:
        sys.stdout.write(json.dumps(document(classes), indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(render(classes))
    return EXIT_OK
