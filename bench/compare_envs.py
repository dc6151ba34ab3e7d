"""Measure NCCL environments side by side with the runner: medians of interleaved repeats.

    python bench/compare_envs.py --repeats 5 --published /var/lib/nccltune \
        --nccl-tests ../shared/reference/h200x2-nvswitch-vm/nccl-tests/all_reduce_perf.default.txt

Every setting (NCCL defaults first, then each --env / --published one) runs in fresh rank
processes, round-robin, `--repeats` times, so drift hits all alike. Prints busbw medians per
size, the ratio to the defaults, and with --nccl-tests the deviation of our defaults from an
nccl-tests all_reduce_perf curve (in-place column, since torch's all_reduce is in place).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccltune.bench.runner import Runner, find_worker_python
from nccltune.publish import read_published
from nccltune.sweep.select import fmt_size


def parse_nccl_tests(path: Path, column: str) -> dict[int, float]:
    """busbw per size from all_reduce_perf output (column 'in' or 'out' of place)."""
    out = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 13 and re.fullmatch(r"\d+", f[0]):
            out[int(f[0])] = float(f[7] if column == "out" else f[11])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(str(65536 * 4**i) for i in range(9)))
    ap.add_argument("--env", action="append", default=[], metavar="'A=1 B=2'", help="a setting to compare")
    ap.add_argument("--published", metavar="DIR", help="compare the environment published in DIR")
    ap.add_argument("--nccl-tests", metavar="FILE", help="an all_reduce_perf output to compare the defaults with")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-debug", action="store_true", help="run without NCCL_DEBUG=INFO")
    ap.add_argument("--timing-modes", action="store_true",
                    help="also measure the defaults without prequeueing and without NCCL's INFO log")
    ap.add_argument("--json", metavar="OUT", help="write all numbers here")
    args = ap.parse_args()

    settings: list[tuple[str, dict[str, str]]] = [("defaults", {})]
    for spec in args.env:
        settings.append((spec, dict(kv.split("=", 1) for kv in spec.split())))
    if args.published:
        got = read_published(Path(args.published))
        if got is None:
            print(f"nothing published in {args.published}", file=sys.stderr)
            return 1
        env, _prov = got
        settings.append(("published", env))
    sizes = [int(s) for s in args.sizes.split(",")]
    base_env = {k: v for k, v in os.environ.items() if k != "NCCL_TOPO_FILE"}
    runner = Runner(python=find_worker_python(None), backend=args.backend, nranks=args.nranks, base_env=base_env,
                    work_dir=Path(tempfile.mkdtemp(prefix="nccltune-compare-")), nccl_debug=not args.no_debug)
    runs: dict[str, list[dict[int, float]]] = {label: [] for label, _ in settings}
    walls: dict[str, list[float]] = {label: [] for label, _ in settings}
    algo: dict[str, dict[int, str]] = {label: {} for label, _ in settings}
    t0 = time.monotonic()
    modes = {label: (True, not args.no_debug) for label, _ in settings}
    if args.timing_modes:
        for label, prequeue, debug in (("defaults, no prequeue", False, True),
                                       ("defaults, no INFO log", True, False),
                                       ("defaults, neither", False, False)):
            settings.append((label, {}))
            modes[label] = (prequeue, debug)
            runs[label], walls[label], algo[label] = [], [], {}
    for r in range(args.repeats):
        for label, env in settings:
            runner.nccl_debug = modes[label][1]
            res = runner.run(env, sizes, warmup=args.warmup, iters=args.iters, prequeue=modes[label][0])
            if not res.ok:
                print(f"{label} #{r + 1}: {res.status} {res.reason}", file=sys.stderr)
                continue
            runs[label].append(res.busbw())
            walls[label].append(res.wall_s)
            for s in res.sizes:
                if s.algo:
                    algo[label][s.size_bytes] = f"{s.algo}/{s.proto}"
    med = {label: {s: statistics.median([r[s] for r in rs if s in r]) for s in sizes if any(s in r for r in rs)}
           for label, rs in runs.items() if rs}
    print(f"{len(settings)} settings x {args.repeats} repeats in {time.monotonic() - t0:.0f} s; "
          f"median trial wall time {statistics.median(w for ws in walls.values() for w in ws):.1f} s")
    for label, env in settings:
        print(f"  {label}: {' '.join(f'{k}={v}' for k, v in sorted(env.items())) or '(NCCL defaults)'}")
    ref = parse_nccl_tests(Path(args.nccl_tests), "in") if args.nccl_tests else {}
    header = ["size", *[f"{lbl[:18]}" for lbl, _ in settings]]
    if len(settings) > 1:
        header += [f"{lbl[:12]}/def" for lbl, _ in settings[1:]]
    if ref:
        header += ["nccl-tests", "dev%"]
    header += ["algo/proto (defaults)"]
    print("  ".join(f"{h:>12}" for h in header))
    for s in sizes:
        d = med.get("defaults", {}).get(s)
        row = [fmt_size(s)]
        for label, _ in settings:
            v = med.get(label, {}).get(s)
            row.append(f"{v:.2f}" if v is not None else "-")
        for label, _ in settings[1:]:
            v = med.get(label, {}).get(s)
            row.append(f"{v / d:.3f}" if v is not None and d else "-")
        if ref:
            rv = ref.get(s)
            row += [f"{rv:.2f}" if rv else "-", f"{100 * (d - rv) / rv:+.1f}" if rv and d else "-"]
        row.append(algo.get("defaults", {}).get(s, "?"))
        print("  ".join(f"{c:>12}" for c in row))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "runs": runs, "medians": med,
                                               "walls": walls, "nccl_tests": ref, "algo": algo}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
