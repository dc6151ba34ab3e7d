"""Per-size statistics, profile weights, and the screening verdict.

Scores compare a candidate with NCCL's defaults size by size, as ratios, so that 64 KiB and
1 GiB count by their profile weight and not by their raw GB/s. What may be published is decided
by the one decision rule on paired runs (sweep/decision.py); this module holds what that rule and
the reports share (SizeStats, the t distribution, the profiles' weights) and the screen: is a
candidate measured once worth measuring again? Screening counts each size's change only beyond
the defaults' own spread there, refuses a candidate slower than the allowed regression beyond
that spread at any weighted size, and asks for a weighted gain above the configured minimum;
every screened winner is measured again, paired with the defaults, in a final check.

Where the runs themselves are not at hand (stats built from a median and a range), the spread s
of ln(busbw) is estimated from the range as ln(high / low) / d2(n), d2 being the mean range of n
standard normal samples (1.128, 1.693, 2.326, 2.847 for n = 2, 3, 5, 8).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..names import format_size

MiB = 1 << 20

# What one number is measured at: (collective, size_bytes). The statistics and the verdict take
# that key or a bare size (one collective's numbers); either way every key is judged on its own,
# so a collective slower at a size vetoes a setting however much faster another one got.
Key = tuple[str, int]
K = TypeVar("K", int, Key)
_DEFAULT_COLLECTIVE = "all_reduce"


def split_key(key: int | Key) -> Key:
    """(collective, size_bytes) of a key; a bare size is all_reduce's."""
    return key if isinstance(key, tuple) else (_DEFAULT_COLLECTIVE, key)


def key_label(key: int | Key) -> str:
    """'64 KiB', or 'all_gather 64 KiB' for a collective other than all_reduce."""
    collective, size = split_key(key)
    return format_size(size) if collective == _DEFAULT_COLLECTIVE else f"{collective} {format_size(size)}"

BUILTIN_PROFILES = {
    "balanced": "every size of the ladder weighs the same",
    "large": "sizes of 16 MiB and up (DDP/FSDP gradient buckets)",
    "small": "sizes up to 1 MiB (latency-bound collectives)",
}


# Mean range of n standard normal samples (d2 of quality control tables), n = 2..25: turns the
# range of n runs into an estimate of their standard deviation.
_D2 = (1.128, 1.693, 2.059, 2.326, 2.534, 2.704, 2.847, 2.970, 3.078, 3.173, 3.258, 3.336, 3.407, 3.472,
       3.532, 3.588, 3.640, 3.689, 3.735, 3.778, 3.819, 3.858, 3.895, 3.931)


@dataclass(frozen=True)
class SizeStats:
    size_bytes: int
    median: float
    low: float
    high: float
    n: int
    # Standard deviation of ln(busbw) over the runs; None where only median and range are known.
    log_sd: float | None = None
    collective: str = _DEFAULT_COLLECTIVE

    @property
    def noise_pct(self) -> float:
        """Half the relative spread of the repeats: how far one run may stray from the median."""
        if self.n < 2 or self.median <= 0:
            return 0.0
        return 100.0 * (self.high - self.low) / (2.0 * self.median)

    @property
    def spread_log(self) -> float:
        """Estimated standard deviation of ln(busbw) between runs (0 with fewer than two runs)."""
        if self.n < 2:
            return 0.0
        if self.log_sd is not None:
            return self.log_sd
        if self.low <= 0 or self.high <= 0:
            return 0.0
        return math.log(self.high / self.low) / d2(self.n)


def d2(n: int) -> float:
    """Mean range of n standard normal samples (n >= 2); beyond the table, its last entry, which
    overstates the spread a range implies: the safe side."""
    return _D2[min(max(n, 2), len(_D2) + 1) - 2]


