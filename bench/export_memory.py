"""How much memory `nccltune export` takes, and what it writes, as the history grows.

    python bench/export_memory.py --trials 20000 --sizes 32 --work /tmp/export-bench

Builds a history of one demo node (the 2x H200 recording) with `--runs` ok sweeps of `--trials`
trials each, every trial with `--sizes` measurements, then runs `nccltune export` on it, to a
file (--out) and to stdout, each in a fresh process, and prints the history's size, each
export's peak resident memory (ru_maxrss of the process), its exit status and the bytes it wrote.
An export larger than what `nccltune fleet decide` reads is refused (exit 78) without writing.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccltune.records import MEASUREMENT_KEYS, Measurement
from nccltune.store import Store
from nccltune.topology.fingerprint import topology_fingerprint
from nccltune.topology.model import from_snapshot
from nccltune.topology.snapshot import load_snapshot
from nccltune.topology.source import bundled_topologies_dir

SNAPSHOT = bundled_topologies_dir() / "h200x2-nvswitch-vm.json"
MEASURE = """
import resource, subprocess, sys
with open(sys.argv[1], "wb") as out:
    code = subprocess.run(sys.argv[2:], stdout=out, stderr=subprocess.DEVNULL).returncode
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def build_history(state: Path, runs: int, trials: int, sizes: int) -> None:
    """The runs through the Store, their trials and measurements in bulk (one transaction per run)."""
    state.mkdir(parents=True, exist_ok=True)
    fingerprint = topology_fingerprint(from_snapshot(load_snapshot(SNAPSHOT)))
    ladder = [65536 << (2 * i) for i in range(sizes)]
    ring = json.dumps({"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, sort_keys=True)
    with Store(state / "history.db") as store:
        ids = [store.start_run(kind="sweep", fingerprint=fingerprint, backend="gloo", demo=True, profile="balanced",
                               nccl_version=None, driver_version="580.159.04", torch_version=None,
                               nccltune_version="0", hostname="vm", topology={}, config={}) for _ in range(runs)]
        for run in ids:
            store.finish_run(run, status="ok", summary={}, chosen_env={}, published_generation=None, rows=[])
    insert = (f"INSERT INTO measurements (trial_id, {', '.join(MEASUREMENT_KEYS)}) "
              f"VALUES (?{', ?' * len(MEASUREMENT_KEYS)})")
    conn = sqlite3.connect(state / "history.db")
    with conn:
        for run in ids:
            for seq in range(1, trials + 1):
                baseline = seq % 4 == 1
                trial = conn.execute(
                    "INSERT INTO trials (run_id, seq, phase, label, env_json, status, reason, wall_s, nccl_json, "
                    "started_at) VALUES (?, ?, ?, ?, ?, 'ok', NULL, 1.0, NULL, '2026-01-01T00:00:00+00:00')",
                    (run, seq, "baseline" if baseline else "final", f"trial {seq}", "{}" if baseline else ring),
                ).lastrowid
                rows = [Measurement(s, 10.0 + seq % 7, 1.0, 1.5, algo="RING", proto="SIMPLE", channels=16).to_doc()
                        for s in ladder]
                conn.executemany(insert, [(trial, *r.values()) for r in rows])
    conn.close()


def measure(argv: list[str], out: Path) -> tuple[int, int]:
    """(exit status, peak resident KiB) of `argv` in a fresh process, its stdout into `out`."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(out), *argv], capture_output=True, text=True,
                          check=True)
    code, rss = done.stdout.split()
    return int(code), int(rss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--sizes", type=int, default=16)
    ap.add_argument("--work", type=Path, required=True, help="an empty directory (or one from an earlier call)")
    args = ap.parse_args()
    state = args.work / "state"
    if not (state / "history.db").exists():
        started = time.monotonic()
        build_history(state, args.runs, args.trials, args.sizes)
        print(f"history built in {time.monotonic() - started:.0f} s")
    history_bytes = (state / "history.db").stat().st_size
    print(json.dumps({"runs": args.runs, "trials": args.trials, "sizes": args.sizes, "history_bytes": history_bytes}))
    export = [sys.executable, "-m", "nccltune", "export", "--demo", str(SNAPSHOT), "--state-dir", str(state)]
    for how, extra in (("--out", ["--out", str(args.work / "export.json")]), ("stdout", [])):
        target = args.work / "export.json"
        target.unlink(missing_ok=True)
        stdout = args.work / "stdout.json"
        started = time.monotonic()
        code, rss_kib = measure([*export, *extra], stdout)
        written = (target if how == "--out" else stdout)
        size = written.stat().st_size if written.exists() else 0
        print(json.dumps({"to": how, "exit": code, "peak_rss_mib": round(rss_kib / 1024, 1), "written_bytes": size,
                          "seconds": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
