"""Noise-aware choice: per-size statistics, profile-weighted score, and the publish verdict.

Scores compare a candidate with NCCL's defaults size by size, as ratios, so that 64 KiB and
1 GiB count by their profile weight and not by their raw GB/s. A candidate qualifies only when
its weighted gain beats both the configured minimum and the measured run-to-run noise, the
weighted gain of the plain medians is positive too, and no size the profile cares about got
slower than the allowed regression (beyond that size's noise).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class SizeStats:
    size_bytes: int
    median: float
    low: float
    high: float
    n: int
    collective: str = _DEFAULT_COLLECTIVE

    @property
    def noise_pct(self) -> float:
        """Half the relative spread of the repeats: how far one run may stray from the median."""
        if self.n < 2 or self.median <= 0:
            return 0.0
        return 100.0 * (self.high - self.low) / (2.0 * self.median)


def size_stats(runs: Sequence[Mapping[K, float]]) -> dict[K, SizeStats]:
    sizes = sorted({s for r in runs for s in r})
    out = {}
    for s in sizes:
        vals = [r[s] for r in runs if s in r]
        if vals:
            collective, size = split_key(s)
            out[s] = SizeStats(size, statistics.median(vals), min(vals), max(vals), len(vals), collective)
    return out


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
class Verdict(Generic[K]):
    gain_pct: float  # weighted gain of the medians
    threshold_pct: float  # the configured minimum gain
    eligible: bool
    regressions: list[tuple[K, float]] = field(default_factory=list)  # (key, ratio), every collective's
    reason: str = ""
    robust_gain_pct: float = 0.0  # weighted gain counting each size only beyond its noise


def judge(cand: Mapping[K, SizeStats], base: Mapping[K, SizeStats], weights: Mapping[K, float], *,
          min_gain_pct: float, max_regression_pct: float, require_gain: bool = True) -> Verdict[K]:
    """May this candidate be published instead of NCCL's defaults? Keyed by (collective, size),
    a regression of any collective at any size it weighs refuses the candidate."""
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
    missing = [s for s, w in weights.items() if w > 0 and s in bm and s not in cm]
    if missing:
        return Verdict(gain, threshold, False, regressions, f"no result at {len(missing)} size(s)", robust)
    if regressions:
        worst = min(regressions, key=lambda r: r[1])
        return Verdict(gain, threshold, False, regressions,
                       f"{len(regressions)} size(s) slower than the defaults (worst {key_label(worst[0])}: "
                       f"x{worst[1]:.3f})", robust)
    if require_gain and gain <= 0.0:
        # Counting each size only beyond its noise can hide a loss at noisy sizes; the medians
        # themselves saying "slower overall" is evidence enough not to publish.
        return Verdict(gain, threshold, False, regressions,
                       f"the medians are slower overall (gain {gain:+.2f}%), although {robust:+.2f}% beyond "
                       "the noise at each size", robust)
    if require_gain and robust <= threshold:
        return Verdict(gain, threshold, False, regressions,
                       f"gain {gain:+.2f}%, of which {robust:+.2f}% beyond the noise at each size: not above "
                       f"the minimum of {threshold:.2f}%", robust)
    return Verdict(gain, threshold, True, regressions,
                   f"gain {gain:+.2f}%, {robust:+.2f}% beyond the noise at each size", robust)


fmt_size = format_size
