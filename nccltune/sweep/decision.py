"""THE decision rule: may a candidate be published instead of NCCL's defaults? One rule for a
node's sweep (its finalists, its final check) and for `nccltune fleet decide` (a class's pooled
nodes), so a class decides as its nodes would, only surer.

What is compared. Never the two sides' pooled numbers, always pairs: a candidate's run with the
run of the defaults measured beside it (the same round of an interleaved final check, on the same
node), as the log ratio ln(candidate busbw / defaults busbw) per (collective, size). A node's
level (one node 3% faster than another at everything) and slow drift within a sweep are in both
sides of a pair and cancel, instead of counting as noise. Pairs are grouped by unit: the node
that measured them.

The gain. Each pair's profile-weighted mean log ratio over the weighted (collective, size) keys is
one sample of the candidate's gain. Their mean gets a one-sided Student's t bound,
mean - t(1 - alpha, df) * se, which narrows as pairs and nodes are added: se = sd / sqrt(pairs),
df = pairs - 1 while the nodes agree. Where they do not (the spread of the nodes' own means is
beyond what their pairs' spread explains: one-way analysis of variance, F test at
HETEROGENEITY_ALPHA), the unit is the node: se = sd(node means) / sqrt(nodes), df = nodes - 1.
A gain is claimed only when the bound is above ln(1 + min_gain_pct / 100).

No slower at any weighted size. An equivalence (non-inferiority) test with the explicit margin
max_regression_pct: at every weighted key the same one-sided bound of its mean log ratio must be
above ln(1 - max_regression_pct / 100). A key where the runs cannot show that refuses the
candidate; more runs can (see the sequential rounds). Every key must pass, so no correction for
the number of keys is needed (an intersection-union test is at level alpha as it is).

Many candidates. The finalists of one decision are a family: Holm's step-down keeps the chance
of publishing any candidate that is not really min_gain_pct faster at alpha (the k p-values in
ascending order, the j-th, from 0, tested at alpha / (k - j), stopping at the first that fails).
A class's tuner table is one decision per (collective, size) over many candidates: there
Benjamini-Hochberg keeps the expected share of table entries that are not really faster at
alpha (`false_discovery`).

Sequential rounds. A final check measures its candidates and the defaults in rounds; after the
rounds of each look (`looks`: the configured repeats, then about 1.6 times as many, up to the
ceiling) every open candidate is judged at that look's share of alpha (`spent`: alpha t^2
cumulatively, t the share of the ceiling's rounds done, so the shares add up to alpha and the
error rate holds over every look). Each part of a candidate's verdict is a sequential test of its
own: the gain, and "within the margin" at each weighted key. A part shown at one look, at that
look's share, stays shown (`Shown`): publishing a candidate still needs every part shown at some
look, and the chance that a false part is ever shown is at most the sum of the shares, alpha, as
before; a key only waits for the look its own pairs suffice at. A candidate that wins, or cannot
win (its gain's upper bound at FUTILITY_CONFIDENCE below the minimum, or a key slower than the
margin for sure), is measured no more; so is one clearly behind another (`behind`: the rounds both
measured, paired with each other, put its weighted gain below the other's at FUTILITY_CONFIDENCE).
Only those still open are measured again. The family of a look is every finalist that has not
won, measured or not (`holm`'s `family`): a candidate stopped without winning keeps its place,
untested, so no share of alpha passes from it to the ones still measured. A win is a rejection,
which Holm's step-down passes on (the closed testing it is short for, look by look); a stop is
not: were the family only the candidates still open, a candidate would get a larger share exactly
when the others' runs went badly, and in an A/A check where each of two stops with chance q at
the first look, a later look would publish a false winner with a chance of up to (1 + q) times its
share.

Nothing here gets stricter as evidence grows: the bounds narrow with every pair and every node,
a part once shown stays shown, and the number of looks is fixed by the configuration, not by the
data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .select import Key, key_label, t_cdf, t_quantile

K = TypeVar("K", int, Key)

ALPHA = 0.05  # one-sided: the chance of publishing a candidate that is not min_gain_pct faster
HETEROGENEITY_ALPHA = 0.01  # nodes whose pairs disagree beyond this: the node becomes the unit
FUTILITY_CONFIDENCE = 0.8  # a candidate whose gain is below the minimum at this confidence stops
LOOK_GROWTH = 1.6  # each look after about this many times the rounds of the one before
MAX_DF = 1000  # beyond: the t quantile of 1000 degrees of freedom (a little wider: the safe side)


# -- the pairs -------------------------------------------------------------------------------------

Block = Mapping[K, float]  # one pair: key -> ln(candidate busbw / defaults busbw)


@dataclass(frozen=True)
class Evidence(Generic[K]):
    """A candidate's pairs, grouped by the unit (node) that measured them."""

    units: tuple[tuple[Block[K], ...], ...]
    names: tuple[str, ...] = ()

    @property
    def pairs(self) -> int:
        return sum(len(u) for u in self.units)

    @property
    def nodes(self) -> int:
        return sum(1 for u in self.units if u)


