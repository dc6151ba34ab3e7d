"""Search strategies: staged (screen, combine, re-measure finalists) or the exhaustive grid.

Both start with NCCL's defaults, repeated, to learn the run-to-run noise. Staged then measures
each candidate value once, combines the best values of the variables that helped, and
re-measures a few finalists with repeats, interleaved with more baseline runs so that drift
over the sweep hits both sides alike. The caller supplies `measure(env, phase, label)`.

Only the finalists' own re-measured runs are judged (select.py), never their screening run: that
one was picked for looking fast, so it is biased upwards. A finalist with a single run cannot be
published for a gain at all; the search says so in its notes rather than leaving a bare "nothing
beat the defaults".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from . import decision
from .decision import Verdict
from .plan import Plan, prune_channels
from .select import Key, SizeStats, screening_gain_pct, screening_worst_pct, size_stats
from .space import CATALOGUE

log = logging.getLogger(__name__)

Env = dict[str, str]
# measure(env, phase, label) -> (busbw per (collective, size), NCCL summary) or None when the trial failed
Measure = Callable[[Env, str, str], "tuple[dict[Key, float], dict[str, Any]] | None"]


@dataclass
class Settings:
    baseline_repeats: int = 3
    finalist_repeats: int = 3
    # The ceiling of the sequential final check: rounds are added, up to this many, only while a
    # finalist is still undecided (sweep.decision.looks).
    max_finalist_repeats: int = 0  # 0: no rounds added
    # The final check's trials at most: a look's rounds are added only when they fit (0: no bound).
    max_final_trials: int = 0
    max_finalists: int = 3
    min_gain_pct: float = 1.0
    max_regression_pct: float = 2.0
    max_combine: int = 3
    exhaustive: bool = False
    max_grid: int = 400


@dataclass
class Finalist:
    env: Env
    label: str
    runs: list[dict[Key, float]] = field(default_factory=list)
    stats: dict[Key, SizeStats] = field(default_factory=dict)
    verdict: Verdict[Key] | None = None
    rounds: dict[int, dict[Key, float]] = field(default_factory=dict)  # round of the final check -> its run


@dataclass
class FinalCheck:
    """What a final check measured: the defaults' run of each round, the rounds done, the trials."""

    base_rounds: dict[int, dict[Key, float]] = field(default_factory=dict)
    rounds: int = 0
    trials: int = 0
    looks: list[int] = field(default_factory=list)


# What a final check measures: a finalist's round, or the defaults' run of the round.
RoundPhase = Literal["final", "baseline"]


def round_measure(trial: Callable[[Env, RoundPhase, str], dict[Key, float] | None], base_runs: list[dict[Key, float]],
                  defaults_label: Callable[[int], str]) -> Callable[[Finalist | None, int], dict[Key, float] | None]:
    """`final_check`'s `measure` over `trial(env, phase, label)` (busbw per key, None for a failed
    trial): a finalist's round is a "final" trial labelled with its round, the defaults' a "baseline"
    trial labelled `defaults_label(round)`, whose runs also join `base_runs`, the runs of the defaults
    the search measured before: the defaults' medians are those of every run of the defaults."""

    def measure(f: Finalist | None, r: int) -> dict[Key, float] | None:
        if f is not None:
            return trial(f.env, "final", f"{f.label} #{r + 1}")
        got = trial({}, "baseline", defaults_label(r))
        if got is not None:
            base_runs.append(got)
        return got

    return measure


