"""Run-to-run noise of the worker's numbers with one timed block per size against the median of
several blocks, for NCCL's defaults and one other setting, interleaved in fresh processes.

    python bench/noise_blocks.py --repeats 5 --blocks 1,9 --env NCCL_MIN_NCHANNELS=32 --json out.json

Prints per setting and block count: the median busbw per size, its spread across trials (half
the range over the median, as the sweep computes noise) and the mean spread between blocks
within a trial.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccltune.names import format_size
from nccltune.trials.runner import Runner, find_worker_python


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", default="1,9")
    ap.add_argument("--sizes", default=",".join(str(65536 * 4**i) for i in range(8)))
    ap.add_argument("--env", action="append", default=[], metavar="'A=1 B=2'")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    settings = [("defaults", {})] + [(e, dict(kv.split("=", 1) for kv in e.split())) for e in args.env]
    block_counts = [int(b) for b in args.blocks.split(",")]
    runner = Runner(python=find_worker_python(None), backend=args.backend, nranks=2,
                    base_env={k: v for k, v in os.environ.items() if k != "NCCL_TOPO_FILE"},
                    work_dir=Path(tempfile.mkdtemp(prefix="nccltune-noise-")))
    trials: dict[str, list[dict[int, float]]] = {}
    inner: dict[str, list[dict[int, float]]] = {}
    for _ in range(args.repeats):
        for label, env in settings:
            for blocks in block_counts:
                key = f"{label} / {blocks} block(s)"
                res = runner.run(env, sizes, warmup=5, iters=20, max_blocks=blocks)
                if not res.ok:
                    print(f"{key}: {res.status} {res.reason}", file=sys.stderr)
                    continue
                trials.setdefault(key, []).append(res.busbw())
                spread = {}
                assert res.log_dir
                for line in (Path(res.log_dir) / "rank0.out").read_text().splitlines():
                    doc = json.loads(line)
                    vals = doc.get("block_busbw_gbps")
                    if vals:
                        spread[doc["size_bytes"]] = 100 * (max(vals) - min(vals)) / (2 * statistics.median(vals))
                inner.setdefault(key, []).append(spread)
    print(f"{'setting':36} {'size':>7} {'median':>8} {'trial noise%':>12} {'block noise%':>12}")
    for key, runs in trials.items():
        for s in sizes:
            vals = [r[s] for r in runs if s in r]
            med = statistics.median(vals)
            noise = 100 * (max(vals) - min(vals)) / (2 * med)
            blk = [r[s] for r in inner[key] if s in r]
            print(f"{key:36} {format_size(s):>7} {med:8.2f} {noise:12.1f} "
                  f"{(f'{statistics.mean(blk):.1f}' if blk else '-'):>12}")
    if args.json:
        Path(args.json).write_text(json.dumps({"trials": trials, "block_noise": inner}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