def log_ratios(cand: Mapping[K, float], base: Mapping[K, float]) -> dict[K, float]:
    """ln(cand / base) at every key both measured (a bandwidth of 0 or less is no measurement)."""
    return {k: math.log(v / base[k]) for k, v in cand.items() if v > 0 and base.get(k, 0.0) > 0}


def paired_rounds(cand: Mapping[int, Mapping[K, float]], base: Mapping[int, Mapping[K, float]]) -> tuple[Block[K], ...]:
    """One node's pairs from interleaved rounds (round -> busbw per key): each round's candidate run
    with that round's run of the defaults; a round where either failed is no pair."""
    return tuple(b for r in sorted(cand) if r in base and (b := log_ratios(cand[r], base[r])))


def against_mean(cand: Sequence[Mapping[K, float]], base: Sequence[Mapping[K, float]]) -> tuple[Block[K], ...]:
    """One node's pairs where its runs were not interleaved by rounds (a per-size trial, measured
    once per node): each candidate run against the geometric mean of the node's runs of the
    defaults at each key."""
    logs: dict[K, list[float]] = {}
    for run in base:
        for k, v in run.items():
            if v > 0:
                logs.setdefault(k, []).append(math.log(v))
    mean = {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}
    return tuple(b for run in cand if (b := log_ratios(run, mean)))


def evidence(units: Mapping[str, Sequence[Block[K]]]) -> Evidence[K]:
    """Evidence from each unit's (node's) pairs, units in name order."""
    names = tuple(sorted(units))
    return Evidence(tuple(tuple(units[n]) for n in names), names)


# -- the statistics --------------------------------------------------------------------------------

def t_bound_quantile(p: float, df: int) -> float:
    return t_quantile(p, min(df, MAX_DF))


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with df degrees of freedom."""
    return 1.0 - t_cdf(t, min(df, MAX_DF))


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-12:
            break
    return h


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def f_sf(f: float, d1: int, d2: int) -> float:
    """P(F > f) for Fisher's F with (d1, d2) degrees of freedom."""
    if f <= 0.0:
        return 1.0
    return beta_inc(d2 / 2.0, d1 / 2.0, d2 / (d2 + d1 * f))


@dataclass(frozen=True)
class Estimate:
    """The mean of a set of paired log ratios and what bounds it."""

    mean: float
    se: float
    df: int
    pairs: int
    nodes: int
    by_node: bool  # the nodes disagreed: the node is the unit (se and df from the nodes' means)

    def lower(self, alpha: float) -> float:
        return self.mean - t_bound_quantile(1.0 - alpha, self.df) * self.se

    def upper(self, alpha: float) -> float:
        return self.mean + t_bound_quantile(1.0 - alpha, self.df) * self.se

    def p_above(self, threshold: float) -> float:
        """One-sided p value of "the true mean is at most `threshold`"."""
        if self.se <= 0.0:
            return 0.0 if self.mean > threshold else 1.0
        return t_sf((self.mean - threshold) / self.se, self.df)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _ss(xs: Sequence[float], around: float) -> float:
    return sum((x - around) ** 2 for x in xs)


