"""Footprint of the idle daemon: resident memory and CPU over a window, and no torch inside.

    python bench/daemon_footprint.py --minutes 10 [--demo] [--state-dir DIR]

Starts `nccltune daemon` (with --demo on machines without GPUs), waits until its first sweep
and verify are done (a sweep is work, not idleness), then samples its RSS and CPU time for the
window. Prints peak RSS, CPU % of one core, and whether torch was ever mapped into the daemon
process (its own memory maps; the worker ranks are separate processes).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# torch's own files (its package directory, libtorch*), not any path with "torch" in it: a node's
# Python environment often lives in a directory named after torch (/opt/torch/.venv).
TORCH_FILE = re.compile(r"/site-packages/torch/|/libtorch[^/]*$")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--state-dir")
    ap.add_argument("--poll-interval", type=float, default=60.0)
    ap.add_argument("--config", help="config for the daemon (default: a small sweep so it gets idle fast)")
    args = ap.parse_args()
    state = args.state_dir or tempfile.mkdtemp(prefix="nccltune-footprint-")
    Path(state).mkdir(parents=True, exist_ok=True)
    cfg = args.config
    if cfg is None:
        cfg = str(Path(state) / "footprint.yaml")
        Path(cfg).write_text(
            "sweep: {baseline_repeats: 2, finalist_repeats: 1, max_finalists: 1,\n"
            "  variables: {NCCL_ALGO: [Ring]},\n"
            "  exclude: [NCCL_PROTO, NCCL_MIN_NCHANNELS, NCCL_MAX_NCHANNELS, NCCL_BUFFSIZE, NCCL_NTHREADS,\n"
            "            NCCL_CUMEM_ENABLE, NCCL_NVLS_ENABLE]}\n"
            "daemon: {quiet_period_s: 0}\n")
    cmd = [sys.executable, "-m", "nccltune", "daemon", "--state-dir", state, "--config", cfg,
           "--poll-interval", str(args.poll_interval)]
    if args.demo:
        cmd.append("--demo")
    # As a systemd unit runs it: with bytecode caches. Some images set PYTHONDONTWRITEBYTECODE,
    # which makes every start compile each module from source and keeps the compiler's memory
    # in the process (about 7 MiB more RSS); the caches are written once here, as pip would.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", "import nccltune.cli, nccltune.daemon.service, nccltune.pipeline"],
                   env=env, check=True)
    log_path = Path(state) / "daemon.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    p = psutil.Process(proc.pid)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = log_path.read_text()
        # Idle from here: the first verify is done, or the node has nothing to sweep or verify (one GPU).
        if any(mark in text for mark in ("verify passed", "verify:", "verify could not", "nothing to sweep or verify")):
            break
        if proc.poll() is not None:
            print(text)
            return 1
        time.sleep(1)
    time.sleep(2)
    cpu0 = sum(p.cpu_times()[:2])
    t0 = time.monotonic()
    peak = 0
    torch_mapped = False
    end = t0 + args.minutes * 60
    while time.monotonic() < end:
        rss = p.memory_info().rss
        peak = max(peak, rss)
        torch_mapped = torch_mapped or any(TORCH_FILE.search(m.path) for m in p.memory_maps(grouped=True))
        time.sleep(5)
    cpu = sum(p.cpu_times()[:2]) - cpu0
    wall = time.monotonic() - t0
    proc.terminate()
    proc.wait(30)
    print(f"idle daemon over {wall / 60:.1f} min (poll every {args.poll_interval:g} s"
          f"{', CPU demo' if args.demo else ''}):")
    print(f"  peak RSS     {peak / 2**20:.1f} MiB   (target < 60)")
    print(f"  CPU          {100 * cpu / wall:.3f} % of one core   (target < 0.2)")
    print(f"  torch mapped {'YES' if torch_mapped else 'no'}")
    print(f"  exit status  {proc.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
