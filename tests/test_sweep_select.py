"""Selection arithmetic: per-size statistics, profile weights, gains and the screening verdict."""

from __future__ import annotations

import math

import pytest

from nccltune.sweep.select import (
    MiB,
    SizeStats,
    d2,
    profile_weights,
    screen,
    screening_gain_pct,
    size_stats,
    t_quantile,
    weighted_gain_pct,
    weighted_noise_pct,
)

LADDER = [4096, 65536, MiB, 16 * MiB, 64 * MiB, 256 * MiB]


def _const(value_by_size: dict[int, float], noise_pct: float = 0.0, n: int = 3) -> dict[int, SizeStats]:
    """Stats with the given medians and a half-spread of noise_pct."""
    return {s: SizeStats(s, m, m * (1 - noise_pct / 100), m * (1 + noise_pct / 100), n)
            for s, m in value_by_size.items()}


def test_size_stats_median_spread_and_noise() -> None:
    stats = size_stats([{4096: 10.0, MiB: 100.0}, {4096: 12.0, MiB: 101.0}, {4096: 8.0}])
    s = stats[4096]
    assert (s.median, s.low, s.high, s.n) == (10.0, 8.0, 12.0, 3)
    # Half the relative spread: (12 - 8) / 2 / 10.
    assert s.noise_pct == pytest.approx(20.0)
    assert stats[MiB].n == 2 and stats[MiB].median == pytest.approx(100.5)
    assert size_stats([{4096: 5.0}])[4096].noise_pct == 0.0
    assert SizeStats(1, 0.0, 0.0, 1.0, 3).noise_pct == 0.0


def test_profile_weights_builtin_profiles() -> None:
    assert profile_weights("balanced", LADDER, {}) == {s: 1.0 for s in LADDER}
    large = profile_weights("large", LADDER, {})
    assert [s for s, w in large.items() if w] == [16 * MiB, 64 * MiB, 256 * MiB]
    small = profile_weights("small", LADDER, {})
    assert [s for s, w in small.items() if w] == [4096, 65536, MiB]


def test_profile_weights_fall_back_to_the_end_of_a_short_ladder() -> None:
    demo = [4096, 65536, 4 * MiB]
    assert profile_weights("large", demo, {}) == {4 * MiB: 1.0}
    assert profile_weights("small", [32 * MiB, 64 * MiB], {}) == {32 * MiB: 1.0}


def test_custom_profile_maps_to_the_nearest_size_on_a_log_scale() -> None:
    w = profile_weights("mine", LADDER, {"mine": {5000: 1.0, 200 * MiB: 2.0, 300 * MiB: 0.5}})
    assert w[4096] == 1.0
    assert w[256 * MiB] == 2.5
    assert sum(w.values()) == 3.5


def test_unknown_profile_raises_key_error() -> None:
    with pytest.raises(KeyError):
        profile_weights("fastest", LADDER, {})


def test_weighted_gain_is_a_weighted_geometric_mean() -> None:
    base = {4096: 10.0, MiB: 100.0}
    # 1.21x at one size and 1x at the other: sqrt(1.21) = 1.1.
    assert weighted_gain_pct({4096: 12.1, MiB: 100.0}, base, {4096: 1.0, MiB: 1.0}) == pytest.approx(10.0)
    # Raw GB/s do not matter, ratios do: a 1% gain at 4 KiB counts as much as 1% at 1 MiB.
    assert weighted_gain_pct({4096: 10.1, MiB: 100.0}, base, {4096: 1.0, MiB: 1.0}) == pytest.approx(
        weighted_gain_pct({4096: 10.0, MiB: 101.0}, base, {4096: 1.0, MiB: 1.0}))
    # Zero weights, missing sizes and non-positive numbers are left out.
    assert weighted_gain_pct({4096: 20.0, MiB: 110.0}, base, {4096: 0.0, MiB: 1.0}) == pytest.approx(10.0)
    assert weighted_gain_pct({MiB: 110.0}, base, {4096: 1.0, MiB: 1.0}) == pytest.approx(10.0)
    assert weighted_gain_pct({4096: 0.0, MiB: 110.0}, base, {4096: 1.0, MiB: 1.0}) == pytest.approx(10.0)
    assert weighted_gain_pct({}, base, {4096: 1.0}) == 0.0