def estimate(groups: Sequence[Sequence[float]]) -> Estimate | None:
    """The mean of every value of every group (a group: one node's pairs) with its standard error
    and degrees of freedom, the node as the unit where the nodes disagree (the module's docstring).
    None with fewer than two values: nothing then bounds the spread."""
    groups = [list(g) for g in groups if g]
    values = [x for g in groups for x in g]
    n, k = len(values), len(groups)
    if n < 2:
        return None
    grand = _mean(values)
    within_df = n - k
    if k >= 2 and within_df >= 1:
        ss_within = sum(_ss(g, _mean(g)) for g in groups)
        ss_between = sum(len(g) * (_mean(g) - grand) ** 2 for g in groups)
        ms_within, ms_between = ss_within / within_df, ss_between / (k - 1)
        disagree = (ms_between > 0.0 and (ms_within <= 0.0 or
                                          f_sf(ms_between / ms_within, k - 1, within_df) < HETEROGENEITY_ALPHA))
        if disagree:
            means = [_mean(g) for g in groups]
            centre = _mean(means)
            return Estimate(centre, math.sqrt(_ss(means, centre) / (k - 1) / k), k - 1, n, k, True)
    return Estimate(grand, math.sqrt(_ss(values, grand) / (n - 1) / n), n - 1, n, k, False)


# -- one candidate ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    min_gain_pct: float  # the least weighted gain worth publishing
    max_regression_pct: float  # the equivalence margin: no weighted key slower by more
    alpha: float = ALPHA

    @property
    def gain_floor(self) -> float:
        return math.log1p(self.min_gain_pct / 100.0)

    @property
    def margin(self) -> float:
        return math.log1p(-min(self.max_regression_pct, 99.0) / 100.0)


WIN, LOSE, OPEN = "win", "lose", "open"


def pct(log_ratio: float) -> float:
    return 100.0 * math.expm1(log_ratio)


@dataclass(frozen=True)
class Shown(Generic[K]):
    """What earlier looks of a sequential check showed for a candidate, each at its look's level:
    its gain above the minimum (for its family, Holm's), and the keys shown within the margin."""

    gain: bool = False
    keys: frozenset[K] = frozenset()


@dataclass
class Verdict(Generic[K]):
    """One candidate against NCCL's defaults under the rule."""

    status: str  # WIN, LOSE (cannot win: stop measuring it) or OPEN (more runs could decide)
    eligible: bool  # may be published (status WIN)
    reason: str
    gain_pct: float  # the weighted gain's estimate (exp of the mean weighted log ratio, minus 1)
    threshold_pct: float  # the configured minimum gain
    lower_pct: float | None = None  # the weighted gain's one-sided lower bound at `alpha`
    upper_pct: float | None = None  # ... and its upper bound at FUTILITY_CONFIDENCE
    alpha: float = ALPHA  # the level it was judged at (its share of the family and the looks)
    p_value: float | None = None  # of "the gain is at most the minimum"
    pairs: int = 0
    nodes: int = 0
    by_node: bool = False
    regressions: list[tuple[K, float]] = field(default_factory=list)  # (key, ratio): keys not shown no slower
    too_few_runs: bool = False
    shown: Shown[K] = field(default_factory=Shown)  # what this verdict and the looks before it showed

    @property
    def supported_gain_pct(self) -> float | None:
        """The gain the runs support at the verdict's confidence: its lower bound."""
        return self.lower_pct

    @property
    def confidence_pct(self) -> float:
        return 100.0 * (1.0 - self.alpha)


def weighted_blocks(ev: Evidence[K], weights: Mapping[K, float]) -> list[list[float]]:
    """Each pair's weighted mean log ratio, grouped by node; a pair missing a weighted key is left out."""
    keys = [k for k, w in weights.items() if w > 0]
    total = sum(weights[k] for k in keys)
    out = []
    for unit in ev.units:
        out.append([sum(weights[k] * b[k] for k in keys) / total for b in unit if all(k in b for k in keys)])
    return out


def key_values(ev: Evidence[K], key: K) -> list[list[float]]:
    return [[b[key] for b in unit if key in b] for unit in ev.units]


