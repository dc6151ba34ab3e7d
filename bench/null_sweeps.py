"""False-positive rate of the sweep's choice on a null experiment: repeated CPU demo sweeps, and
`nccltune fleet decide` over their exports.

The demo measures all-reduce over gloo, which ignores every NCCL variable, so every setting it
could publish is as fast as NCCL's defaults: any published setting other than the defaults is a
false positive, the topology file alone included (it too is published only on a measured gain).
Each sweep is a real `nccltune sweep --demo` subprocess with a fresh state directory, under
one of two configs: `default` (no config file: the shipped repeat counts) and `shortest` (the
smallest repeat counts a user can write: baseline_repeats 2, finalist_repeats 1, max_finalists 1).
Then the sweeps of each config are exported (`nccltune export --demo`, each export given a
hostname of its own, as if from a node of its own) and pooled by `nccltune fleet decide`, which
must keep the defaults too.

    python bench/null_sweeps.py --sweeps 20                      # 20 of each config, then decide
    python bench/null_sweeps.py --sweeps 5 --configs shortest --tree /path/to/another/checkout
    python bench/null_sweeps.py --sweeps 20 --jobs 4             # on a machine with 8+ cores

Sweeps run side by side with --jobs: on a null experiment the extra load is only more noise.

Prints one line per sweep (config, chosen label, weighted gain of the medians, the sweep's
summary), one per fleet decision, and the false-positive rate: published non-default settings /
decisions. Exit status 1 when any sweep or decision published a non-default setting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULTS_LABEL = "NCCL defaults"
# The smallest repeat counts the config accepts; `default` writes no config file at all.
SHORTEST_CONFIG = "sweep:\n  baseline_repeats: 2\n  finalist_repeats: 1\n  max_finalists: 1\n"


def weighted_gain_pct(rows: list[dict[str, Any]]) -> float:
    """Weighted geometric mean of the published/defaults ratios, as the sweep weighs sizes."""
    total = sum(float(r.get("weight", 0.0)) for r in rows if r.get("ratio"))
    if total <= 0:
        return 0.0
    acc = sum(float(r["weight"]) * math.log(float(r["ratio"])) for r in rows if r.get("ratio"))
    return 100.0 * (math.exp(acc / total) - 1.0)


def nccltune(tree: Path, work: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    # The checkout first; a PYTHONPATH already set (libraries beside the interpreter's) stays after it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "nccltune", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


def failed(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}"


def config_args(work: Path, config: str) -> list[str]:
    args = ["--state-dir", str(work / "state")]
    if config == "shortest":
        (work / "config.yaml").write_text(SHORTEST_CONFIG)
        args += ["--config", str(work / "config.yaml")]
    return args


def plan_estimate_s(tree: Path, work: Path, config: str, timeout_s: float) -> float | None:
    """The plan's ETA for a demo sweep of this config (`sweep --plan --demo --json`)."""
    work.mkdir(parents=True)
    proc = nccltune(tree, work, "sweep", "--plan", "--demo", "--json", *config_args(work, config),
                    timeout_s=timeout_s)
    if proc.returncode != 0:
        return None
    return float(json.loads(proc.stdout)["estimate"]["seconds"])


def run_one(tree: Path, work: Path, config: str, timeout_s: float) -> dict[str, Any]:
    """One demo sweep in a fresh state directory and its export; the sweep's JSON document (with
    `export`, the export's path), or an error entry."""
    work.mkdir(parents=True)
    args = config_args(work, config)
    started = time.monotonic()
    proc = nccltune(tree, work, "sweep", "--demo", "--json", *args, timeout_s=timeout_s)
    wall_s = time.monotonic() - started
    if proc.returncode != 0:
        return {"error": failed(proc), "wall_s": wall_s}
    doc: dict[str, Any] = json.loads(proc.stdout)
    doc["wall_s"] = wall_s
    exported = nccltune(tree, work, "export", "--demo", "--out", str(work / "export.json"), *args,
                        timeout_s=timeout_s)
    doc["export"] = str(work / "export.json") if exported.returncode == 0 else None
    if exported.returncode != 0:
        doc["export_error"] = failed(exported)
    else:
        # Every demo sweep here ran on this one host; `fleet decide` counts a host once, so each
        # export stands for a node of its own (the same class, its own samples).
        path = work / "export.json"
        got = json.loads(path.read_text())
        got["hostname"] = f"null-{work.name}"
        path.write_text(json.dumps(got, indent=2) + "\n")
    return doc