def size_stats(runs: Sequence[Mapping[K, float]]) -> dict[K, SizeStats]:
    sizes = sorted({s for r in runs for s in r})
    out = {}
    for s in sizes:
        vals = [r[s] for r in runs if s in r]
        if vals:
            logs = [math.log(v) for v in vals if v > 0]
            sd = statistics.stdev(logs) if len(logs) >= 2 and len(logs) == len(vals) else None
            collective, size = split_key(s)
            out[s] = SizeStats(size, statistics.median(vals), min(vals), max(vals), len(vals), sd,
                               collective=collective)
    return out


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with an integer df >= 1, by the closed forms in theta = atan(t/sqrt(df))."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        # theta + sin(theta) * (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ...), terms up to cos^(df-2).
        acc, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):
            acc += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return 2.0 / math.pi * (theta + math.sin(theta) * acc)
    # sin(theta) * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), terms up to cos^(df-2).
    acc, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):
        acc += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return math.sin(theta) * acc


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with an integer df >= 1."""
    half = 0.5 * _t_two_sided(t, df)
    return 0.5 + half if t >= 0 else 0.5 - half


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile (0.5 <= p < 1) of Student's t with df >= 1 degrees of freedom."""
    if not 0.5 <= p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    target = 2.0 * p - 1.0
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) < target:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if _t_two_sided(mid, df) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def profile_weights(name: str, sizes: Sequence[int],
                    custom: Mapping[str, Mapping[int, float]]) -> dict[int, float]:
    """Weights per size of the ladder for a named profile.

    Raises:
        KeyError: unknown profile name.
    """
    if name in custom:
        weights = {s: 0.0 for s in sizes}
        for size, weight in custom[name].items():
            nearest = min(sizes, key=lambda s: abs(math.log(s) - math.log(size)))
            weights[nearest] += float(weight)
        return weights
    if name == "balanced":
        return {s: 1.0 for s in sizes}
    if name == "large":
        w = {s: (1.0 if s >= 16 * MiB else 0.0) for s in sizes}
        return w if any(w.values()) else {s: 1.0 for s in sizes[-1:]}
    if name == "small":
        w = {s: (1.0 if s <= MiB else 0.0) for s in sizes}
        return w if any(w.values()) else {s: 1.0 for s in sizes[:1]}
    raise KeyError(name)


def _gain_pct(terms: Iterable[tuple[float, float]]) -> float:
    """(weight, log ratio) pairs -> weighted geometric-mean gain in percent (0 without weight)."""
    total = 0.0
    acc = 0.0
    for w, x in terms:
        acc += w * x
        total += w
    if total == 0:
        return 0.0
    return 100.0 * (math.exp(acc / total) - 1.0)


def _beyond(x: float, margin: float) -> float:
    """A log ratio with `margin` taken off its size: what is left beyond the noise."""
    return math.copysign(max(0.0, abs(x) - margin), x)


def weighted_gain_pct(cand: Mapping[K, float], base: Mapping[K, float],
                      weights: Mapping[K, float]) -> float:
    """Weighted geometric mean of candidate/baseline ratios, as a percentage gain."""
    return _gain_pct((w, math.log(cand[s] / base[s])) for s, w in weights.items()
                     if w > 0 and cand.get(s, 0) > 0 and base.get(s, 0) > 0)


def screening_gain_pct(cand: Mapping[K, float], base: Mapping[K, SizeStats],
                       weights: Mapping[K, float]) -> float:
    """Weighted gain of a single measurement, each size's change shrunk by that size's noise.

    One run of a candidate against the baseline median: a difference no larger than twice the
    defaults' own spread at that size counts as nothing, so noisy sizes cannot rank candidates.
    """
    return _gain_pct((w, _beyond(math.log(cand[s] / base[s].median), 2.0 * base[s].noise_pct / 100.0))
                     for s, w in weights.items()
                     if w > 0 and cand.get(s, 0) > 0 and s in base and base[s].median > 0)


def screening_worst_pct(cand: Mapping[K, float], base: Mapping[K, SizeStats],
                        weights: Mapping[K, float]) -> float:
    """The worst weighted size of a single measurement, in percent, each size's change shrunk by
    twice that size's noise as in screening_gain_pct: 0 when no size is slower beyond its noise,
    -10 when one size is 10% slower than the defaults beyond it. What the final check's "no slower
    at any weighted size" would most likely refuse, seen before a finalist is measured again."""
    worst = min((_beyond(math.log(cand[s] / base[s].median), 2.0 * base[s].noise_pct / 100.0)
                 for s, w in weights.items()
                 if w > 0 and cand.get(s, 0) > 0 and s in base and base[s].median > 0), default=0.0)
    return 100.0 * (math.exp(min(worst, 0.0)) - 1.0)


