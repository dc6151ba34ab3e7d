"""The sequential final check's looks (sweep/decision.py, sweep/strategy.final_check): a part of a
verdict shown at one look stays shown, a finalist clearly behind another is measured no more, a
finalist stopped without winning keeps its place in Holm's family, the trials stay within
sweep.max_final_trials; and the check on numbers like the MPS socket rig's (bench/rigsim.py) with
fixed seeds: the rig's case published within 25 trials, A/A never."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from nccltune.sweep import decision
from nccltune.sweep.decision import LOSE, OPEN, WIN, Evidence, Rule, Shown
from nccltune.sweep.strategy import Finalist, final_check

MiB = 1 << 20
SIZES = [65536, MiB, 64 * MiB]
W = {s: 1.0 for s in SIZES}
RULE = Rule(min_gain_pct=1.0, max_regression_pct=2.0)


def _rigsim() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "bench" / "rigsim.py"
    spec = importlib.util.spec_from_file_location("rigsim", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rigsim"] = mod
    spec.loader.exec_module(mod)
    return mod


RIG = _rigsim()


def _pairs(ratio: dict[int, float], n: int, sd: dict[int, float], seed: int = 1) -> Evidence[int]:
    rng = random.Random(seed)
    return Evidence((tuple({s: math.log(ratio[s]) + rng.gauss(0.0, sd[s]) for s in SIZES} for _ in range(n)),))


def test_a_size_shown_within_the_margin_at_an_earlier_look_stays_shown() -> None:
    # +10% at 1 and 64 MiB; at 64 KiB as fast as the defaults, where 4 pairs in 5% noise cannot show
    # "within 2%".
    quiet = math.log(1.10)
    ev = Evidence((tuple({65536: loud, MiB: quiet + d, 64 * MiB: quiet - d}
                         for loud, d in ((0.06, 0.001), (-0.04, -0.001), (0.05, 0.002), (-0.05, -0.002))),))
    alone = decision.judge(ev, W, RULE)
    assert alone.status == OPEN and [k for k, _r in alone.regressions] == [65536]
    assert alone.shown.gain and alone.shown.keys == frozenset({MiB, 64 * MiB})
    # The same pairs after a look that showed 64 KiB within the margin: nothing is left to show.
    later = decision.judge(ev, W, RULE, shown=Shown(False, frozenset({65536})))
    assert later.status == WIN and later.eligible and "shown at an earlier look" in later.reason
    # A gain shown at an earlier look is not asked for again (here the pairs alone cannot show it).
    weak = _pairs({s: 1.02 for s in SIZES}, 3, {s: 0.02 for s in SIZES}, seed=2)
    assert decision.judge(weak, W, RULE).status == OPEN
    assert decision.judge(weak, W, RULE, shown=Shown(True, frozenset(SIZES))).status == WIN


def test_a_size_slower_for_sure_still_loses_whatever_was_shown_before() -> None:
    ev = _pairs({65536: 0.90, MiB: 1.10, 64 * MiB: 1.10}, 6, {s: 0.005 for s in SIZES})
    assert decision.judge(ev, W, RULE, shown=Shown(True, frozenset({MiB}))).status == LOSE


def test_holm_keeps_the_place_of_a_finalist_stopped_without_winning() -> None:
    ev = {"a": _pairs({s: 1.05 for s in SIZES}, 4, {s: 0.005 for s in SIZES})}
    assert decision.holm(ev, W, RULE)["a"].alpha == pytest.approx(0.05)
    assert decision.holm(ev, W, RULE, family=3)["a"].alpha == pytest.approx(0.05 / 3)


def test_holm_passes_a_gain_shown_at_an_earlier_look() -> None:
    # Its pairs now fall short of the gain at alpha / 2, but the gain was shown before: it leads the
    # step-down, and the other is tested at alpha, the family's last place.
    weak = _pairs({s: 1.02 for s in SIZES}, 3, {s: 0.02 for s in SIZES}, seed=2)
    strong = _pairs({s: 1.05 for s in SIZES}, 4, {s: 0.005 for s in SIZES})
    got = decision.holm({"w": weak, "s": strong}, W, RULE, shown={"w": Shown(True, frozenset(SIZES))})
    assert got["w"].status == WIN and got["w"].alpha == pytest.approx(0.025)
    assert got["s"].status == WIN and got["s"].alpha == pytest.approx(0.05)


def _rounds(ratio: float, n: int, seed: int, sd: float = 0.01) -> dict[int, dict[int, float]]:
    rng = random.Random(seed)
    return {r: {s: 100.0 * ratio * math.exp(rng.gauss(0.0, sd)) for s in SIZES} for r in range(n)}


def test_behind_needs_the_rounds_both_measured_to_show_it() -> None:
    lead = _rounds(1.10, 3, seed=1)
    assert decision.behind(lead, _rounds(1.00, 3, seed=2), W)
    assert not decision.behind(lead, _rounds(1.10, 3, seed=3), W)
    # One round in common: nothing bounds the difference.
    assert not decision.behind(lead, {0: _rounds(1.00, 1, seed=2)[0]}, W)


def _check(effects: tuple[float, ...], seed: int, *, first: int = 3, last: int = 8,
           max_trials: int = 0) -> tuple[list[Finalist], int, list[int]]:
    rng = random.Random(seed)
    fs = [Finalist({"X": str(i)}, f"c{i}") for i in range(len(effects))]

    def measure(f: Finalist | None, _r: int) -> dict[tuple[str, int], float]:
        e = 1.0 if f is None else effects[int(f.env["X"])]
        # Loud at 64 KiB: a finalist open on "within the margin" there after the first look.
        return {("all_reduce", s): 100.0 * e * math.exp(rng.gauss(0.0, 0.08 if s == 65536 else 0.01))
                for s in SIZES}

    weights = {("all_reduce", s): 1.0 for s in SIZES}
    check = final_check(fs, measure, weights, RULE, first=first, last=last, max_trials=max_trials)
    return fs, check.trials, check.looks


def test_a_finalist_clearly_behind_the_leader_is_measured_no_more() -> None:
    fs, _trials, _looks = _check((1.30, 1.10), seed=1)
    leader, trailing = fs
    assert len(leader.runs) > 3 and len(trailing.runs) == 3
    assert trailing.verdict is not None and trailing.verdict.status == LOSE and not trailing.verdict.eligible
    assert "behind c0" in trailing.verdict.reason
    assert leader.verdict is not None and leader.verdict.eligible


def test_the_trials_stay_within_the_bound_and_the_looks_are_planned_for_it() -> None:
    # 3 finalists: the first look is 2 rounds of 4 trials; 7 trials left take the leader alone to 5
    # rounds, so the looks are 2, 4 and 5, whatever the ceiling.
    for seed in range(5):
        _fs, trials, looks = _check((1.30, 1.25, 1.0), seed, first=2, last=8, max_trials=15)
        assert looks == [2, 4, 5] and trials <= 15
    # Without a bound the ceiling plans the looks.
    _fs, _trials, looks = _check((1.30, 1.25, 1.0), 0, first=2, last=8)
    assert looks == decision.looks(2, 8)


def test_the_rigs_case_is_published_within_25_trials_and_equals_never() -> None:
    rig = {name: case for name, (case, _reference) in RIG.cases(dips=False).items()}
    # The rig's configuration (bench/gpu_mps_socket_rig.sh): first look at 2 rounds, 15 trials for
    # the final check after the 10 before it.
    got = [RIG.check(rig["rig"], seed, first=2, last=8, max_trials=15) for seed in range(12)]
    assert all(o.trials <= 25 for o in got)
    assert sum(o.within_5pct for o in got) >= 10
    assert not any(o.below_defaults for o in got)
    assert not any(RIG.check(rig["A/A"], seed, first=2, last=8, max_trials=15).chosen for seed in range(10))
    # A finalist 5% slower than the defaults at 1 MiB is never the one published.
    assert not any(RIG.check(rig["A slower at 1 MiB"], seed, first=2, last=8, max_trials=15).below_defaults
                   for seed in range(10))