def judge(ev: Evidence[K], weights: Mapping[K, float], rule: Rule, *, alpha: float | None = None,
          shown: Shown[K] | None = None) -> Verdict[K]:
    """One candidate's verdict at `alpha` (the rule's own unless its share of a family or a look);
    `shown`: what earlier looks of a sequential check showed, which stays shown (the module's
    docstring)."""
    a = rule.alpha if alpha is None else alpha
    prior: Shown[K] = shown if shown is not None else Shown()
    keys = sorted(k for k, w in weights.items() if w > 0)
    threshold = rule.min_gain_pct
    if not keys:
        return Verdict(LOSE, False, "no weighted size was measured", 0.0, threshold, alpha=a)
    scores = weighted_blocks(ev, weights)
    gain = estimate(scores)
    if gain is None:
        measured = ev.pairs
        single = [x for g in scores for x in g]
        return Verdict(OPEN, False, f"{measured} finalist sample{'s' if measured != 1 else ''} paired with the "
                                    "defaults: cannot show a gain beyond noise (sweep.finalist_repeats of 2 or more "
                                    "can)",
                       pct(_mean(single)) if single else 0.0, threshold, alpha=a, pairs=measured, nodes=ev.nodes,
                       too_few_runs=True, shown=prior)
    lower, upper = gain.lower(a), gain.upper(1.0 - FUTILITY_CONFIDENCE)
    p = gain.p_above(rule.gain_floor)
    gain_shown = prior.gain or lower > rule.gain_floor
    not_shown: list[tuple[K, float]] = []
    slower: list[tuple[K, float]] = []
    within = set(prior.keys)
    for k in keys:
        if k in prior.keys:
            continue
        est = estimate(key_values(ev, k))
        if est is None:
            not_shown.append((k, math.exp(_mean([x for g in key_values(ev, k) for x in g] or [0.0]))))
            continue
        if est.lower(a) > rule.margin:
            within.add(k)
            continue
        not_shown.append((k, math.exp(est.mean)))
        if est.upper(a) < rule.margin:
            slower.append((k, math.exp(est.mean)))
    base = dict(gain_pct=pct(gain.mean), threshold_pct=threshold, lower_pct=pct(lower), upper_pct=pct(upper),
                alpha=a, p_value=p, pairs=gain.pairs, nodes=gain.nodes, by_node=gain.by_node,
                shown=Shown(gain_shown, frozenset(within)))
    conf = f"{100 * (1 - a):.1f}%" if a < 0.01 else f"{100 * (1 - a):.0f}%"
    evid = (f"{gain.pairs} pair(s) on {gain.nodes} node(s)" + (", the node as the unit (the nodes disagree)"
                                                               if gain.by_node else ""))
    said = (f"gain {pct(gain.mean):+.2f}%, at least {pct(lower):+.2f}% at {conf} confidence ({evid})"
            + (", shown above the minimum at an earlier look" if prior.gain else ""))
    earlier = f" ({len(prior.keys)} of them shown at an earlier look)" if prior.keys else ""
    if slower:
        worst = min(slower, key=lambda r: r[1])
        return Verdict(LOSE, False, f"{said}, but {len(slower)} size(s) slower than the defaults by more than "
                                    f"{rule.max_regression_pct:g}% (worst {key_label(worst[0])}: x{worst[1]:.3f})",
                       regressions=slower, **base)  # type: ignore[arg-type]
    if not gain_shown and upper <= rule.gain_floor:
        return Verdict(LOSE, False, f"{said}: not above the minimum of {threshold:.2f}% (at most {pct(upper):+.2f}% "
                                    f"at {100 * FUTILITY_CONFIDENCE:.0f}% confidence)",
                       regressions=not_shown, **base)  # type: ignore[arg-type]
    if not gain_shown:
        return Verdict(OPEN, False, f"{said}: not shown above the minimum of {threshold:.2f}%",
                       regressions=not_shown, **base)  # type: ignore[arg-type]
    if not_shown:
        worst = min(not_shown, key=lambda r: r[1])
        return Verdict(OPEN, False, f"{said}, but {len(not_shown)} size(s) not shown within "
                                    f"{rule.max_regression_pct:g}% of the defaults (worst {key_label(worst[0])}: "
                                    f"x{worst[1]:.3f}){earlier}", regressions=not_shown,
                       **base)  # type: ignore[arg-type]
    return Verdict(WIN, True, f"{said}, every weighted size within {rule.max_regression_pct:g}% of the defaults or "
                              f"faster{earlier}", **base)  # type: ignore[arg-type]