def robust_gain_pct(cand: Mapping[K, SizeStats], base: Mapping[K, SizeStats],
                    weights: Mapping[K, float]) -> float:
    """Weighted gain of repeated measurements, each size's change counted only beyond the spread
    of both sides' repeats there. A consistent gain at quiet sizes survives; a difference at a size
    that varies by 20% from run to run counts as nothing, in either direction."""
    return _gain_pct((w, _beyond(math.log(cand[s].median / base[s].median),
                                 (base[s].noise_pct + cand[s].noise_pct) / 100.0))
                     for s, w in weights.items()
                     if w > 0 and s in cand and s in base and cand[s].median > 0 and base[s].median > 0)


def weighted_noise_pct(base: Mapping[K, SizeStats], weights: Mapping[K, float]) -> float:
    total = sum(w for s, w in weights.items() if s in base and w > 0)
    if total == 0:
        return 0.0
    return sum(w * base[s].noise_pct for s, w in weights.items() if s in base and w > 0) / total


@dataclass
class Screening(Generic[K]):
    """Is a candidate measured once worth measuring again (screen)?"""

    gain_pct: float  # weighted gain of the medians
    threshold_pct: float  # the configured minimum gain
    eligible: bool
    regressions: list[tuple[K, float]] = field(default_factory=list)  # (key, ratio), every collective's
    reason: str = ""
    robust_gain_pct: float = 0.0  # weighted gain counting each size only beyond its noise


def screen(cand: Mapping[K, SizeStats], base: Mapping[K, SizeStats], weights: Mapping[K, float], *,
           min_gain_pct: float, max_regression_pct: float) -> Screening[K]:
    """Is this candidate worth measuring again? Keyed by (collective, size), a regression of any
    collective at any size it weighs beyond the allowed regression and both sides' spread refuses
    it; its weighted gain beyond each size's spread must be above the minimum. Screening measures
    each candidate once (the per-size stage); every screened winner is measured again in a final
    check that the decision rule (sweep/decision.py) judges."""
    cm = {s: st.median for s, st in cand.items()}
    bm = {s: st.median for s, st in base.items()}
    gain = weighted_gain_pct(cm, bm, weights)
    robust = robust_gain_pct(cand, base, weights)
    threshold = min_gain_pct
    regressions: list[tuple[K, float]] = []
    for size, w in sorted(weights.items()):
        if w <= 0 or size not in cm or size not in bm or bm[size] <= 0:
            continue
        ratio = cm[size] / bm[size]
        slower_pct = 100.0 * (1.0 - ratio)
        # A size only counts as slower when the gap is beyond the allowed regression *and* beyond
        # what the defaults themselves vary by at that size: small messages vary by 15% and more.
        if slower_pct > max_regression_pct and slower_pct > base[size].noise_pct + cand[size].noise_pct:
            regressions.append((size, ratio))

    def verdict(eligible: bool, reason: str) -> Screening[K]:
        return Screening(gain, threshold, eligible, regressions, reason, robust)

    missing = [s for s, w in weights.items() if w > 0 and s in bm and s not in cm]
    if missing:
        return verdict(False, f"no result at {len(missing)} size(s)")
    if regressions:
        worst = min(regressions, key=lambda r: r[1])
        return verdict(False, f"{len(regressions)} size(s) slower than the defaults (worst {key_label(worst[0])}: "
                              f"x{worst[1]:.3f})")
    if gain <= 0.0:
        overall = "slower" if gain < 0.0 else "no faster"
        return verdict(False, f"the medians are {overall} overall (gain {gain:+.2f}%), {robust:+.2f}% beyond "
                              "the noise at each size")
    if robust <= threshold:
        return verdict(False, f"gain {gain:+.2f}%, of which {robust:+.2f}% beyond the noise at each size: not above "
                              f"the minimum of {threshold:.2f}%")
    return verdict(True, f"gain {gain:+.2f}%, {robust:+.2f}% beyond the noise at each size")


fmt_size = format_size
