"""The search logic, driven by a synthetic measure function.

`Bench` returns deterministic busbw curves: a base curve per size, multiplied by a factor per
(variable, value) in the candidate's environment and by seeded multiplicative noise per size.
It tests which trials the search makes and what it concludes from known numbers; it stands in
for no real benchmark.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from nccltune.errors import CheckFailed, UsageError
from nccltune.sweep.plan import Plan
from nccltune.sweep.select import MiB, profile_weights
from nccltune.sweep.strategy import (
    TOPO_ONLY,
    Finalist,
    Search,
    SearchResult,
    Settings,
    final_check_trials,
    label_of,
    rank_screened,
    round_measure,
)

SIZES = [4096, 65536, MiB, 16 * MiB, 64 * MiB, 256 * MiB]
SMALL = [4096, 65536, MiB]
LARGE = [16 * MiB, 64 * MiB, 256 * MiB]
TOPO = "/state/runs/00001/ncclTopology.xml"
COMMON = {"NCCL_TOPO_FILE": TOPO}

Effect = float | Mapping[int, float]


def base_busbw(size: int) -> float:
    """A bandwidth curve shaped like a real all-reduce: latency-bound, then saturating."""
    return 200.0 * size / (size + 8 * MiB)


class Bench:
    def __init__(self, effects: Mapping[tuple[str, str], Effect] | None = None, *,
                 noise_pct: Effect = 0.2, seed: int = 1,
                 fail: Callable[[dict[str, str], str, str], bool] | None = None,
                 channels: int | None = 16) -> None:
        self.effects = dict(effects or {})
        self.noise_pct = noise_pct
        self.rng = random.Random(seed)
        self.fail = fail
        self.channels = channels
        self.calls: list[tuple[dict[str, str], str, str]] = []

    @staticmethod
    def _at(effect: Effect, size: int, default: float) -> float:
        return effect if isinstance(effect, float) else effect.get(size, default)

    def __call__(self, env: dict[str, str], phase: str, label: str) -> tuple[dict[int, float], dict[str, Any]] | None:
        self.calls.append((dict(env), phase, label))
        if self.fail is not None and self.fail(env, phase, label):
            return None
        out = {}
        for size in SIZES:
            bw = base_busbw(size)
            for (name, value), effect in self.effects.items():
                if env.get(name) == value:
                    bw *= self._at(effect, size, 1.0)
            noise = self._at(self.noise_pct, size, 0.2) / 100.0
            out[size] = bw * (1.0 + self.rng.uniform(-noise, noise))
        return out, {"coll_channels": self.channels}

    def phases(self) -> list[str]:
        return [phase for _env, phase, _label in self.calls]

    def envs(self, phase: str) -> list[dict[str, str]]:
        return [env for env, p, _label in self.calls if p == phase]


def make_plan(variables: Mapping[str, list[str]]) -> Plan:
    return Plan(variables={k: list(v) for k, v in variables.items()}, pruned=[], pinned={}, policy={},
                sizes=list(SIZES), backend="nccl", nranks=2)


def search(variables: Mapping[str, list[str]], bench: Bench, *, profile: str = "balanced",
           common: Mapping[str, str] = COMMON, **settings: Any) -> Search:
    plan = make_plan(variables)
    return Search(plan, Settings(**settings), bench, common=dict(common),
                  weights=profile_weights(profile, SIZES, {}))


def chosen_env(result: SearchResult) -> dict[str, str] | None:
    return None if result.chosen is None else dict(result.chosen.env)


def test_a_candidate_five_percent_faster_everywhere_is_chosen() -> None:
    bench = Bench({("NCCL_ALGO", "Tree"): 1.05})
    result = search({"NCCL_ALGO": ["Ring", "Tree"]}, bench).run()
    assert chosen_env(result) == {**COMMON, "NCCL_ALGO": "Tree"}
    assert result.chosen is not None and result.chosen.verdict is not None
    assert result.chosen.verdict.eligible
    assert result.chosen.verdict.gain_pct == pytest.approx(5.0, abs=0.6)
    assert result.chosen.label == "NCCL_ALGO=Tree"


def _large_but_small_regression() -> Bench:
    # 10% faster from 16 MiB up, 5% slower at 64 KiB, where the defaults vary by only 0.2%.
    effect = {**{s: 1.10 for s in LARGE}, 65536: 0.95}
    return Bench({("NCCL_PROTO", "Simple"): effect}, noise_pct=0.2)


def test_a_small_size_regression_is_rejected_under_balanced() -> None:
    result = search({"NCCL_PROTO": ["Simple"]}, _large_but_small_regression()).run()
    simple = next(f for f in result.finalists if f.env.get("NCCL_PROTO") == "Simple")
    # It screens well (a positive weighted gain), so it is re-measured, and then refused.
    assert simple.verdict is not None and not simple.verdict.eligible
    assert simple.verdict.gain_pct > 2
    assert [s for s, _ratio in simple.verdict.regressions] == [65536]
    assert result.chosen is not simple
    assert chosen_env(result) in (None, COMMON)


def test_the_same_candidate_is_accepted_under_large() -> None:
    result = search({"NCCL_PROTO": ["Simple"]}, _large_but_small_regression(), profile="large").run()
    assert chosen_env(result) == {**COMMON, "NCCL_PROTO": "Simple"}
    assert result.chosen is not None and result.chosen.verdict is not None
    assert result.chosen.verdict.gain_pct == pytest.approx(10.0, abs=0.6)


def test_a_gain_inside_the_noise_is_not_chosen_and_neither_is_the_topology_file_alone() -> None:
    # 1% "faster" where every run varies by +-4%; the topology file changes nothing.
    bench = Bench({("NCCL_BUFFSIZE", "8388608"): 1.01}, noise_pct=4.0, seed=3)
    result = search({"NCCL_BUFFSIZE": ["8388608"]}, bench).run()
    assert result.topo_only is not None
    # The topology file alone is published on a gain, as any candidate: "no slower" is not evidence.
    assert result.topo_only.verdict is not None and not result.topo_only.verdict.eligible
    assert result.chosen is None
    buff = [f for f in result.finalists if f.env.get("NCCL_BUFFSIZE")]
    assert all(f.verdict is None or not f.verdict.eligible for f in buff)


def test_a_topology_file_that_is_faster_beyond_noise_is_published() -> None:
    bench = Bench({("NCCL_TOPO_FILE", TOPO): 1.2})
    result = search({"NCCL_BUFFSIZE": ["8388608"]}, bench).run()
    assert result.chosen is result.topo_only and result.chosen is not None
    assert result.chosen.label == TOPO_ONLY and chosen_env(result) == COMMON
    assert result.chosen.verdict is not None and result.chosen.verdict.gain_pct > result.chosen.verdict.threshold_pct


def test_a_topology_file_that_is_slower_is_not_published() -> None:
    bench = Bench({("NCCL_TOPO_FILE", TOPO): 0.9})
    result = search({"NCCL_ALGO": ["Tree"]}, bench).run()
    assert result.topo_only is not None and result.topo_only.verdict is not None
    assert not result.topo_only.verdict.eligible
    assert result.chosen is None


def test_a_failed_trial_is_skipped() -> None:
    bench = Bench({("NCCL_ALGO", "Tree"): 1.08, ("NCCL_ALGO", "Ring"): 1.05},
                  fail=lambda env, phase, _label: phase == "screen" and env.get("NCCL_ALGO") == "Tree")
    result = search({"NCCL_ALGO": ["Tree", "Ring"]}, bench).run()
    gains = {label: gain for _env, label, gain in result.screened}
    assert gains["NCCL_ALGO=Tree"] is None
    assert gains["NCCL_ALGO=Ring"] is not None and gains["NCCL_ALGO=Ring"] > 0
    assert all(f.env.get("NCCL_ALGO") != "Tree" for f in result.finalists)
    assert chosen_env(result) == {**COMMON, "NCCL_ALGO": "Ring"}


def test_failed_finalist_and_baseline_runs_are_left_out() -> None:
    seen: dict[str, int] = {}

    def flaky(env: dict[str, str], phase: str, label: str) -> bool:
        seen[phase] = seen.get(phase, 0) + 1
        return (phase == "final" and seen[phase] == 1) or label == "defaults #2"

    bench = Bench({("NCCL_ALGO", "Tree"): 1.05}, fail=flaky)
    result = search({"NCCL_ALGO": ["Tree"]}, bench, finalist_repeats=3).run()
    assert result.chosen is not None and result.chosen.env.get("NCCL_ALGO") == "Tree"
    assert len(result.chosen.runs) + sum(len(f.runs) for f in result.finalists if f is not result.chosen) == 5
    assert len(result.baseline_runs) == 3 + 3 - 1
    # Trials keep distinct labels in the history even after a failure.
    labels = [label for _env, phase, label in bench.calls if phase == "baseline"]
    assert labels == [f"defaults #{i}" for i in range(1, 7)]


def test_a_final_rounds_defaults_join_the_baseline_runs_and_a_failed_one_does_not() -> None:
    calls: list[tuple[dict[str, str], str, str]] = []
    earlier = [{("all_reduce", 4096): 1.0}]

    def trial(env: dict[str, str], phase: str, label: str) -> dict[tuple[str, int], float] | None:
        calls.append((env, phase, label))
        return None if label == "base 2" else {("all_reduce", 4096): float(len(calls))}

    measure = round_measure(trial, earlier, lambda r: f"base {r + 1}")
    tree = Finalist({"NCCL_ALGO": "Tree"}, "NCCL_ALGO=Tree")
    assert measure(tree, 0) == {("all_reduce", 4096): 1.0}
    assert measure(None, 0) == {("all_reduce", 4096): 2.0}
    assert measure(None, 1) is None
    assert calls == [({"NCCL_ALGO": "Tree"}, "final", "NCCL_ALGO=Tree #1"), ({}, "baseline", "base 1"),
                     ({}, "baseline", "base 2")]
    # The finalist's run is its own; the defaults' that worked follow the runs measured before.
    assert earlier == [{("all_reduce", 4096): 1.0}, {("all_reduce", 4096): 2.0}]


def test_channel_values_are_pruned_after_the_first_baseline_that_worked() -> None:
    # The first run of the defaults fails: the channel count comes from the second.
    bench = Bench(fail=lambda _env, _phase, label: label == "defaults #1", channels=16)
    s = search({"NCCL_MIN_NCHANNELS": ["8", "16", "32"], "NCCL_MAX_NCHANNELS": ["8", "32"]}, bench)
    s.run()
    assert s.plan.variables == {"NCCL_MIN_NCHANNELS": ["32"], "NCCL_MAX_NCHANNELS": ["8"]}
    screened = [env for env in bench.envs("screen") if env != COMMON]
    assert {e.get("NCCL_MIN_NCHANNELS") or e.get("NCCL_MAX_NCHANNELS") for e in screened} <= {"32", "8"}
    assert {(p.name, p.value) for p in s.plan.pruned} == {
        ("NCCL_MIN_NCHANNELS", "8"), ("NCCL_MIN_NCHANNELS", "16"), ("NCCL_MAX_NCHANNELS", "32")}


def test_every_baseline_failing_is_a_check_failure() -> None:
    bench = Bench(fail=lambda _env, phase, _label: phase == "baseline")
    with pytest.raises(CheckFailed, match="every run of NCCL's defaults failed"):
        search({"NCCL_ALGO": ["Tree"]}, bench).run()
    assert bench.phases() == ["baseline"] * 3


def test_combine_tries_the_best_values_of_two_helpful_variables_together() -> None:
    bench = Bench({
        ("NCCL_ALGO", "Tree"): 1.04, ("NCCL_ALGO", "Ring"): 1.01,
        ("NCCL_BUFFSIZE", "8388608"): 1.03, ("NCCL_BUFFSIZE", "2097152"): 0.97,
        ("NCCL_NTHREADS", "256"): 0.95,
    })
    result = search({"NCCL_ALGO": ["Ring", "Tree"], "NCCL_BUFFSIZE": ["2097152", "8388608"],
                     "NCCL_NTHREADS": ["256"]}, bench).run()
    combined = {**COMMON, "NCCL_ALGO": "Tree", "NCCL_BUFFSIZE": "8388608"}
    screens = bench.envs("screen")
    # The best value of each helpful variable, together; the harmful variable stays out.
    assert [e for e in screens if len(e) > 2] == [combined]
    assert chosen_env(result) == combined
    assert result.chosen is not None and result.chosen.verdict is not None
    assert result.chosen.verdict.gain_pct == pytest.approx(100 * (1.04 * 1.03 - 1), abs=0.7)
    assert result.chosen.label == "NCCL_ALGO=Tree NCCL_BUFFSIZE=8388608"


def test_combine_keeps_an_addition_only_when_it_helps() -> None:
    # Each helps alone; together the second one undoes the first (an interaction).
    bench = Bench({("NCCL_ALGO", "Tree"): 1.06, ("NCCL_PROTO", "LL"): 1.03})
    original = bench.__call__

    def measure(env: dict[str, str], phase: str, label: str) -> tuple[dict[int, float], dict[str, Any]] | None:
        got = original(env, phase, label)
        if got and env.get("NCCL_ALGO") == "Tree" and env.get("NCCL_PROTO") == "LL":
            return {s: v / 1.06 / 1.03 * 0.98 for s, v in got[0].items()}, got[1]
        return got

    s = Search(make_plan({"NCCL_ALGO": ["Tree"], "NCCL_PROTO": ["LL"]}), Settings(), measure,
               common=dict(COMMON), weights=profile_weights("balanced", SIZES, {}))
    result = s.run()
    assert chosen_env(result) == {**COMMON, "NCCL_ALGO": "Tree"}


def test_finalists_are_reinterleaved_with_baselines() -> None:
    bench = Bench({("NCCL_ALGO", "Tree"): 1.05, ("NCCL_ALGO", "Ring"): 1.03})
    result = search({"NCCL_ALGO": ["Ring", "Tree"]}, bench, baseline_repeats=2, finalist_repeats=2,
                    max_finalists=2).run()
    tail = bench.phases()[-(2 * (len(result.finalists) + 1)):]
    # Per round: every finalist (two candidates and the topology file alone), then the defaults.
    assert tail == ["final", "final", "final", "baseline"] * 2
    assert len(result.baseline_runs) == 2 + 2
    assert result.baseline[4096].n == 4
    assert [f.label for f in result.finalists] == ["NCCL_ALGO=Tree", "NCCL_ALGO=Ring", TOPO_ONLY]


def test_staged_estimate_is_exact_when_every_candidate_helps() -> None:
    bench = Bench({("NCCL_ALGO", "Ring"): 1.03, ("NCCL_ALGO", "Tree"): 1.05,
                   ("NCCL_BUFFSIZE", "2097152"): 1.02, ("NCCL_BUFFSIZE", "8388608"): 1.04,
                   ("NCCL_NTHREADS", "256"): 1.03})
    s = search({"NCCL_ALGO": ["Ring", "Tree"], "NCCL_BUFFSIZE": ["2097152", "8388608"],
                "NCCL_NTHREADS": ["256"]}, bench)
    estimate = s.estimate_trials()
    s.run()
    # 3 baselines + 5 singles + the topology file + 2 combinations + (3 finalists + topology file
    # + defaults) x 3 rounds.
    assert estimate == 3 + 5 + 1 + 2 + (3 + 1 + 1) * 3
    assert len(bench.calls) == estimate


@pytest.mark.parametrize("helpful", [0, 1, 2])
def test_staged_estimate_is_an_upper_bound_within_the_combine_bound(helpful: int) -> None:
    names = ["NCCL_ALGO", "NCCL_BUFFSIZE", "NCCL_NTHREADS"]
    values = {"NCCL_ALGO": "Tree", "NCCL_BUFFSIZE": "8388608", "NCCL_NTHREADS": "256"}
    effects = {(n, values[n]): (1.05 if i < helpful else 0.9) for i, n in enumerate(names)}
    bench = Bench(effects)
    s = search({n: [values[n]] for n in names}, bench)
    estimate = s.estimate_trials()
    result = s.run()
    combine_bound = min(Settings().max_combine, len(names) - 1)
    combined = sum(1 for e in bench.envs("screen") if len(e) > 2)
    assert combined == max(0, helpful - 1) <= combine_bound
    assert len(bench.calls) <= estimate
    # What the estimate over-counts is only combinations not tried and finalists not found.
    missing_finalists = Settings().max_finalists - (len(result.finalists) - 1)
    assert estimate - len(bench.calls) == (combine_bound - combined) + missing_finalists * Settings().finalist_repeats


def test_exhaustive_grid_over_two_variables_with_two_values_each() -> None:
    effects: dict[tuple[str, str], Effect] = {
        ("NCCL_ALGO", "Ring"): 1.02, ("NCCL_ALGO", "Tree"): 1.04,
        ("NCCL_PROTO", "LL"): 1.01, ("NCCL_PROTO", "Simple"): 1.03,
    }
    bench = Bench(effects)
    variables = {"NCCL_ALGO": ["Ring", "Tree"], "NCCL_PROTO": ["LL", "Simple"]}
    s = search(variables, bench, exhaustive=True)
    estimate = s.estimate_trials()
    result = s.run()
    grid = bench.envs("exhaustive")
    # (unset, Ring, Tree) x (unset, LL, Simple) = 9 points; the all-unset point is the topology
    # file alone, measured once, so 8 combinations plus that one.
    assert s.grid_points() == 9
    combos = [e for e in grid if e != COMMON]
    assert len(combos) == 8 and grid.count(COMMON) == 1
    expected = []
    for algo, proto in itertools.product([None, "Ring", "Tree"], [None, "LL", "Simple"]):
        env = dict(COMMON)
        if algo:
            env["NCCL_ALGO"] = algo
        if proto:
            env["NCCL_PROTO"] = proto
        if env != COMMON:
            expected.append(env)
    assert sorted(map(sorted, map(dict.items, combos))) == sorted(map(sorted, map(dict.items, expected)))
    assert bench.envs("screen") == []
    # Exact: 3 baselines + 9 grid trials + (3 finalists + topology file + defaults) x 3 rounds.
    assert estimate == 3 + 9 + (3 + 1 + 1) * 3 == len(bench.calls)
    assert chosen_env(result) == {**COMMON, "NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}


def test_exhaustive_estimate_without_a_topology_file() -> None:
    bench = Bench({("NCCL_ALGO", "Tree"): 1.05, ("NCCL_ALGO", "Ring"): 1.02})
    s = search({"NCCL_ALGO": ["Ring", "Tree"]}, bench, common={}, exhaustive=True, max_finalists=3)
    estimate = s.estimate_trials()
    result = s.run()
    # 3 baselines + 2 grid points + (2 finalists + defaults) x 3.
    assert estimate == 3 + 2 + (2 + 1) * 3 == len(bench.calls)
    assert result.topo_only is None
    assert chosen_env(result) == {"NCCL_ALGO": "Tree"}


def test_an_oversized_grid_is_refused_before_anything_runs() -> None:
    bench = Bench()
    s = search({"NCCL_ALGO": ["Ring", "Tree"], "NCCL_PROTO": ["LL", "Simple"]}, bench, exhaustive=True,
               max_grid=8)
    with pytest.raises(UsageError, match="9 points"):
        s.run()
    assert bench.calls == []


def test_labels() -> None:
    assert label_of({}) == "defaults"
    assert label_of(COMMON) == TOPO_ONLY
    assert label_of({**COMMON, "NCCL_PROTO": "LL", "NCCL_ALGO": "Tree"}) == "NCCL_ALGO=Tree NCCL_PROTO=LL"
    assert label_of({"NCCL_ALGO": "Tree"}, {"NCCL_ALGO": "Tree"}) == "defaults"


def test_one_finalist_run_publishes_no_gain_however_large_and_says_why() -> None:
    # The smallest repeats the config allows: even a candidate 50% faster everywhere is not
    # published from one run, and the notes say why.
    bench = Bench({("NCCL_ALGO", "Tree"): 1.5})
    result = search({"NCCL_ALGO": ["Tree"]}, bench, baseline_repeats=2, finalist_repeats=1, max_finalists=1).run()
    tree = next(f for f in result.finalists if f.env.get("NCCL_ALGO") == "Tree")
    assert tree.verdict is not None and not tree.verdict.eligible and tree.verdict.too_few_runs
    assert tree.verdict.gain_pct > 40
    assert chosen_env(result) in (None, COMMON)
    assert any("1 finalist sample cannot show a gain beyond noise" in n for n in result.notes)


def test_two_finalist_runs_can_publish_a_consistent_gain() -> None:
    bench = Bench({("NCCL_ALGO", "Tree"): 1.05})
    result = search({"NCCL_ALGO": ["Tree"]}, bench, baseline_repeats=2, finalist_repeats=2, max_finalists=1).run()
    assert chosen_env(result) == {**COMMON, "NCCL_ALGO": "Tree"}
    assert result.chosen is not None and result.chosen.verdict is not None
    assert result.chosen.verdict.pairs == 2
    assert result.notes == []


def test_a_finalist_left_with_one_run_by_failures_is_noted() -> None:
    bench = Bench({("NCCL_ALGO", "Tree"): 1.05},
                  fail=lambda env, phase, label: phase == "final" and label == "NCCL_ALGO=Tree #1")
    result = search({"NCCL_ALGO": ["Tree"]}, bench, finalist_repeats=2).run()
    assert chosen_env(result) in (None, COMMON)
    assert len(result.notes) == 1
    assert result.notes[0].startswith("NCCL_ALGO=Tree: 1 finalist sample paired with the defaults: cannot show a "
                                      "gain beyond noise")


class SocketBench(Bench):
    """NCCL's socket transport as net_socket.cc has it: helper threads x sockets per thread, and
    no helper thread unless NCCL_SOCKET_NTHREADS is set, so sockets per thread alone is the
    defaults. Helper threads double the large sizes; one socket per thread loses 20% at the
    smallest sizes, two sockets per thread win 40% there."""

    def __call__(self, env: dict[str, str], phase: str, label: str) -> tuple[dict[int, float], dict[str, Any]] | None:
        self.calls.append((dict(env), phase, label))
        threads = int(env.get("NCCL_SOCKET_NTHREADS", "0"))
        socks = int(env.get("NCCL_NSOCKS_PERTHREAD", "1")) if threads else 0
        out = {}
        for size in SIZES:
            factor = 1.0
            if threads:
                factor = 2.0 if size >= 16 * MiB else (1.4 if socks >= 2 else 0.8)
            out[size] = base_busbw(size) * factor * (1.0 + self.rng.uniform(-0.002, 0.002))
        return out, {"coll_channels": self.channels}


SOCKETS = {"NCCL_SOCKET_NTHREADS": ["1", "2"], "NCCL_NSOCKS_PERTHREAD": ["1", "2"]}


def test_sockets_per_thread_are_screened_with_the_best_number_of_threads() -> None:
    bench = SocketBench()
    search({"NCCL_NSOCKS_PERTHREAD": ["1", "2"], "NCCL_SOCKET_NTHREADS": ["1", "2"]}, bench,
           max_finalists=1).run()
    screens = [label for _env, phase, label in bench.calls if phase == "screen"]
    # Threads first, whatever the plan's order; then each sockets value on top of the best
    # threads value (both threads values screen alike here: the first measured is kept).
    assert screens[:3] == [TOPO_ONLY, "NCCL_SOCKET_NTHREADS=1", "NCCL_SOCKET_NTHREADS=2"]
    assert all("NCCL_SOCKET_NTHREADS=" in label for label in screens[3:5])
    assert {label.split()[0] for label in screens[3:5]} == {"NCCL_NSOCKS_PERTHREAD=1", "NCCL_NSOCKS_PERTHREAD=2"}
    # Nothing measured twice: combining arrives at settings already screened.
    envs = [tuple(sorted(env.items())) for env, phase, _label in bench.calls if phase == "screen"]
    assert len(envs) == len(set(envs))


class SlowThreadsBench(SocketBench):
    """Helper threads slower than the defaults at every size: no number of threads helps."""

    def __call__(self, env: dict[str, str], phase: str, label: str) -> tuple[dict[int, float], dict[str, Any]] | None:
        self.calls.append((dict(env), phase, label))
        factor = 0.7 if "NCCL_SOCKET_NTHREADS" in env else 1.0
        return ({size: base_busbw(size) * factor * (1.0 + self.rng.uniform(-0.002, 0.002)) for size in SIZES},
                {"coll_channels": self.channels})


def _screened(plan_auto: bool | None) -> tuple[list[str], Search]:
    bench = SlowThreadsBench()
    s = search(SOCKETS, bench, max_finalists=1)
    # What build_plan derives from the NICs (tests/test_sweep_plan_network.py): the defaults alone
    # only where NCCL is known to start no helper thread of its own choice.
    if plan_auto is False:
        s.plan.inert_alone["NCCL_NSOCKS_PERTHREAD"] = "alone it is NCCL's defaults on this node's NICs"
    s.run()
    return [label for _env, phase, label in bench.calls if phase == "screen"], s


def test_sockets_per_thread_alone_are_not_screened_where_nccl_starts_no_helper_thread() -> None:
    # No threads value helped, and on these NICs NCCL's own choice is no helper thread: sockets
    # per thread alone would measure the defaults again.
    screens, s = _screened(False)
    assert not any(label.startswith("NCCL_NSOCKS_PERTHREAD=") for label in screens)
    assert any(n.startswith("NCCL_NSOCKS_PERTHREAD=1,2 not screened: no value of NCCL_SOCKET_NTHREADS helped")
               for n in s.notes)


@pytest.mark.parametrize("auto", [True, None])
def test_sockets_per_thread_alone_are_screened_where_nccl_may_start_helper_threads(auto: bool | None) -> None:
    # AWS and GCP NICs (NCCL's auto has helper threads there), or NICs not read: screened alone.
    screens, s = _screened(auto)
    assert {label for label in screens if label.startswith("NCCL_NSOCKS_PERTHREAD=")} == {
        "NCCL_NSOCKS_PERTHREAD=1", "NCCL_NSOCKS_PERTHREAD=2"}
    assert not any("not screened" in n for n in s.notes)


def test_the_one_finalist_is_the_setting_no_slower_anywhere() -> None:
    # Threads alone double the large sizes (the larger weighted gain in screening at sizes where
    # the defaults are quiet) but lose 20% at the small ones: the final check would refuse it.
    # The finalist is threads with two sockets per thread, faster at every size, and it is chosen.
    result = search(SOCKETS, SocketBench(), max_finalists=1).run()
    assert result.finalists[0].label.startswith("NCCL_NSOCKS_PERTHREAD=2 NCCL_SOCKET_NTHREADS=")
    assert result.chosen is not None and result.chosen.env["NCCL_NSOCKS_PERTHREAD"] == "2"
    assert result.chosen.verdict is not None and result.chosen.verdict.eligible
    assert result.screen_worst_pct["NCCL_SOCKET_NTHREADS=1"] < -15
    assert result.screen_worst_pct[result.chosen.label] == 0.0


def test_threads_alone_lose_at_small_sizes_and_the_defaults_are_kept() -> None:
    # Without sockets per thread there is nothing faster at every size: no finalist can win.
    result = search({"NCCL_SOCKET_NTHREADS": ["1", "2"]}, SocketBench(), max_finalists=1).run()
    assert chosen_env(result) in (None, COMMON)


def test_a_finalist_slot_goes_to_a_setting_that_can_pass_before_a_larger_gain_that_regresses() -> None:
    # Simple: +30% at large sizes but 10% slower at 64 KiB, where the defaults are quiet; Tree: +5%
    # everywhere. One finalist slot: Tree takes it (Simple's screening run already shows the size
    # the final check refuses), and Tree is published.
    bench = Bench({("NCCL_PROTO", "Simple"): {**{s: 1.30 for s in LARGE}, 65536: 0.90},
                   ("NCCL_ALGO", "Tree"): 1.05}, noise_pct=0.2)
    result = search({"NCCL_PROTO": ["Simple"], "NCCL_ALGO": ["Tree"]}, bench, max_finalists=1,
                    max_combine=0).run()
    assert [f.label for f in result.finalists] == ["NCCL_ALGO=Tree", TOPO_ONLY]
    assert chosen_env(result) == {**COMMON, "NCCL_ALGO": "Tree"}


def test_rank_screened_orders_by_gain_within_the_settings_that_did_not_regress() -> None:
    a, b, c, d = ({"X": "1"}, "a", 9.0), ({"X": "2"}, "b", 5.0), ({"X": "3"}, "c", 3.0), ({"X": "4"}, "d", -1.0)
    topo = (COMMON, TOPO_ONLY, 20.0)
    worst = {"a": -2.5, "b": 0.0, "c": -1.9, "d": 0.0}
    ranked = rank_screened([a, b, c, d, topo, ({"X": "5"}, "e", None)], worst, 2.0, leave_out=COMMON)
    assert [label for _env, label, _gain in ranked] == ["b", "c", "a"]
    assert [label for _env, label, _gain in rank_screened([a, b], worst, 3.0)] == ["a", "b"]


def test_the_final_check_keeps_to_sweep_max_final_trials() -> None:
    # Gains within the noise: the finalists stay open, and the check would go on to 8 rounds.
    bench = Bench({("NCCL_ALGO", "Tree"): 1.02, ("NCCL_ALGO", "Ring"): 1.015}, noise_pct=3.0)
    result = search({"NCCL_ALGO": ["Ring", "Tree"]}, bench, baseline_repeats=2, finalist_repeats=2,
                    max_finalist_repeats=8, max_finalists=2, max_final_trials=12).run()
    # 2 rounds of 3 finalists and the defaults (8 trials), then the looks the 4 left let the leader
    # alone reach: 2 more rounds.
    assert result.final.looks == [2, 4]
    assert result.final.trials <= 12
    first = bench.phases().index("final")
    assert len(bench.phases()[first:]) == result.final.trials


@pytest.mark.parametrize("max_final_trials", [0, 12, 40])
def test_the_most_trials_bound_holds_when_the_final_check_adds_every_round(max_final_trials: int) -> None:
    # Gains within the noise: every finalist stays open to the last look, so the check makes the
    # most trials it can; the first-look estimate counts fewer.
    bench = Bench({("NCCL_ALGO", "Tree"): 1.02, ("NCCL_ALGO", "Ring"): 1.015}, noise_pct=3.0)
    s = search({"NCCL_ALGO": ["Ring", "Tree"]}, bench, baseline_repeats=2, finalist_repeats=2,
               max_finalist_repeats=8, max_finalists=2, max_final_trials=max_final_trials)
    about, most = s.trial_bounds()
    result = s.run()
    assert about == s.estimate_trials() == 2 + 2 + 1 + (3 + 1) * 2
    assert len(bench.calls) <= most and most > about
    if max_final_trials:
        assert result.final.trials <= max_final_trials
        assert most - about <= max_final_trials - (3 + 1) * 2


def test_final_check_trials_counts_the_first_look_and_every_planned_look() -> None:
    # 3 finalists and the defaults: 2 rounds at the first look, 8 at the last.
    assert final_check_trials(3, first=2, last=8) == (8, 32)
    # The bound: the first look always; later looks only within it.
    assert final_check_trials(3, first=2, last=8, max_trials=12) == (8, 12)
    assert final_check_trials(3, first=2, last=8, max_trials=5) == (8, 8)
    # One round asked for adds none; no rounds, no check.
    assert final_check_trials(3, first=1, last=8) == (4, 4)
    assert final_check_trials(3, first=0, last=8) == (0, 0)
