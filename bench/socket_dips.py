"""Where the slow trials of NCCL's socket helper threads come from: N NCCL hosts on one GPU, the
defaults and helper-thread settings, each with and without an untimed start at the largest size,
in interleaved rounds, with every trial's per-block numbers and where its threads ran.

    python bench/socket_dips.py --hosts 2 --rounds 6 [--also 'NCCL_SOCKET_NTHREADS=2'] [--json OUT]

Each trial is the runner's real trial (trials.runner.Runner, the one-GPU launch verify uses: each
rank its own NCCL_HOSTID, NCCL's socket transport over loopback), timed in blocks (the median
reported, every block printed). Meanwhile a sampler reads /proc every 20 ms for the trial's
processes: each thread's name, the CPUs it was seen on and its CPU time, so a slow trial can be
matched with its threads' placement. Printed per trial: busbw per size, the blocks of the two
smallest sizes, the CPUs of NCCL's threads and what NCCL logged it ran per size
(algorithm/protocol/channels); then per setting and start the median, the lowest and the trials
below 80% of the median. Run it with the CUDA MPS control daemon up (bench/gpu_env.sh's mps_start),
else the ranks time-slice and the numbers are artifacts. Loopback is not a NIC.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nccltune.config.schema import parse_size
from nccltune.names import format_size
from nccltune.trials.launch.hosts import HostsOnOneGpuLaunch
from nccltune.trials.runner import Runner

TICK = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """Every live process below `root`, from each process's parent in /proc/PID/stat."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                text = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            parent[int(name)] = int(text[text.rindex(")") + 2:].split()[1])
    found, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


class Sampler(threading.Thread):
    """Threads of this process's descendants: name, CPUs seen on, CPU seconds, every 20 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.seen: dict[tuple[int, int], dict] = {}

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            for pid in descendants(me):
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    try:
                        text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    except OSError:
                        continue
                    name = text[text.index("(") + 1:text.rindex(")")]
                    rest = text[text.rindex(")") + 2:].split()
                    cpu, cpu_s = int(rest[36]), (int(rest[11]) + int(rest[12])) / TICK
                    entry = self.seen.setdefault((pid, int(tid)), {"name": name, "cpus": {}, "cpu_s": 0.0})
                    entry["name"], entry["cpu_s"] = name, cpu_s
                    entry["cpus"][cpu] = entry["cpus"].get(cpu, 0) + 1
            time.sleep(0.02)

    def summary(self) -> list[dict]:
        """NCCL's and torch's busy threads (at least 0.05 s of CPU): pid, name, CPUs by samples."""
        return [{"pid": pid, "tid": tid, "name": e["name"], "cpu_s": round(e["cpu_s"], 2),
                 "cpus": dict(sorted(e["cpus"].items(), key=lambda kv: -kv[1]))}
                for (pid, tid), e in sorted(self.seen.items()) if e["cpu_s"] >= 0.05]


def label(env: dict[str, str], start: int) -> str:
    return (" ".join(f"{k}={v}" for k, v in sorted(env.items())) or "defaults") + f" | start {start}"


def trial_blocks(trial_dir: Path) -> dict[int, list[float]]:
    """The worker's per-block busbw by size, from rank 0's output in the trial directory."""
    out: dict[int, list[float]] = {}
    for path in sorted(trial_dir.glob("*.out")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "size":
                out[rec["size_bytes"]] = rec.get("block_busbw_gbps") or [rec["busbw_gbps"]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--also", action="append", default=[], help="'NAME=VALUE ...': a setting besides the defaults")
    ap.add_argument("--starts", default="0,3", help="untimed calls at the largest size before the first, per point")
    ap.add_argument("--min-bytes", default="1MiB")
    ap.add_argument("--max-bytes", default="64MiB")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-blocks", type=int, default=4)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes, s = [], parse_size(args.min_bytes)
    while s <= parse_size(args.max_bytes):
        sizes.append(s)
        s *= 4
    settings = [{}] + [dict(kv.split("=", 1) for kv in a.split()) for a in (args.also or ["NCCL_SOCKET_NTHREADS=2"])]
    points = [(env, int(n)) for env in settings for n in args.starts.split(",")]
    runner = Runner(python=args.python, backend=args.backend, nranks=args.hosts, base_env=dict(os.environ),
                    work_dir=Path(tempfile.mkdtemp(prefix="socket-dips-")), timeout_s=300,
                    launch=HostsOnOneGpuLaunch(args.hosts))
    print(f"{args.hosts} NCCL hosts on one GPU, {len(points)} points x {args.rounds} rounds, "
          f"{format_size(sizes[0])}..{format_size(sizes[-1])}, warmup {args.warmup}, iters {args.iters}, "
          f"blocks <= {args.max_blocks}; os.cpu_count {os.cpu_count()}; CUDA_MPS_PIPE_DIRECTORY="
          f"{os.environ.get('CUDA_MPS_PIPE_DIRECTORY', '(none: time-sliced)')}", flush=True)
    trials: list[dict] = []
    rng = random.Random(7)
    try:
        for r in range(args.rounds):
            order = list(points)
            rng.shuffle(order)
            for env, start in order:
                sampler = Sampler()
                sampler.start()
                res = runner.run(env, sizes, warmup=args.warmup, iters=args.iters, label=label(env, start),
                                 max_blocks=args.max_blocks, start_warmup=start)
                sampler.stop.set()
                sampler.join()
                rec = {"round": r + 1, "point": label(env, start), "status": res.status,
                       "busbw": {m.size_bytes: m.busbw_gbps for m in res.sizes} if res.ok else {},
                       "blocks": trial_blocks(Path(res.log_dir)) if res.log_dir else {}, "threads": sampler.summary(),
                       # what NCCL logged it ran per size: a slow size may be where its choice changes
                       "nccl_ran": {m.size_bytes: f"{m.algo}/{m.proto}/{m.channels}" for m in res.sizes}}
                trials.append(rec)
                if args.json:  # after every trial: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps({"hosts": args.hosts, "sizes": sizes, "trials": trials},
                                                          indent=1, default=str))
                nccl = [f"{t['name']}@{','.join(map(str, list(t['cpus'])[:3]))}" for t in rec["threads"]
                        if "NCCL" in t["name"] or "ncc" in t["name"].lower()]
                print(f"  r{r + 1} {rec['point']:<34} " + " ".join(f"{rec['busbw'].get(s, 0):6.2f}" for s in sizes)
                      + "  blocks " + " | ".join(",".join(f"{b:.2f}" for b in rec["blocks"].get(s, []))
                                                   for s in sizes[:2])
                      + f"  {res.status if not res.ok else ''} threads {' '.join(nccl)}"
                      + "  ran " + " ".join(rec["nccl_ran"].get(s, "-") for s in sizes), flush=True)
    finally:
        runner.close()
    print()
    print(f"{'point':<36}" + "".join(f"{format_size(s):>20}" for s in sizes) + "   median (lowest, trials < 80%)")
    summary = {}
    for env, start in points:
        lab = label(env, start)
        row = {}
        line = f"{lab:<36}"
        for s in sizes:
            got = [t["busbw"][s] for t in trials if t["point"] == lab and s in t["busbw"]]
            if not got:
                line += f"{'-':>20}"
                continue
            med = statistics.median(got)
            low = sum(1 for g in got if g < 0.8 * med)
            row[s] = {"median": med, "lowest": min(got), "below_80pct": low, "n": len(got)}
            line += f"{med:>9.2f} ({min(got):5.2f},{low:2d})"
        summary[lab] = row
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"hosts": args.hosts, "sizes": sizes, "trials": trials,
                                               "summary": summary}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
