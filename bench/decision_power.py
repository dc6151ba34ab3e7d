"""How often the decision rule publishes a real gain, and how often a false one, by pool size.

    .venv/bin/python bench/decision_power.py [--reps-scale X] [--noise gauss|recorded|both] [--sizes 1,2,3,10,100,1000]
    .venv/bin/python bench/decision_power.py --rig [--reps-scale X]
    .venv/bin/python bench/decision_power.py --boundary [--reps-scale X]

For each pool size (nodes of one class) and noise model, simulated classes (bench/decisionsim.py:
numbers drawn from the recorded 2x H200 node's defaults, Gaussian run noise of 1% or the recorded
runs' own deviations, 1% node-to-node spread) go through nccltune's own `fleet decide`:

- power +2% / +4%: both candidates truly that much faster at every size; share of classes that
  publish one of them;
- A/A: both candidates equal to the defaults; share that publish anything (goal: <= 1%);
- wrong winner: one candidate +2%, the other +4%; share that publish the +2% one;
- outlier named: +4% classes with one node at 0.75x; share where that node is named and left out
  (3 nodes or more).

Then a node's own sequential final check (sweep.strategy.final_check, sweep.finalist_repeats 3,
max_finalist_repeats 8) on the same numbers: power, A/A and the trials it made per sweep, against
a fixed 8 rounds.

`--rig` instead: the final check on numbers like the MPS socket rig's (bench/rigsim.py: three
finalists, all_reduce 1 MiB-1 GiB, the defaults spreading 10-30% between trials at the small sizes,
with or without the helper-thread runs' dips), per final-check setting (first look, ceiling,
sweep.max_final_trials): the share that publishes a finalist, the share whose choice is within 5%
of the best finalist at every size (the truth; the defaults are never that), the share publishing
a setting below the defaults by more than the margin at a size, A/A false wins, and the whole
sweep's trials per node (the rig's 10 before its final check included; the goal is 25 at most).
`--boundary`: the final check's false wins where they are likeliest, the truth on the null's
boundary: three finalists exactly as fast as the defaults with a minimum gain of 0, and one
finalist 2% slower (the margin) at two sizes and 10% faster at a third.
Prints a table; it asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decisionsim as sim

REPS = {1: 400, 2: 400, 3: 400, 10: 200, 100: 40, 1000: 8}


def fleet_row(nodes: int, noise: float | None, reps: int, rec: sim.Recorded, profile: str) -> dict[str, float]:
    counts = {"p2": 0, "p4": 0, "aa": 0, "wrong": 0, "won2v4": 0, "outlier": 0}

    def chosen(effects: tuple[float, float], seed: int) -> int | None:
        return sim.chosen_index(sim.decide_class(sim.Scenario(effects, noise), nodes, seed, rec, profile))

    for seed in range(reps):
        counts["p2"] += chosen((1.02, 1.02), seed) is not None
        counts["p4"] += chosen((1.04, 1.04), 10_000 + seed) is not None
        counts["aa"] += chosen((1.0, 1.0), 20_000 + seed) is not None
        got = chosen((1.02, 1.04), 30_000 + seed)
        if got is not None:
            counts["won2v4"] += 1
            counts["wrong"] += got == 0
        if nodes >= 3:
            prof = sim.decide_class(sim.Scenario((1.04, 1.04), noise, outlier=0.75), nodes, 40_000 + seed, rec, profile)
            named = [o["hostname"] for o in prof["evidence"].get("outliers", [])]
            counts["outlier"] += named == ["node-0000"]
    return {"power2": counts["p2"] / reps, "power4": counts["p4"] / reps, "aa": counts["aa"] / reps,
            "wrong": counts["wrong"] / max(counts["won2v4"], 1), "outlier": counts["outlier"] / reps}


def node_sweep_row(noise: float | None, reps: int, rec: sim.Recorded, first: int, last: int) -> dict[str, float]:
    """A node's own final check on simulated runs: power at +2%/+4%, A/A, mean trials."""
    from nccltune.sweep import decision
    from nccltune.sweep.strategy import Finalist, final_check

    sizes = list(rec.medians)
    weights = {("all_reduce", s): 1.0 for s in sizes}
    rule = decision.Rule(1.0, 2.0)

    def one(effect: float, seed: int) -> tuple[bool, int]:
        rng = random.Random(seed)
        fs = [Finalist({"X": str(i)}, f"c{i}") for i in range(2)]

        def measure(f: Finalist | None, _r: int) -> dict[tuple[str, int], float]:
            e = 1.0 if f is None else effect
            return {("all_reduce", s): rec.medians[s] * math.exp(math.log(e) + (
                rng.gauss(0.0, noise) if noise is not None else rng.choice(rec.residuals[s]))) for s in sizes}

        check = final_check(fs, measure, weights, rule, first=first, last=last)
        return any(f.verdict is not None and f.verdict.eligible for f in fs), check.trials

    out: dict[str, float] = {}
    for name, effect, base in (("power2", 1.02, 0), ("power4", 1.04, 10_000), ("aa", 1.0, 20_000)):
        got = [one(effect, base + s) for s in range(reps)]
        out[name] = sum(w for w, _t in got) / reps
        out[f"trials_{name}"] = sum(t for _w, t in got) / reps
    return out


