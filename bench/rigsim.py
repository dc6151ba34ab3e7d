"""A node's final check on numbers like the MPS socket rig's (bench/results/h100x1-2026-12-07/README.md:
two NCCL hosts on one H100 over NCCL's socket transport, all_reduce 1 MiB-1 GiB weighted alike), for
bench/decision_power.py and the tests that pin the final check.

The truth. NCCL's defaults at the rig grid's medians (GB/s); three finalists as the two-finalist
sweep had them: A (helper threads, one socket each) about x2.1 the defaults, B (two sockets each)
about x2.0 but 16% below A at 4 MiB and 11% at 64 MiB, so that only A is within 5% of the best
finalist at every size; and the topology file alone, 3% below the defaults. In the A/A case all
three are the defaults. In the "A slower at 1 MiB" case A is 5% below the defaults there (x2.1
elsewhere): publishing it would put a size below the defaults beyond the 2% margin.

The noise. ln(busbw) of a trial is the truth plus sd(size) x (0.6 z_trial + 0.8 z_size): a part
shared by every size of the trial and a part of each size. The defaults (and the topology file
alone, which runs NCCL's socket path as the defaults do) have sd 0.12 from 1 to 16 MiB, 0.09 at 64
MiB, 0.07 above: three trials then spread by 10-30% at the small sizes, as the rig's did. A
finalist with helper threads has sd 0.06, and at 1-64 MiB a trial's size dips to between 0.4x and
0.8x of its usual with probability 0.15: the rig grid's runs of those settings were mostly within
6% of each other, with single runs at half speed (4.66 and 2.28 GB/s at 4 MiB).

Before the final check the rig's sweep made 10 trials (2 runs of the defaults, 6 screening runs,
the topology file alone, 1 combination); the goal is at most 25 in all, so the final check may
take 15.
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass

from nccltune.sweep import decision
from nccltune.sweep.strategy import Finalist, final_check

MiB = 1 << 20
SIZES = (MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)
DEFAULTS = (2.16, 2.90, 3.28, 3.31, 3.43, 3.81)  # the rig grid's medians of NCCL's defaults, GB/s
SD_DEFAULTS = (0.12, 0.12, 0.12, 0.09, 0.07, 0.07)
SD_THREADS = (0.06,) * 6
DIP = (0.15, 0.15, 0.15, 0.15, 0.0, 0.0)  # the chance of a helper-thread run's dip at each size
NO_DIP = (0.0,) * 6
SHARED = 0.6  # the share of a trial's noise common to all its sizes (as a correlation)
BEFORE = 10  # the rig sweep's trials before its final check
BUDGET = 25
KEYS = tuple(("all_reduce", s) for s in SIZES)
WEIGHTS = {k: 1.0 for k in KEYS}
RULE = decision.Rule(1.0, 2.0)

Truth = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]  # ratio, sd, dip chance per size
# name -> (ratio to the defaults per size, noise sd per size, dip chance per size)
RIG: dict[str, Truth] = {
    "A": ((1.60, 2.20, 2.20, 2.30, 2.30, 2.30), SD_THREADS, DIP),
    "B": ((1.65, 1.85, 2.15, 2.05, 2.10, 2.15), SD_THREADS, DIP),
    "topo": ((0.97,) * 6, SD_DEFAULTS, NO_DIP),
}
AA: dict[str, Truth] = {name: ((1.0,) * 6, SD_DEFAULTS, NO_DIP) for name in RIG}
A_SLOW: dict[str, Truth] = {**RIG, "A": ((0.95, 2.10, 2.10, 2.10, 2.10, 2.10), SD_THREADS, DIP)}


def cases(dips: bool = True) -> dict[str, tuple[dict[str, Truth], dict[str, Truth]]]:
    """name -> (the finalists, the settings the best at each size is taken from): the rig's case,
    the same with one finalist (A and the topology file alone, as FINALISTS=1 runs it; B still
    counts for the best), A/A and A slower at 1 MiB; without `dips`, no helper-thread run dips."""
    def plain(case: dict[str, Truth]) -> dict[str, Truth]:
        return case if dips else {n: (r, sd, NO_DIP) for n, (r, sd, _d) in case.items()}
    rig, slow = plain(RIG), plain(A_SLOW)
    return {"rig": (rig, rig), "rig, 1 finalist": ({n: t for n, t in rig.items() if n != "B"}, rig),
            "A/A": (AA, AA), "A slower at 1 MiB": (slow, slow)}


@dataclass(frozen=True)
class Outcome:
    chosen: str | None
    trials: int  # of the whole sweep: BEFORE + the final check's
    within_5pct: bool  # the chosen setting within 5% of the best setting at every size (truth)
    below_defaults: bool  # the chosen setting below the defaults by more than the 2% margin at a size


def _run(truth: Truth, rng: random.Random) -> dict[tuple[str, int], float]:
    ratio, sd, dip = truth
    shared = rng.gauss(0.0, 1.0)
    own = math.sqrt(1.0 - SHARED * SHARED)
    out = {}
    for i, k in enumerate(KEYS):
        x = sd[i] * (SHARED * shared + own * rng.gauss(0.0, 1.0))
        if rng.random() < dip[i]:
            x += math.log(rng.uniform(0.4, 0.8))
        out[k] = DEFAULTS[i] * ratio[i] * math.exp(x)
    return out


def check(case: dict[str, Truth], seed: int, *, first: int, last: int, max_trials: int = 0,
          reference: dict[str, Truth] | None = None) -> Outcome:
    """One final check of the case's finalists on seeded noise, chosen as the sweep chooses (the
    eligible finalist with the largest gain estimate), against the best of `reference` (the
    finalists themselves unless given) and the defaults at each size."""
    rng = random.Random(seed)
    fs = [Finalist({"X": name}, name) for name in case]

    def measure(f: Finalist | None, _r: int) -> dict[tuple[str, int], float]:
        return _run(((1.0,) * 6, SD_DEFAULTS, NO_DIP) if f is None else case[f.label], rng)

    kw = {"max_trials": max_trials} if max_trials and "max_trials" in inspect.signature(final_check).parameters else {}
    got = final_check(fs, measure, WEIGHTS, RULE, first=first, last=last, **kw)  # type: ignore[arg-type]
    eligible = [f for f in fs if f.verdict is not None and f.verdict.eligible]
    chosen = max(eligible, key=lambda f: f.verdict.gain_pct if f.verdict else 0.0).label if eligible else None
    truth = case[chosen][0] if chosen else (1.0,) * 6
    best = [max(max(r[0][i] for r in (reference or case).values()), 1.0) for i in range(6)]
    return Outcome(chosen, BEFORE + got.trials, all(t >= 0.95 * b for t, b in zip(truth, best, strict=True)),
                   any(t < 0.98 for t in truth) if chosen else False)


def capped(max_trials: int) -> bool:
    """Whether this nccltune's final check can keep to `max_trials` (0: no bound asked)."""
    return not max_trials or "max_trials" in inspect.signature(final_check).parameters
