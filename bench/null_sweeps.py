"""False-positive rate of the sweep's choice on a null experiment: repeated CPU demo sweeps.

The demo measures all-reduce over gloo, which ignores every NCCL variable, so every setting it
could publish is as fast as NCCL's defaults: a published non-default setting is a false positive.
Each sweep is a real `nccltune sweep --demo` subprocess with a fresh state directory and a
generated config that asks for the smallest repeat counts the config allows.

    python bench/null_sweeps.py --sweeps 20
    python bench/null_sweeps.py --sweeps 5 --tree /path/to/another/checkout
    python bench/null_sweeps.py --sweeps 20 --jobs 4   # on a machine with 8+ cores

Sweeps run side by side with --jobs: on a null experiment the extra load is only more noise.

Prints one line per sweep (chosen label, weighted gain of the medians, the sweep's summary) and
the false-positive rate: published non-default settings / sweeps. The topology file alone is
counted apart: it is published on the claim "no slower than without it", which a null experiment
satisfies, not on a claimed gain. Exit status 1 when any sweep published a non-default setting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULTS_LABEL = "NCCL defaults"
TOPO_ONLY_LABEL = "topology file only"


def weighted_gain_pct(rows: list[dict[str, Any]]) -> float:
    """Weighted geometric mean of the published/defaults ratios, as the sweep weighs sizes."""
    total = sum(float(r.get("weight", 0.0)) for r in rows if r.get("ratio"))
    if total <= 0:
        return 0.0
    acc = sum(float(r["weight"]) * math.log(float(r["ratio"])) for r in rows if r.get("ratio"))
    return 100.0 * (math.exp(acc / total) - 1.0)


def run_one(tree: Path, work: Path, baseline: int, finalist: int, finalists: int,
            timeout_s: float) -> dict[str, Any]:
    """One demo sweep in a fresh state directory; its JSON document, or an error entry."""
    work.mkdir(parents=True)
    cfg = work / "config.yaml"
    cfg.write_text(f"sweep:\n  baseline_repeats: {baseline}\n  finalist_repeats: {finalist}\n"
                   f"  max_finalists: {finalists}\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", "--json",
                           "--config", str(cfg), "--state-dir", str(work / "state")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    wall_s = time.monotonic() - started
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}", "wall_s": wall_s}
    doc: dict[str, Any] = json.loads(proc.stdout)
    doc["wall_s"] = wall_s
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweeps", type=int, default=20, help="null sweeps to run (default 20)")
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                    help="checkout whose nccltune is run (default: this one)")
    ap.add_argument("--baseline-repeats", type=int, default=2, help="sweep.baseline_repeats (default 2)")
    ap.add_argument("--finalist-repeats", type=int, default=1, help="sweep.finalist_repeats (default 1)")
    ap.add_argument("--max-finalists", type=int, default=1, help="sweep.max_finalists (default 1)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="limit per sweep in seconds")
    ap.add_argument("--jobs", type=int, default=1, help="sweeps run at the same time (default 1)")
    args = ap.parse_args()
    if args.sweeps < 1:
        ap.error("--sweeps must be at least 1")
    print(f"null sweeps: {args.sweeps} x `nccltune sweep --demo` from {args.tree.resolve()}, "
          f"baseline_repeats={args.baseline_repeats} finalist_repeats={args.finalist_repeats} "
          f"max_finalists={args.max_finalists}", flush=True)
    published = topo_only = errors = 0
    tree = args.tree.resolve()

    def one(i: int, tmp: str) -> dict[str, Any]:
        try:
            return run_one(tree, Path(tmp) / f"sweep{i:03d}", args.baseline_repeats, args.finalist_repeats,
                           args.max_finalists, args.timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {args.timeout_s:g} s", "wall_s": args.timeout_s}

    with tempfile.TemporaryDirectory(prefix="nccltune-null-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(one, i, tmp): i for i in range(1, args.sweeps + 1)}
        for fut in concurrent.futures.as_completed(futures):
            i, doc = futures[fut], fut.result()
            if "error" in doc:
                errors += 1
                print(f"{i:3d}  ERROR  {doc['error']}", flush=True)
                continue
            label = str(doc.get("chosen"))
            gain = weighted_gain_pct(list(doc.get("sizes") or []))
            if label == TOPO_ONLY_LABEL:
                topo_only += 1
                kind = "topo"
            elif label == DEFAULTS_LABEL:
                kind = "ok"
            else:
                published += 1
                kind = "FALSE+"
            print(f"{i:3d}  {kind:6s} {label:40s} gain {gain:+7.2f}%  {doc['wall_s']:5.1f} s  "
                  f"{doc.get('summary', '')}", flush=True)
    done = args.sweeps - errors
    rate = published / done if done else float("nan")
    print(f"false positives: {published}/{done} sweeps published a non-default setting (rate {rate:.2f}); "
          f"topology file alone: {topo_only}; errors: {errors}", flush=True)
    return 1 if published else 0


if __name__ == "__main__":
    sys.exit(main())