RIG_SETTINGS = ((3, 3, 0, "3 fixed"), (3, 5, 0, "3..5"), (3, 8, 0, "3..8"),
                (3, 8, 15, "3..8, 15 trials"), (2, 8, 15, "2..8, 15 trials"))


def rig_rows(reps: int) -> None:
    import rigsim

    print("the rig's final check: finalists A x2.1, B x2.0 but 16% below A at 4 MiB, the topology file alone "
          "x0.97 (one finalist: A and the topology file); 2% margin, 1% minimum gain; the rig's configuration was "
          "3 fixed (2 finalists) and 3..5 (1 finalist)")
    print(f"{'noise':<7} {'case':<18} {'rounds':<28} {'published':>9} {'within 5%':>9} {'below':>6} "
          f"{'trials':>6} {'max':>4}")
    for dips in (False, True):
        for name, (case, reference) in rigsim.cases(dips).items():
            for first, last, cap, what in RIG_SETTINGS:
                if not rigsim.capped(cap):
                    print(f"{'dips' if dips else 'plain':<7} {name:<18} {what:<28} (no sweep.max_final_trials here)")
                    continue
                got = [rigsim.check(case, 7 + 1000 * i, first=first, last=last, max_trials=cap, reference=reference)
                       for i in range(reps)]
                published = sum(o.chosen is not None for o in got) / reps
                within = sum(o.within_5pct for o in got) / reps
                below = sum(o.below_defaults for o in got) / reps
                print(f"{'dips' if dips else 'plain':<7} {name:<18} {what:<28} {published:>9.3f} {within:>9.3f} "
                      f"{below:>6.3f} {sum(o.trials for o in got) / reps:>6.1f} {max(o.trials for o in got):>4}",
                      flush=True)


