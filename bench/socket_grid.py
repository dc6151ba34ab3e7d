"""The socket transport's knobs as a full grid, N NCCL hosts on one GPU, against NCCL's defaults and
the settings given with --also (what a sweep chose), all measured in the same session.

    python bench/socket_grid.py --hosts 2 --repeats 3 [--values 1,2,4] [--also 'NCCL_NSOCKS_PERTHREAD=2 ...']
        [--min-bytes 1MiB --max-bytes 1GiB] [--json OUT]

Every point is the runner's real trial (trials.runner.Runner with the launch verify uses on a
one-GPU node: each rank its own NCCL_HOSTID, NCCL's socket transport over loopback), in rounds:
each round measures every point once, in a fresh order, so drift falls on all alike. Printed per
size: the defaults' median, each point's median and ratio, the grid's best point and where the
--also settings stand against it. Run it with the CUDA MPS control daemon up (bench/gpu_env.sh's
mps_start): the ranks then run concurrently and the numbers are the socket transport's; without
it they time-slice the GPU and the numbers are artifacts. Loopback is not a NIC: these numbers
say what the knobs do to NCCL's socket transport, never what a node's network would do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nccltune.config.schema import parse_size
from nccltune.names import format_size
from nccltune.trials.launch.hosts import HostsOnOneGpuLaunch
from nccltune.trials.runner import Runner

KNOBS = ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD")
MAX_SOCKETS = 64  # NCCL refuses more than 64 sockets per connection (threads x sockets per thread)


def label(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "defaults"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--values", default="1,2,4")
    ap.add_argument("--also", action="append", default=[], help="'NAME=VALUE NAME=VALUE': one more point")
    ap.add_argument("--min-bytes", default="1MiB")
    ap.add_argument("--max-bytes", default="1GiB")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--backend", default="nccl", help="gloo: the script's own steps on a CPU (NCCL's knobs do nothing)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = []
    s, top = parse_size(args.min_bytes), parse_size(args.max_bytes)
    while s <= top:
        sizes.append(s)
        s *= args.factor
    values = args.values.split(",")
    points: list[dict[str, str]] = [{}]
    for t, n in itertools.product(values, values):
        if int(t) * int(n) <= MAX_SOCKETS:
            points.append({KNOBS[0]: t, KNOBS[1]: n})
    also = [dict(kv.split("=", 1) for kv in a.split()) for a in args.also]
    for env in also:
        if env not in points:
            points.append(env)
    work = Path(tempfile.mkdtemp(prefix="socket-grid-"))
    runner = Runner(python=args.python, backend=args.backend, nranks=args.hosts, base_env=dict(os.environ),
                    work_dir=work, timeout_s=600, launch=HostsOnOneGpuLaunch(args.hosts))
    busbw: dict[str, dict[int, list[float]]] = {label(p): {} for p in points}
    rng = random.Random(1)
    print(f"{args.hosts} NCCL hosts on one GPU, {len(points)} points x {args.repeats} rounds, sizes "
          f"{format_size(sizes[0])}..{format_size(sizes[-1])}; CUDA_MPS_PIPE_DIRECTORY="
          f"{os.environ.get('CUDA_MPS_PIPE_DIRECTORY', '(none: time-sliced)')}", flush=True)
    try:
        for r in range(args.repeats):
            order = list(points)
            rng.shuffle(order)
            for env in order:
                res = runner.run(env, sizes, warmup=args.warmup, iters=args.iters, label=f"{label(env)} #{r + 1}")
                if not res.ok:
                    print(f"  round {r + 1} {label(env)}: {res.status} {res.reason}", flush=True)
                    continue
                for m in res.sizes:
                    busbw[label(env)].setdefault(m.size_bytes, []).append(m.busbw_gbps)
            print(f"  round {r + 1} done", flush=True)
    finally:
        runner.close()
    med = {lab: {s: statistics.median(v) for s, v in got.items()} for lab, got in busbw.items()}
    base = med["defaults"]
    print()
    print(f"{'setting':<50}" + "".join(f"{format_size(s):>10}" for s in sizes) + "   (busbw GB/s, median)")
    for lab in sorted(med, key=lambda x: (x != "defaults", x)):
        print(f"{lab:<50}" + "".join(f"{med[lab].get(s, float('nan')):>10.3f}" for s in sizes))
    print()
    print(f"{'per size':<10}{'defaults':>10}{'grid best':>12}{'':>4}{'best setting':<46}"
          + "".join(f"{'also ' + str(i + 1):>14}" for i in range(len(also))))
    rows = []
    for s in sizes:
        if not any(s in med[lab] for lab in med) or s not in base:
            print(f"{format_size(s):<10} no result")
            continue
        best = max((lab for lab in med if s in med[lab]), key=lambda lab: med[lab][s])
        line = f"{format_size(s):<10}{base.get(s, float('nan')):>10.3f}{med[best][s]:>12.3f}    {best:<46}"
        row = {"size_bytes": s, "defaults": base.get(s), "best": best, "best_busbw": med[best][s], "also": []}
        for env in also:
            got = med[label(env)].get(s)
            ratio = got / med[best][s] if got else None
            line += f"{got:>8.3f} {ratio:>5.2f}" if got and ratio else f"{'-':>14}"
            row["also"].append({"setting": label(env), "busbw": got, "of_best": ratio,
                                "of_defaults": got / base[s] if got and base.get(s) else None})
        rows.append(row)
        print(line)
    # A job sets one value per knob for all sizes, so the bar a sweep's single choice can meet is
    # the best single setting over the weighted sizes (every size alike, as the rig's profile
    # weighs them): the largest geometric mean of its per-size ratios to the defaults. The
    # per-size maximum above is the largest of many noisy medians, a bar biased upwards.
    def mean_ratio(lab: str) -> float:
        got = [med[lab][s] / base[s] for s in sizes if s in med[lab] and base.get(s)]
        return statistics.geometric_mean(got) if len(got) == len(sizes) else 0.0

    single = max(med, key=mean_ratio)
    print()
    print(f"best single setting: {single} (x{mean_ratio(single):.2f} the defaults, geometric mean over sizes)")
    spread = {lab: statistics.median((max(v) - min(v)) / statistics.median(v) * 100 for v in busbw[lab].values()
                                     if len(v) > 1) if any(len(v) > 1 for v in busbw[lab].values()) else None
              for lab in busbw}
    print(f"round-to-round spread (median over sizes of range/median): defaults {spread['defaults']:.1f}%, "
          f"best single setting {spread[single]:.1f}%" if spread["defaults"] is not None and spread[single] is not None
          else "round-to-round spread: one round only")
    for env in also:
        lab = label(env)
        ratios = [med[lab][s] / med[single][s] for s in sizes if s in med[lab] and s in med[single]]
        print(f"  {lab}: x{mean_ratio(lab):.2f} the defaults; of the best single setting per size: "
              + " ".join(f"{format_size(s)} {r:.2f}" for s, r in zip(sizes, ratios, strict=False)))
    if args.json:
        Path(args.json).write_text(json.dumps({"hosts": args.hosts, "repeats": args.repeats, "runs": busbw,
                                               "medians": med, "per_size": rows, "best_single": single,
                                               "mean_ratio": {lab: mean_ratio(lab) for lab in med},
                                               "spread_pct": spread}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