def decide(tree: Path, work: Path, exports: list[str], timeout_s: float) -> dict[str, Any]:
    """`nccltune fleet decide` over null exports: the class profile, or an error entry."""
    out = work / "profile.json"
    proc = nccltune(tree, work, "fleet", "decide", *exports, "--out", str(out), timeout_s=timeout_s)
    if proc.returncode != 0:
        return {"error": failed(proc)}
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweeps", type=int, default=20, help="null sweeps per config (default 20)")
    ap.add_argument("--configs", default="default,shortest",
                    help="comma-separated: default, shortest (default: both)")
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                    help="checkout whose nccltune is run (default: this one)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="limit per sweep in seconds")
    ap.add_argument("--jobs", type=int, default=1, help="sweeps run at the same time (default 1)")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.sweeps < 1 or not configs or set(configs) - {"default", "shortest"}:
        ap.error("--sweeps must be at least 1 and --configs a list of default, shortest")
    tree = args.tree.resolve()
    print(f"null sweeps: {args.sweeps} x `nccltune sweep --demo` per config ({', '.join(configs)}) from {tree}",
          flush=True)
    published = done = errors = 0
    exports: dict[str, list[str]] = {c: [] for c in configs}

    def one(config: str, i: int, tmp: str) -> dict[str, Any]:
        try:
            return run_one(tree, Path(tmp) / f"{config}{i:03d}", config, args.timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {args.timeout_s:g} s", "wall_s": args.timeout_s}

    with tempfile.TemporaryDirectory(prefix="nccltune-null-") as tmp:
        estimates = {c: plan_estimate_s(tree, Path(tmp) / f"plan-{c}", c, args.timeout_s) for c in configs}
        walls: dict[str, list[float]] = {c: [] for c in configs}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(one, c, i, tmp): (c, i) for c in configs for i in range(1, args.sweeps + 1)}
            for fut in concurrent.futures.as_completed(futures):
                (config, i), doc = futures[fut], fut.result()
                if "error" in doc:
                    errors += 1
                    print(f"{config:8s} {i:3d}  ERROR  {doc['error']}", flush=True)
                    continue
                done += 1
                walls[config].append(float(doc["wall_s"]))
                label = str(doc.get("chosen"))
                gain = weighted_gain_pct(list(doc.get("sizes") or []))
                if label != DEFAULTS_LABEL:
                    published += 1
                if doc.get("export"):
                    exports[config].append(str(doc["export"]))
                print(f"{config:8s} {i:3d}  {'ok' if label == DEFAULTS_LABEL else 'FALSE+':6s} {label:40s} "
                      f"gain {gain:+7.2f}%  {doc['wall_s']:5.1f} s  {doc.get('summary', '')}"
                      + (f"  (export: {doc['export_error']})" if doc.get("export_error") else ""), flush=True)
        decided = decided_false = 0
        for config, paths in exports.items():
            if len(paths) < 2:
                print(f"fleet decide ({config}): fewer than two exports, not run", flush=True)
                continue
            work = Path(tmp) / f"decide-{config}"
            work.mkdir()
            got = decide(tree, work, sorted(paths), args.timeout_s)
            if "error" in got:
                errors += 1
                print(f"fleet decide ({config}, {len(paths)} exports): ERROR {got['error']}", flush=True)
                continue
            decided += 1
            chosen = str(got.get("chosen"))
            decided_false += chosen != DEFAULTS_LABEL
            print(f"fleet decide ({config}, {len(paths)} exports): "
                  f"{'ok' if chosen == DEFAULTS_LABEL else 'FALSE+'} {chosen}", flush=True)
    for config in configs:
        # The ETA is meant for a sweep that has the machine to itself: read it from --jobs 1 runs.
        if walls[config] and estimates[config]:
            med = statistics.median(walls[config])
            print(f"ETA ({config}): plan {estimates[config]:.1f} s, median wall {med:.1f} s over "
                  f"{len(walls[config])} sweeps (--jobs {args.jobs}): wall/ETA {med / estimates[config]:.2f}",
                  flush=True)
    rate = published / done if done else float("nan")
    print(f"false positives: {published}/{done} sweeps published a non-default setting (rate {rate:.2f}), "
          f"the topology file alone included; fleet decide: {decided_false}/{decided}; errors: {errors}",
          flush=True)
    return 1 if published or decided_false else 0


if __name__ == "__main__":
    sys.exit(main())