def planned_looks(candidates: int, *, first: int, last: int, max_trials: int = 0) -> list[int]:
    """The looks a final check of `candidates` finalists plans, fixed before anything is measured
    (final_check's arguments; a `last` below `first` is `first`: no rounds added). With
    `max_trials`, for what the bound lets the leader alone reach (the first look's rounds for every
    finalist, then one finalist and the defaults per round): alpha is never spent on a look that
    cannot come. Fewer than two rounds asked for: no extension either (one run cannot show a gain,
    and the configuration said so)."""
    if first <= 0:
        return []
    if max_trials:
        last = min(last, first + max(0, max_trials - first * (candidates + 1)) // 2)
    return decision.looks(first, last if first >= 2 else first)


def final_check_trials(candidates: int, *, first: int, last: int, max_trials: int = 0) -> tuple[int, int]:
    """The trials of a final check of `candidates` finalists: (when every one is decided at the first
    look, at most: every look's rounds while all stay open, within `max_trials`)."""
    looks = planned_looks(candidates, first=first, last=last, max_trials=max_trials)
    if not looks:
        return 0, 0
    first_look, every = looks[0] * (candidates + 1), looks[-1] * (candidates + 1)
    return first_look, max(first_look, min(every, max_trials)) if max_trials else every


def final_check(finalists: list[Finalist], measure: Callable[[Finalist | None, int], dict[Key, float] | None],
                weights: Mapping[Key, float], rule: decision.Rule, *, first: int, last: int,
                max_trials: int = 0) -> FinalCheck:
    """The finalists and the defaults in interleaved rounds (each finalist still open, then the
    defaults), judged after each look of sweep.decision.looks(first, last) with that look's share of
    alpha, Holm over every finalist that has not won (sweep.decision.holm's family); what a look
    showed of a finalist (its gain, each size within the margin) stays shown at the looks after it.
    A finalist that won, cannot win, or is clearly behind another still in the running
    (sweep.decision.behind) is measured no more. `max_trials` (0: no bound): the rounds of a look
    after the first are measured only when all of them fit within that many trials of the check.
    `measure(finalist, round)`, None for the defaults' run of the round, returns busbw per key or
    None for a failed trial. Each finalist ends with its verdict at its last look."""
    out = FinalCheck(looks=planned_looks(len(finalists), first=first, last=last, max_trials=max_trials))
    still = list(finalists)
    shown: dict[str, decision.Shown[Key]] = {}
    won = 0  # only a win frees a place in Holm's family (sweep.decision's docstring)
    for look, share in zip(out.looks, decision.spent(out.looks, rule.alpha) if out.looks else [], strict=True):
        if out.rounds and max_trials and out.trials + (look - out.rounds) * (len(still) + 1) > max_trials:
            break
        while out.rounds < look:
            for f in still:
                got = measure(f, out.rounds)
                out.trials += 1
                if got:
                    f.runs.append(got)
                    f.rounds[out.rounds] = got
            got = measure(None, out.rounds)
            out.trials += 1
            if got:
                out.base_rounds[out.rounds] = got
            out.rounds += 1
        judged = {str(i): f for i, f in enumerate(finalists) if any(f is g for g in still)}
        evs = {i: decision.Evidence((decision.paired_rounds(f.rounds, out.base_rounds),)) for i, f in judged.items()}
        verdicts = decision.holm(evs, weights, rule, alpha=share, family=len(finalists) - won,
                                 shown={i: shown[i] for i in judged if i in shown})
        for i, f in judged.items():
            f.verdict = verdicts[i]
            f.stats = size_stats(f.runs)
            shown[i] = verdicts[i].shown
        won += sum(1 for v in verdicts.values() if v.status == decision.WIN)
        still = [f for f in still if f.verdict is not None and f.verdict.status == decision.OPEN]
        if look != out.looks[-1]:
            still = _not_behind(finalists, still, weights)
        if not still:
            break
    return out


def _not_behind(finalists: list[Finalist], still: list[Finalist], weights: Mapping[Key, float]) -> list[Finalist]:
    """The open finalists that are not clearly behind the leader (the finalist with the largest gain
    estimate among those that won or are open); the others get a verdict that says so."""
    running = [f for f in finalists if f.verdict is not None and f.verdict.status in (decision.WIN, decision.OPEN)
               and not f.verdict.too_few_runs]
    if len(running) < 2:
        return still
    lead = max(running, key=lambda f: f.verdict.gain_pct if f.verdict else 0.0)
    out = []
    for f in still:
        if f is not lead and f.verdict is not None and decision.behind(lead.rounds, f.rounds, weights):
            f.verdict = dataclasses.replace(
                f.verdict, status=decision.LOSE, eligible=False,
                reason=f"{f.verdict.reason}; behind {lead.label} (its weighted gain below that one's at "
                       f"{100 * decision.FUTILITY_CONFIDENCE:.0f}% confidence, the rounds both measured paired): "
                       "measured no more")
            continue
        out.append(f)
    return out


@dataclass
class SearchResult:
    baseline_runs: list[dict[Key, float]]
    baseline: dict[Key, SizeStats]
    screened: list[tuple[Env, str, float | None]]  # env, label, gain (None = failed)
    finalists: list[Finalist]
    chosen: Finalist | None
    topo_only: Finalist | None
    weights: dict[Key, float]
    notes: list[str] = field(default_factory=list)  # what the search says about its own evidence
    final: FinalCheck = field(default_factory=lambda: FinalCheck())  # the finalist round, as it ran
    # Per screened label: its worst weighted size beyond noise, in percent (select.screening_worst_pct).
    screen_worst_pct: dict[str, float] = field(default_factory=dict)


def rank_screened(screened: list[tuple[Env, str, float | None]], worst_pct: Mapping[str, float],
                  max_regression_pct: float, *, leave_out: Env | None = None) -> list[tuple[Env, str, float]]:
    """THE order in which screened settings become finalists (the staged search's, the per-size
    stage's whole-environment part): those that helped, the ones whose screening run was slower than
    the defaults beyond noise by more than the regression margin at some weighted size after all the
    others (the final check would most likely refuse them for that size), each group by gain.
    `leave_out`: a setting that is not a candidate of its own (the topology file alone)."""
    helped = [(env, label, gain) for env, label, gain in screened
              if gain is not None and gain > 0 and env != leave_out]
    return sorted(helped, key=lambda s: (worst_pct.get(s[1], 0.0) < -max_regression_pct, -s[2]))


TOPO_ONLY = "topology file only"
# Carried by every candidate, so left out of labels: nccltune's topology file, and the policy
# variables (not swept; set in the candidates so that a finished trial shows torch accepts them).
CARRIED = {"NCCL_TOPO_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def label_of(env: Mapping[str, str], base: Mapping[str, str] | None = None) -> str:
    """A short name for a candidate: the swept variables it sets. The topology file alone is
    "topology file only"; nothing at all is "defaults"."""
    base = base or {}
    diff = {k: v for k, v in env.items() if base.get(k) != v and k not in CARRIED}
    if diff:
        return " ".join(f"{k}={v}" for k, v in sorted(diff.items()))
    return TOPO_ONLY if "NCCL_TOPO_FILE" in env else "defaults"


class Search:
    def __init__(self, plan: Plan, settings: Settings, measure: Measure, *, common: Env,
                 weights: dict[Key, float]) -> None:
        """`common`: what every non-baseline candidate carries (trials.trialenv.carried: the policy
        values and NCCL_TOPO_FILE as the marker for nccltune's topology file); `weights`: the
        profile's, per (collective, size), every collective judged at every size it weighs."""
        self.plan = plan
        self.s = settings
        self.measure = measure
        self.common = dict(common)
        self.weights = weights
        self.notes: list[str] = []
        self.rule = decision.Rule(settings.min_gain_pct, settings.max_regression_pct)
        self.final = FinalCheck()
        self.worst_pct: dict[str, float] = {}

    def estimate_trials(self) -> int:
        """Trials `run()` makes when every candidate helps in screening and the final check decides
        at its first look: exact then for the exhaustive grid, an upper bound for the staged search
        (combining stops early when fewer variables help, and only candidates that helped become
        finalists)."""
        return self.trial_bounds()[0]

    def trial_bounds(self) -> tuple[int, int]:
        """(estimate_trials(), the most trials `run()` can make: the final check's every look while
        all its finalists stay undecided, within sweep.max_final_trials)."""
        topo = 1 if self.common else 0
        if self.s.exhaustive:
            # Every grid point but the all-unset one, plus the topology file alone.
            points = self.grid_points() - 1
            before, finalists = points + topo, min(self.s.max_finalists, points) + topo
        else:
            singles = self.plan.screening_count()
            combine = min(self.s.max_combine, max(0, len(self.plan.variables) - 1))
            before, finalists = singles + topo + combine, min(self.s.max_finalists, singles + combine) + topo
        fr = self.s.finalist_repeats
        about, most = final_check_trials(finalists, first=fr, last=self.s.max_finalist_repeats,
                                         max_trials=self.s.max_final_trials)
        return self.s.baseline_repeats + before + about, self.s.baseline_repeats + before + most

    def grid_points(self) -> int:
        """Points of the exhaustive grid, the all-unset one included."""
        grid = 1
        for vals in self.plan.variables.values():
            grid *= len(vals) + 1
        return grid

    def run(self) -> SearchResult:
        if self.s.exhaustive and self.grid_points() > self.s.max_grid:
            # Refused before anything is measured: the baseline would be wasted device time.
            from ..errors import UsageError

            raise UsageError(f"the exhaustive grid has {self.grid_points()} points (more than "
                             f"{self.s.max_grid}); narrow sweep.variables or use the staged strategy")
        # 0 finalist repeats: a final check elsewhere (the per-size stage) takes the finalist round.
        if 0 < self.s.finalist_repeats < 2:
            self._note(f"sweep.finalist_repeats is {self.s.finalist_repeats}: 1 finalist sample cannot show a gain "
                       "beyond noise, so only NCCL's defaults (or them with the topology file) can be published")
        base_runs: list[dict[Key, float]] = []
        for i in range(self.s.baseline_repeats):
            got = self.measure({}, "baseline", f"defaults #{i + 1}")
            if got is None:
                continue
            busbw, nccl = got
            base_runs.append(busbw)
            if len(base_runs) == 1:
                # The first run that worked, which need not be the first run: a failed first
                # trial must not leave channel values in the plan that cannot change anything.
                dropped = prune_channels(self.plan, nccl.get("coll_channels"))
                for d in dropped:
                    log.info("pruned %s=%s: %s", d.name, d.value, d.reason)
        if len(base_runs) < 1:
            from ..errors import CheckFailed

            raise CheckFailed("every run of NCCL's defaults failed; see the trial logs in the state "
                              "directory")
        baseline = size_stats(base_runs)
        baseline_trials = self.s.baseline_repeats

        screened: list[tuple[Env, str, float | None]] = []

        def screen(env: Env) -> float | None:
            for done, _label, gain in screened:
                if done == env:  # combining can arrive at a setting already screened
                    return gain
            label = label_of(env, {})
            got = self.measure(env, "exhaustive" if self.s.exhaustive else "screen", label)
            gain = screening_gain_pct(got[0], baseline, self.weights) if got else None
            if got:
                self.worst_pct[label] = screening_worst_pct(got[0], baseline, self.weights)
            screened.append((env, label, gain))
            return gain

        if self.common:
            screen(dict(self.common))
        if self.s.exhaustive:
            names = list(self.plan.variables)
            grid = list(itertools.product(*[[None, *self.plan.variables[n]] for n in names]))
            for combo in grid:
                env = dict(self.common)
                env.update({n: v for n, v in zip(names, combo, strict=True) if v is not None})
                if env != self.common:
                    screen(env)
        else:
            self._screen_singles(screen, screened)
            self._combine(screen, screened)

        finalists = self._finalists(screened)
        topo_only = next((f for f in finalists if f.env == self.common), None) if self.common else None
        # Finalists and the defaults again, round-robin, so slow drift affects both alike and
        # each finalist's run pairs with the defaults' run of its round.
        first_round = baseline_trials
        measure = round_measure(self._busbw, base_runs, lambda r: f"defaults #{first_round + r + 1}")
        check = final_check(finalists, measure, self.weights, self.rule, first=self.s.finalist_repeats,
                            last=self.s.max_finalist_repeats,
                            max_trials=self.s.max_final_trials)
        self.final = check
        baseline = size_stats(base_runs)
        chosen = None
        short = [f for f in finalists if f.verdict and f.verdict.too_few_runs]
        if short and self.s.finalist_repeats >= 2:
            # The configured repeats would do; failed runs left too few.
            for f in short:
                self._note(f"{f.label}: {f.verdict.reason if f.verdict else ''}")
        # The topology file alone competes like any candidate: on its gain.
        eligible = [f for f in finalists if f.verdict and f.verdict.eligible]
        if eligible:
            chosen = max(eligible, key=lambda f: f.verdict.gain_pct if f.verdict else 0.0)
        return SearchResult(base_runs, baseline, screened, finalists, chosen, topo_only, self.weights,
                            self.notes, check, dict(self.worst_pct))

    def _busbw(self, env: Env, phase: str, label: str) -> dict[Key, float] | None:
        got = self.measure(env, phase, label)
        return None if got is None else got[0]

    def _note(self, text: str) -> None:
        log.warning("%s", text)
        self.notes.append(text)

    def _screen_singles(self, screen: Callable[[Env], float | None],
                        screened: list[tuple[Env, str, float | None]]) -> None:
        """Each candidate value once. A variable that acts only with another (space.Tunable.acts_with,
        swept here too) is screened after it, on top of that variable's best value that helped:
        alone it would be measured as NCCL's defaults and never combined. Where no value of the
        partner helped, it is screened alone unless the plan knows it is the defaults alone on this
        node (plan.inert_alone): those trials would measure the defaults again."""
        later = [(n, v) for n, v in self.plan.candidates() if self._partner(n)]
        for name, value in self.plan.candidates():
            if (name, value) not in later:
                screen({**self.common, name: value})
        skipped: dict[str, list[str]] = {}
        for name, value in later:
            partner = self._partner(name)
            best = self._best_single(screened).get(partner or "")
            if best is None and name in self.plan.inert_alone:
                skipped.setdefault(name, []).append(value)
                continue
            screen({**self.common, **(best[1] if best else {}), name: value})
        for name, values in skipped.items():
            self._note(f"{name}={','.join(values)} not screened: no value of {self._partner(name)} helped, and "
                       f"{self.plan.inert_alone[name]}")

    def _partner(self, name: str) -> str | None:
        tunable = CATALOGUE.get(name)
        partner = tunable.acts_with if tunable else None
        return partner if partner in self.plan.variables else None

    def _best_single(self, screened: list[tuple[Env, str, float | None]]) -> dict[str, tuple[float, Env]]:
        """Per variable: the best screened setting that helped and changes it alone, or it on top of
        its partner (acts_with), with what it sets beyond the common part."""
        best: dict[str, tuple[float, Env]] = {}
        for env, _label, gain in screened:
            extra = {k: v for k, v in env.items() if k not in self.common}
            if gain is None or gain <= 0 or not extra:
                continue
            own = [n for n in extra if len(extra) == 1 or self._partner(n) in extra]
            if len(own) != 1 or len(extra) > 2:
                continue
            if own[0] not in best or gain > best[own[0]][0]:
                best[own[0]] = (gain, extra)
        return best

    def _combine(self, screen: Callable[[Env], float | None],
                 screened: list[tuple[Env, str, float | None]]) -> None:
        """Greedy: start from the best single change, add the best value of each other helpful variable."""
        ranked = sorted(self._best_single(screened).items(), key=lambda kv: -kv[1][0])
        if len(ranked) < 2:
            return
        current = {**self.common, **ranked[0][1][1]}
        current_gain = ranked[0][1][0]
        for _name, (_gain, extra) in ranked[1: 1 + self.s.max_combine]:
            trial = {**current, **extra}
            if trial == current:
                continue
            gain = screen(trial)
            if gain is not None and gain > current_gain:
                current, current_gain = trial, gain

    def _finalists(self, screened: list[tuple[Env, str, float | None]]) -> list[Finalist]:
        out: list[Finalist] = []
        for env, label, _gain in rank_screened(screened, self.worst_pct, self.s.max_regression_pct,
                                               leave_out=self.common if self.common else None):
            if len(out) >= self.s.max_finalists:
                break
            if all(f.env != env for f in out):
                out.append(Finalist(env, label))
        if self.common:
            out.append(Finalist(dict(self.common), label_of(self.common, {})))
        return out
