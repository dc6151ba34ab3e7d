"""What a trial costs to start: ranks forked from the rank server (bench.fork_ranks true, the
default) against ranks started by exec, in the same run, alternating trial by trial.

Each trial is the runner's real trial (trials.runner.Runner): fresh rank processes, the worker,
one small all-reduce size. Printed per way of starting: the median and the spread of the trials'
wall time (start of the ranks to the last one's exit), of the CPU time the ranks used (the
children's rusage), and, with --gpu, which algorithm NCCL logged for the candidate's NCCL_ALGO in
every trial (the candidate must reach NCCL in a forked rank as in one started by exec). The ranks'
CPU time is the total over all trials of each way (a forked rank is reaped by the rank server,
whose children's time reaches this process when the server ends): for the forked ranks it holds
the server's one import of torch.

    python bench/rank_start.py --trials 10                  # CPU: two gloo ranks
    python bench/rank_start.py --trials 10 --gpu            # NCCL: two NCCL hosts on GPU 0

--gpu forms two NCCL hosts on one GPU (each rank its own NCCL_HOSTID, as `verify` does on a
one-GPU node): their times are those of ranks time-sharing one GPU, a measure of the start only.
Exit status 1 when a trial failed or NCCL ran another algorithm than the candidate asked for.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccltune.trials.launch.hosts import HostsOnOneGpuLaunch
from nccltune.trials.runner import Runner

SIZE = 1 << 20


def children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="trials per way of starting (default 10)")
    ap.add_argument("--gpu", action="store_true", help="NCCL on GPU 0, two NCCL hosts")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_") or k == "NCCL_NVLS_ENABLE"}
    work = Path(tempfile.mkdtemp(prefix="nccltune-rank-start-"))
    runners = {}
    for fork in (True, False):
        launch = HostsOnOneGpuLaunch(2) if args.gpu else None
        runners[fork] = Runner(python=sys.executable, backend="nccl" if args.gpu else "gloo", nranks=2,
                               base_env=base, work_dir=work / ("fork" if fork else "exec"), timeout_s=180,
                               nccl_debug=args.gpu, launch=launch, fork_ranks=fork)
    walls: dict[bool, list[float]] = {True: [], False: []}
    start_cpu = children_cpu_s()
    exec_cpu = 0.0
    algos: dict[bool, list[str]] = {True: [], False: []}
    failed = False
    for i in range(args.trials):
        for fork in (True, False):
            algo = ("Ring", "Tree")[i % 2]
            before = children_cpu_s()
            result = runners[fork].run({"NCCL_ALGO": algo} if args.gpu else {}, [SIZE], warmup=2, iters=5,
                                       label=f"{'fork' if fork else 'exec'} #{i + 1}")
            if not fork:
                exec_cpu += children_cpu_s() - before
            if not result.ok:
                print(f"trial {i + 1} ({'fork' if fork else 'exec'}) failed: {result.reason}")
                failed = True
                continue
            walls[fork].append(result.wall_s)
            if args.gpu:
                ran = result.sizes[0].algo or "?"
                algos[fork].append(f"{algo}->{ran}")
                if ran.lower() != algo.lower():
                    print(f"trial {i + 1} ({'fork' if fork else 'exec'}): asked for {algo}, NCCL ran {ran}")
                    failed = True
    for runner in runners.values():
        runner.close()
    cpu = {False: exec_cpu, True: children_cpu_s() - start_cpu - exec_cpu}
    print(f"{'gpu: nccl, two NCCL hosts on GPU 0 (time-sharing: start cost only)' if args.gpu else 'cpu: gloo'}, "
          f"{args.trials} trials each, one {SIZE >> 20} MiB all-reduce per trial")
    for fork in (True, False):
        w = walls[fork]
        if not w:
            continue
        print(f"  {'forked ' if fork else 'by exec'}: trial wall median {statistics.median(w):.2f} s "
              f"(min {min(w):.2f}, max {max(w):.2f}); ranks' CPU {cpu[fork]:.1f} s in all"
              + (f"; NCCL algo {', '.join(algos[fork])}" if algos[fork] else ""))
    print(f"  work directory: {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