def test_noisy_small_sizes_cannot_rank_candidates() -> None:
    base = _const({4096: 10.0, 256 * MiB: 100.0}, noise_pct=0.0)
    base[4096] = SizeStats(4096, 10.0, 8.5, 11.5, 3)  # +-15% at 4 KiB
    base[256 * MiB] = SizeStats(256 * MiB, 100.0, 99.5, 100.5, 3)  # +-0.5% at 256 MiB
    weights = {4096: 1.0, 256 * MiB: 1.0}
    lucky_small = {4096: 11.5, 256 * MiB: 100.0}  # +15% where the defaults vary by 15%
    real_large = {4096: 10.0, 256 * MiB: 103.0}  # +3% where they vary by 0.5%
    medians = {s: st.median for s, st in base.items()}
    # The plain ratio would rank the lucky one first...
    assert weighted_gain_pct(lucky_small, medians, weights) > weighted_gain_pct(real_large, medians, weights)
    # ...screening shrinks each size's change by twice its noise first.
    assert screening_gain_pct(lucky_small, base, weights) == pytest.approx(0.0)
    assert screening_gain_pct(real_large, base, weights) == pytest.approx(100 * (math.exp(
        (math.log(1.03) - 0.01) / 2) - 1))
    assert screening_gain_pct({4096: 8.5, 256 * MiB: 100.0}, base, weights) == pytest.approx(0.0)
    # Losses are shrunk the same way, and keep their sign.
    assert screening_gain_pct({4096: 10.0, 256 * MiB: 95.0}, base, weights) < 0
    assert screening_gain_pct({}, base, weights) == 0.0


def test_weighted_noise_follows_the_profile() -> None:
    base = {4096: SizeStats(4096, 10.0, 8.0, 12.0, 3), MiB: SizeStats(MiB, 100.0, 99.0, 101.0, 3)}
    assert weighted_noise_pct(base, {4096: 1.0, MiB: 1.0}) == pytest.approx(10.5)
    assert weighted_noise_pct(base, {4096: 0.0, MiB: 1.0}) == pytest.approx(1.0)
    assert weighted_noise_pct(base, {}) == 0.0


BASE = {4096: 10.0, 65536: 40.0, MiB: 90.0, 64 * MiB: 150.0}


def _scaled(factor: dict[int, float] | float) -> dict[int, float]:
    return {s: v * (factor if isinstance(factor, float) else factor.get(s, 1.0)) for s, v in BASE.items()}


def test_screen_accepts_five_percent_everywhere() -> None:
    v = screen(_const(_scaled(1.05), 0.5), _const(BASE, 0.5), {s: 1.0 for s in BASE},
              min_gain_pct=1.0, max_regression_pct=2.0)
    assert v.eligible and v.gain_pct == pytest.approx(5.0)
    assert v.threshold_pct == pytest.approx(1.0)
    assert not v.regressions
    assert v.robust_gain_pct == pytest.approx(4.0, abs=0.1)  # 5% less the 0.5% + 0.5% spreads
    assert "beyond the noise" in v.reason


def test_screen_counts_a_gain_only_beyond_each_sizes_noise() -> None:
    # A 3% gain over defaults that vary by 4%: nothing of it is beyond the noise, not publishable.
    v = screen(_const(_scaled(1.03), 1.0), _const(BASE, 4.0), {s: 1.0 for s in BASE},
              min_gain_pct=1.0, max_regression_pct=2.0)
    assert not v.eligible
    assert v.robust_gain_pct == pytest.approx(0.0)
    assert v.threshold_pct == pytest.approx(1.0)
    assert "not above the minimum" in v.reason
    # Same numbers with quiet defaults: publishable.
    assert screen(_const(_scaled(1.03), 1.0), _const(BASE, 0.5), {s: 1.0 for s in BASE},
                 min_gain_pct=1.0, max_regression_pct=2.0).eligible


