"""Measure NCCL environments side by side with the runner: medians of interleaved repeats.

    python bench/compare_envs.py --repeats 5 --published /var/lib/nccltune \
        --nccl-tests /path/to/all_reduce_perf.default.txt

Every setting (NCCL defaults first, then each --env / --published one) runs in fresh rank
processes, round-robin, `--repeats` times, so drift hits all alike. Prints busbw medians per
size, the ratio to the defaults, and with --nccl-tests the deviation of our defaults from an
nccl-tests all_reduce_perf curve (its out-of-place column when the worker measured out of place,
as its direct NCCL timing does, else the in-place one). `--timing-modes` adds the defaults
measured the other ways (direct NCCL calls without the CUDA graph; torch + CUDA events, with and
without prequeue; without NCCL's INFO log).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccltune.names import format_size
from nccltune.publish import read_published
from nccltune.sweep.select import profile_weights, weighted_gain_pct
from nccltune.trials import nccltests
from nccltune.trials.runner import Runner, find_worker_python


def parse_nccl_tests(path: Path, column: str) -> dict[int, float]:
    """busbw per size from all_reduce_perf output (column 'in' or 'out' of place), or the medians
    of a summary with lines like '4194304 B  median  119.41 ...' (out of place)."""
    text = path.read_text()
    rows, _version = nccltests.parse_output(text)
    if rows:
        return {r.size_bytes: (r.busbw_gbps if column == "out" else r.inplace_busbw_gbps or r.busbw_gbps)
                for r in rows}
    out: dict[int, float] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0].isdigit() and f[1:3] == ["B", "median"]:
            out.setdefault(int(f[0]), float(f[3]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(str(65536 * 4**i) for i in range(9)))
    ap.add_argument("--env", action="append", default=[], metavar="'A=1 B=2'", help="a setting to compare")
    ap.add_argument("--published", metavar="DIR", help="compare the environment published in DIR")
    ap.add_argument("--nccl-tests", metavar="[LABEL=]FILE", action="append", default=[],
                    help="an all_reduce_perf output (or a summary of medians) to compare a setting with "
                         "(LABEL: the --env text, 'published' or 'defaults', the default)")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-debug", action="store_true", help="run without NCCL_DEBUG=INFO")
    ap.add_argument("--timing-modes", action="store_true",
                    help="also measure the defaults with the other timing modes and without NCCL's INFO log")
    ap.add_argument("--profile", default="balanced", help="weights of the weighted score printed per setting")
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
    gpu_event_bw: list[dict[int, float]] = []
    method: dict[str, str] = {}
    t0 = time.monotonic()
    # label -> (worker timing, prequeue for events timing, NCCL INFO log)
    modes = {label: ("auto", True, not args.no_debug) for label, _ in settings}
    if args.timing_modes:
        for label, mode in (("defaults, no INFO log", ("auto", True, False)),
                            ("defaults, direct calls (no graph)", ("direct", True, True)),
                            ("defaults, torch+events", ("events", True, True)),
                            ("defaults, events no prequeue", ("events", False, True))):
            settings.append((label, {}))
            modes[label] = mode
            runs[label], walls[label], algo[label] = [], [], {}
    factor = 2.0 * (args.nranks - 1) / args.nranks
    for r in range(args.repeats):
        for label, env in settings:
            timing, prequeue, debug = modes[label]
            runner.nccl_debug = debug
            res = runner.run(env, sizes, warmup=args.warmup, iters=args.iters, timing=timing, prequeue=prequeue)
            if not res.ok:
                print(f"{label} #{r + 1}: {res.status} {res.reason}", file=sys.stderr)
                continue
            method[label] = res.method or "?"
            if res.start.get("placement") == "in-place" and res.start.get("direct_nccl"):
                method[label] += f" (direct NCCL unavailable: {res.start['direct_nccl']})"
            runs[label].append(res.busbw())
            walls[label].append(res.wall_s)
            if label == "defaults":
                gpu_event_bw.append({m.size_bytes: m.size_bytes / m.gpu_time_us * 1e-3 * factor
                                     for m in res.sizes if m.gpu_time_us})
            for m in res.sizes:
                if m.algo:
                    algo[label][m.size_bytes] = f"{m.algo}/{m.proto}"
    med = {label: {s: statistics.median([r[s] for r in rs if s in r]) for s in sizes if any(s in r for r in rs)}
           for label, rs in runs.items() if rs}
    print(f"{len(settings)} settings x {args.repeats} repeats in {time.monotonic() - t0:.0f} s; "
          f"median trial wall time {statistics.median(w for ws in walls.values() for w in ws):.1f} s")
    for label, env in settings:
        print(f"  {label}: {' '.join(f'{k}={v}' for k, v in sorted(env.items())) or '(NCCL defaults)'}"
              f" [{method.get(label, 'no trial finished')}]")
    refs: list[tuple[str, str, dict[int, float]]] = []  # (setting label, column, busbw per size)
    for spec in args.nccl_tests:
        label, _, file = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
        label = label or "defaults"
        column = "out" if method.get(label, "").startswith("out-of-place") else "in"
        refs.append((label, column, parse_nccl_tests(Path(file), column)))
    if any(gpu_event_bw):
        runs["defaults, GPU-event time"] = gpu_event_bw
        med["defaults, GPU-event time"] = {s: statistics.median([r[s] for r in gpu_event_bw if s in r])
                                           for s in sizes if any(s in r for r in gpu_event_bw)}
        settings.append(("defaults, GPU-event time", {}))
    header = ["size", *[f"{lbl[:18]}" for lbl, _ in settings]]
    if len(settings) > 1:
        header += [f"{lbl[:12]}/def" for lbl, _ in settings[1:]]
    for label, column, _ref in refs:
        header += [f"nccl-tests {column}", f"{label[:10]} dev%"]
    header += ["algo/proto (defaults)"]
    print("  ".join(f"{h:>12}" for h in header))
    for s in sizes:
        d = med.get("defaults", {}).get(s)
        row = [format_size(s)]
        for label, _ in settings:
            v = med.get(label, {}).get(s)
            row.append(f"{v:.2f}" if v is not None else "-")
        for label, _ in settings[1:]:
            v = med.get(label, {}).get(s)
            row.append(f"{v / d:.3f}" if v is not None and d else "-")
        for label, _column, ref in refs:
            rv, ours = ref.get(s), med.get(label, {}).get(s)
            row += [f"{rv:.2f}" if rv else "-", f"{100 * (ours - rv) / rv:+.1f}" if rv and ours else "-"]
        row.append(algo.get("defaults", {}).get(s, "?"))
        print("  ".join(f"{c:>12}" for c in row))
    weights = profile_weights(args.profile, sizes, {})
    base_med = med.get("defaults", {})
    for label, _env in settings[1:]:
        if label in med and base_med:
            print(f"weighted score ({args.profile} profile) {label}: "
                  f"{weighted_gain_pct(med[label], base_med, weights):+.2f}% vs the defaults")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "runs": runs, "medians": med, "method": method,
                                               "walls": walls, "nccl_tests": refs,
                                               "algo": algo}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
