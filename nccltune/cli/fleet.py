"""`nccltune fleet decide`: one class profile from the exports of a class of nodes; `fleet
status`: what is in force per node; `fleet upgrade`: the profile of a class's new class id after
NCCL or the driver changed, by the upgrade rule."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_OK
from .context import load_cfg, out, output_file

if TYPE_CHECKING:
    from ..config import Config
    from ..fleet.document import Export

log = logging.getLogger(__name__)


def cmd_fleet(args: argparse.Namespace) -> int:
    if args.fleet_command == "status":
        return _status(args)
    if args.fleet_command == "upgrade":
        return _upgrade(args)
    from ..files.atomicfile import atomic_write
    from ..fleet.decide import dumps_profile, load_exports
    from ..fleet.parts import summary_lines

    cfg = load_cfg(args)
    target = output_file(args.out, "class profile")
    exports = load_exports([Path(p) for p in args.exports])
    doc = _decided(args, cfg, exports)
    atomic_write(target, dumps_profile(doc))
    out(f"Class {doc['node_class']['id']}: {doc['evidence']['verdict']}")
    out(f"Tuner table: {doc['evidence']['table']['status']}")
    for line in summary_lines(doc):
        out(line)
    out(f"{len(exports)} node(s), job shape {doc['job_shape']['label']}; profile written to {args.out}")
    return EXIT_OK


def _decided(args: argparse.Namespace, cfg: Config, exports: Sequence[Export]) -> dict[str, Any]:
    """THE decision of `fleet decide` (and of `fleet upgrade --decide`) for these exports, after
    a warning for each export whose upgrade gate found sizes slower (a person deciding by hand
    sees it; the decision rule judges the samples all the same)."""
    from ..config import profile_collectives
    from ..fleet.decide import decide, rules_from
    from ..fleet.gate import slower_warning

    for e in exports:
        warning = slower_warning(e.doc, str(e.path))
        if warning is not None:
            log.warning("%s", warning)
    # The weights per collective and size a node's sweep uses for the same profile.
    custom = {name: profile_collectives(p) for name, p in cfg.sweep.profiles.items()}
    swept_for = {run["profile"] for e in exports for run in e.doc["runs"]}  # the objectives, as pool() reads them
    rules = rules_from(args.profile, swept_for, min_gain_pct=cfg.sweep.min_gain_pct,
                       max_regression_pct=cfg.sweep.max_regression_pct, custom=custom)
    # --parts (cli/parser.py): a part per measured node count, each decided from its own sweeps.
    return decide(exports, rules, by_node_count=args.parts)


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


def _upgrade(args: argparse.Namespace) -> int:
    from ..files.atomicfile import atomic_write
    from ..fleet.apply import read_profile
    from ..fleet.carry import carry, upgraded_class
    from ..fleet.decide import dumps_profile, load_exports
    from ..fleet.status import export_paths

    cfg = load_cfg(args)
    old = read_profile(Path(args.old_profile))
    exports = load_exports(export_paths([Path(p) for p in args.exports]))
    up = upgraded_class(old, exports)
    # A directory of profiles (what `apply DIR` and the daemon read): the file of the new class id.
    where = Path(args.out) / f"{up.class_id}.json" if Path(args.out).is_dir() else Path(args.out)
    target = output_file(where, "class profile")
    out(f"Class {old.class_id} -> {up.class_id} ({up.changes()}): {len(exports)} upgraded node(s); "
        f"canary {up.canary or 'none'}" + ("" if up.canary_export else " (its export not given)"))
    carried = carry(up, _decided(args, cfg, exports) if args.decide else None)
    atomic_write(target, dumps_profile(carried.doc))
    what = {"new": "decided from the upgraded nodes' exports",
            "keep": f"the values of {old.path.name}, kept on the canary's gate",
            "safe": f"the safe part of {old.path.name} alone"}[carried.outcome]
    out(f"Upgrade outcome: {carried.outcome} ({carried.why})")
    for note in carried.notes:
        out(f"  {note}")
    env = ", ".join(f"{k}={v}" for k, v in carried.doc["env"].items()) or "nothing"
    rows = len(carried.doc["tuner_table"])
    table = f"tuner table of {rows} entr{'y' if rows == 1 else 'ies'}" if rows else "no tuner table"
    out(f"Profile for class {up.class_id} ({what}): env {env}; {table}; written to {where}")
    return EXIT_OK