def test_one_noisy_size_neither_vetoes_nor_carries_a_gain() -> None:
    # 4% better at the three quiet sizes; the smallest size varies by 20% between runs.
    noisy = {s: (20.0 if s == 4096 else 0.3) for s in BASE}
    base = {s: SizeStats(s, m, m * (1 - noisy[s] / 100), m * (1 + noisy[s] / 100), 3) for s, m in BASE.items()}
    factors = {4096: 0.9, 65536: 1.04, MiB: 1.04, 64 * MiB: 1.04}
    v = screen(_const(_scaled(factors), 0.3), base, {s: 1.0 for s in BASE}, min_gain_pct=1.0,
              max_regression_pct=2.0)
    assert v.eligible, v.reason
    assert not v.regressions  # 10% slower at a size that varies by 20% is not a measured regression
    # The noisy size alone cannot make a candidate publishable.
    only_noise = {4096: 1.15, 65536: 1.0, MiB: 1.0, 64 * MiB: 1.0}
    assert not screen(_const(_scaled(only_noise), 0.3), base, {s: 1.0 for s in BASE}, min_gain_pct=1.0,
                     max_regression_pct=2.0).eligible


def test_screen_rejects_a_regression_at_a_quiet_size_even_with_a_big_gain() -> None:
    cand = _const(_scaled({65536: 0.95, MiB: 1.2, 64 * MiB: 1.2}), 0.3)
    v = screen(cand, _const(BASE, 0.3), {s: 1.0 for s in BASE}, min_gain_pct=1.0, max_regression_pct=2.0)
    assert v.gain_pct > 5
    assert not v.eligible
    assert [size for size, _ratio in v.regressions] == [65536]
    assert v.regressions[0][1] == pytest.approx(0.95)
    assert "1 size(s) slower" in v.reason and "64KiB" in v.reason


def test_screen_allows_a_regression_inside_the_noise_or_the_allowance() -> None:
    weights = {s: 1.0 for s in BASE}
    # 5% slower where the defaults vary by 6%: noise, not a regression.
    base = _const(BASE, 0.3)
    base[4096] = SizeStats(4096, 10.0, 9.4, 10.6, 3)
    cand = _const(_scaled({4096: 0.95, MiB: 1.1, 64 * MiB: 1.1}), 0.3)
    assert screen(cand, base, weights, min_gain_pct=1.0, max_regression_pct=2.0).eligible
    # 1.5% slower at a quiet size: within the 2% allowance; 3% is not.
    quiet = _const(BASE, 0.3)
    ok = _const(_scaled({4096: 0.985, MiB: 1.1, 64 * MiB: 1.1}), 0.3)
    bad = _const(_scaled({4096: 0.97, MiB: 1.1, 64 * MiB: 1.1}), 0.3)
    assert screen(ok, quiet, weights, min_gain_pct=1.0, max_regression_pct=2.0).eligible
    assert not screen(bad, quiet, weights, min_gain_pct=1.0, max_regression_pct=2.0).eligible


def test_screen_ignores_sizes_outside_the_profile() -> None:
    cand = _const(_scaled({4096: 0.8, 64 * MiB: 1.1}), 0.3)
    v = screen(cand, _const(BASE, 0.3), {4096: 0.0, 65536: 0.0, MiB: 0.0, 64 * MiB: 1.0},
              min_gain_pct=1.0, max_regression_pct=2.0)
    assert v.eligible and v.gain_pct == pytest.approx(10.0)