def behind(lead: Mapping[int, Mapping[K, float]], other: Mapping[int, Mapping[K, float]],
           weights: Mapping[K, float]) -> bool:
    """Whether `other` is clearly behind `lead`, two candidates measured in the same rounds (round
    -> busbw per key): each round both measured is a pair ln(other / lead), the defaults of the
    round cancelling out, and the upper bound of its profile-weighted mean at FUTILITY_CONFIDENCE
    is below 0. Stops measuring `other`, never publishes anything: a futility rule."""
    est = estimate(weighted_blocks(Evidence((paired_rounds(other, lead),)), weights))
    return est is not None and est.upper(1.0 - FUTILITY_CONFIDENCE) < 0.0


# -- families and looks ----------------------------------------------------------------------------

def holm(evs: Mapping[str, Evidence[K]], weights: Mapping[K, float], rule: Rule,
         alpha: float | None = None, *, family: int | None = None,
         shown: Mapping[str, Shown[K]] | None = None) -> dict[str, Verdict[K]]:
    """Every candidate of one family judged with Holm's step-down at `alpha` (the module's docstring).
    `family`: the family's size where it holds candidates not judged here (stopped without winning
    at an earlier look: they keep their place, untested, last in the order); `shown`: per
    candidate, what earlier looks showed (a gain shown then counts as passing Holm's step)."""
    a = rule.alpha if alpha is None else alpha
    prior = shown or {}
    k = max(len(evs), family or 0)
    first = {name: judge(ev, weights, rule, alpha=a / max(k, 1), shown=prior.get(name)) for name, ev in evs.items()}

    def rank(n: str) -> tuple[float, str]:
        p = first[n].p_value
        if n in prior and prior[n].gain:
            return (-1.0, n)
        return (p if p is not None else 2.0, n)

    order = sorted(evs, key=rank)
    out: dict[str, Verdict[K]] = {}
    still = True
    for j, name in enumerate(order):
        before = prior.get(name, Shown())
        v = judge(evs[name], weights, rule, alpha=a / (k - j), shown=before)
        if still and (before.gain or (v.p_value is not None and v.p_value <= a / (k - j))):
            out[name] = v
            continue
        still = False
        # Holm stopped at this or an earlier candidate: its gain is not shown for the family.
        kept = Shown(before.gain, v.shown.keys)
        if v.shown.gain != kept.gain:
            # Its own bound clears, but not for the family.
            v = dataclasses.replace(v, status=OPEN if v.status == WIN else v.status, eligible=False, shown=kept,
                                    reason=f"{v.reason}; not shown for a family of {k} candidate(s) (Holm)")
        out[name] = v
    return out


def false_discovery(p_values: Mapping[str, float], alpha: float = ALPHA) -> set[str]:
    """Benjamini-Hochberg at `alpha`: the tests whose finding stands."""
    ranked = sorted(p_values.items(), key=lambda kv: (kv[1], kv[0]))
    m = len(ranked)
    cut = 0
    for i, (_name, p) in enumerate(ranked, start=1):
        if p <= alpha * i / m:
            cut = i
    return {name for name, _p in ranked[:cut]}


def looks(first: int, last: int) -> list[int]:
    """The rounds after which a final check judges: `first`, then about LOOK_GROWTH times as many
    each, ending at `last` (never below `first`)."""
    first = max(first, 1)
    last = max(last, first)
    out = [first]
    while out[-1] < last:
        out.append(min(last, max(out[-1] + 1, math.ceil(out[-1] * LOOK_GROWTH))))
    return out


def spent(rounds: Sequence[int], alpha: float = ALPHA) -> list[float]:
    """The share of `alpha` each look may use: alpha t^2 cumulatively, t = rounds / the last's."""
    last = rounds[-1]
    cumulative = [alpha * (r / last) ** 2 for r in rounds]
    return [c - p for c, p in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]


def describe(rounds: Iterable[int]) -> str:
    return ", ".join(str(r) for r in rounds)