def boundary_rows(reps: int) -> None:
    """The final check's error rate where it is hardest to keep: the truth on the null's boundary."""
    from nccltune.sweep import decision
    from nccltune.sweep.strategy import Finalist, final_check

    mib = 1 << 20
    print("the final check's false wins on the null's boundary, 3..8 rounds, Gaussian 1% run noise (goal: <= 0.05)")

    def share(n: int, rule: decision.Rule, truth: dict[tuple[str, int], float]) -> float:
        wins = 0
        weights = {k: 1.0 for k in truth}
        for seed in range(reps):
            rng = random.Random(seed)
            fs = [Finalist({"X": str(i)}, f"c{i}") for i in range(n)]

            def measure(f: Finalist | None, _r: int, rng: random.Random = rng) -> dict[tuple[str, int], float]:
                return {k: 100.0 * (t if f is not None else 1.0) * math.exp(rng.gauss(0.0, 0.01))
                        for k, t in truth.items()}

            final_check(fs, measure, weights, rule, first=3, last=8)
            wins += any(f.verdict is not None and f.verdict.eligible for f in fs)
        return wins / reps

    gain = share(3, decision.Rule(0.0, 50.0), {("all_reduce", mib): 1.0})
    print(f"  3 finalists as fast as the defaults, minimum gain 0 (only the gain binds): {gain:.4f} of {reps}")
    slow = share(1, decision.Rule(1.0, 2.0), {("all_reduce", mib): 0.98, ("all_reduce", 64 * mib): 1.10,
                                              ("all_reduce", 1024 * mib): 0.98})
    print(f"  1 finalist +10% at 64 MiB, 2% slower (the margin) at 1 MiB and 1 GiB: {slow:.4f} of {reps}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps-scale", type=float, default=1.0)
    ap.add_argument("--noise", choices=("gauss", "recorded", "both"), default="both")
    ap.add_argument("--sizes", default="1,2,3,10,100,1000")
    ap.add_argument("--no-node", action="store_true", help="skip the node's own sequential final check")
    ap.add_argument("--profile", default="balanced", help="balanced (every size alike) or large (16 MiB and up)")
    ap.add_argument("--no-fleet", action="store_true", help="skip fleet decide's classes")
    ap.add_argument("--rig", action="store_true", help="only the final check on numbers like the MPS socket rig's")
    ap.add_argument("--boundary", action="store_true", help="only the final check's false wins on the null's boundary")
    args = ap.parse_args()
    if args.boundary:
        boundary_rows(max(2, int(6000 * args.reps_scale)))
        return 0
    if args.rig:
        rig_rows(max(2, int(1000 * args.reps_scale)))
        return 0
    rec = sim.recorded()
    noises = {"gauss": [("gaussian 1%", 0.01)], "recorded": [("recorded h200x2", None)],
              "both": [("gaussian 1%", 0.01), ("recorded h200x2", None)]}[args.noise]
    print(f"profile {args.profile}")
    if not args.no_fleet:
        print("fleet decide: power (share publishing a true gain), A/A false wins, wrong winner (+2% chosen over +4%),")
        print("outlier (a 0.75x node named and left out); 1% node spread; 3 rounds of the final check per node, "
              "12 trials per node")
        print(f"{'noise':<16} {'nodes':>5} {'reps':>5} {'power+2%':>9} {'power+4%':>9} {'A/A':>7} {'wrong':>7} "
              f"{'outlier':>8} {'s/class':>8}")
        for label, noise in noises:
            for n in (int(x) for x in args.sizes.split(",")):
                reps = max(2, int(REPS.get(n, 20) * args.reps_scale))
                t0 = time.monotonic()
                row = fleet_row(n, noise, reps, rec, args.profile)
                per = (time.monotonic() - t0) / (reps * (5 if n >= 3 else 4))
                outl = f"{row['outlier']:.3f}" if n >= 3 else "-"
                print(f"{label:<16} {n:>5} {reps:>5} {row['power2']:>9.3f} {row['power4']:>9.3f} {row['aa']:>7.3f} "
                      f"{row['wrong']:>7.3f} {outl:>8} {per:>8.2f}", flush=True)
    if args.no_node:
        return 0
    print()
    print("a node's own final check, 2 finalists: power, A/A, mean trials per final check (finalists + defaults)")
    print(f"{'noise':<16} {'rounds':>11} {'power+2%':>9} {'trials':>7} {'power+4%':>9} {'trials':>7} {'A/A':>7} "
          f"{'trials':>7}")
    for label, noise in noises:
        for first, last, what in ((3, 8, "3..8 (seq)"), (3, 3, "3 fixed"), (8, 8, "8 fixed")):
            row = node_sweep_row(noise, max(2, int(400 * args.reps_scale)), rec, first, last)
            print(f"{label:<16} {what:>11} {row['power2']:>9.3f} {row['trials_power2']:>7.1f} {row['power4']:>9.3f} "
                  f"{row['trials_power4']:>7.1f} {row['aa']:>7.3f} {row['trials_aa']:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