def test_screen_needs_every_weighted_size() -> None:
    cand = _const({s: v * 1.1 for s, v in BASE.items() if s != MiB}, 0.3)
    v = screen(cand, _const(BASE, 0.3), {s: 1.0 for s in BASE}, min_gain_pct=1.0, max_regression_pct=2.0)
    assert not v.eligible and "no result at 1 size(s)" in v.reason


def test_no_slower_is_not_evidence_for_any_candidate() -> None:
    """Equal to the defaults is what a backend that ignores NCCL's variables measures for every
    candidate: never published, the topology file alone included."""
    weights = {s: 1.0 for s in BASE}
    same = screen(_const(BASE, 0.3), _const(BASE, 0.3), weights, min_gain_pct=1.0, max_regression_pct=2.0)
    assert not same.eligible and same.reason.startswith("the medians are no faster overall (gain +0.00%)")
    slower = screen(_const(_scaled(0.9), 0.3), _const(BASE, 0.3), weights, min_gain_pct=1.0, max_regression_pct=2.0)
    assert not slower.eligible and len(slower.regressions) == len(BASE)

def test_a_loss_hidden_in_the_noise_of_small_sizes_is_not_published() -> None:
    # As seen on a 2-GPU node with host-clock timing: +4% at quiet large sizes, about -30% at
    # two launch-bound sizes that vary by 20% and more between runs. Beyond the noise only the
    # gain survives, but the medians say slower overall: not publishable.
    noise = {4096: 25.0, 65536: 20.0, MiB: 0.5, 16 * MiB: 0.5, 64 * MiB: 0.5, 256 * MiB: 0.5}
    base = {s: SizeStats(s, 100.0, 100.0 * (1 - n / 100), 100.0 * (1 + n / 100), 6) for s, n in noise.items()}
    cand_medians = {4096: 66.0, 65536: 68.0, MiB: 104.0, 16 * MiB: 104.0, 64 * MiB: 104.0, 256 * MiB: 104.0}
    cand = {s: SizeStats(s, m, m * (1 - noise[s] / 100), m * (1 + noise[s] / 100), 3)
            for s, m in cand_medians.items()}
    v = screen(cand, base, {s: 1.0 for s in LADDER}, min_gain_pct=1.0, max_regression_pct=2.0)
    assert v.robust_gain_pct > 1.0  # the shrunk estimate alone would have published it
    assert v.gain_pct < 0
    assert not v.eligible
    assert "medians are slower overall" in v.reason
    # The same large-size gain with small sizes merely noisy around the defaults is publishable.
    cand_medians.update({4096: 97.0, 65536: 101.0})
    cand = {s: SizeStats(s, m, m * (1 - noise[s] / 100), m * (1 + noise[s] / 100), 3)
            for s, m in cand_medians.items()}
    assert screen(cand, base, {s: 1.0 for s in LADDER}, min_gain_pct=1.0, max_regression_pct=2.0).eligible


# -- the sample-size rule ----------------------------------------------------------------------------


def test_t_quantiles_and_d2_match_the_tables() -> None:
    assert [round(t_quantile(0.95, df), 3) for df in (1, 2, 4, 8, 14)] == [6.314, 2.920, 2.132, 1.860, 1.761]
    assert round(t_quantile(0.99, 2), 3) == 6.965 and round(t_quantile(0.90, 3), 3) == 1.638
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    assert [d2(n) for n in (2, 3, 5, 8)] == [1.128, 1.693, 2.326, 2.847]
    with pytest.raises(ValueError):
        t_quantile(0.95, 0)


def test_a_spread_from_the_range_or_from_the_runs() -> None:
    # Without the runs, the spread comes from the range: ln(high/low) / d2(n).
    ranged = SizeStats(MiB, 100.0, 90.0, 110.0, 3)
    assert ranged.spread_log == pytest.approx(math.log(110 / 90) / 1.693)
    assert size_stats([{MiB: 90.0}, {MiB: 110.0}])[MiB].log_sd == pytest.approx(
        math.log(110 / 90) / math.sqrt(2))
