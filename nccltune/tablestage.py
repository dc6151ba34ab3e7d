"""The sweep's per-size stage: the per-size candidates, the tuner table, and the final check of the whole
result (environment plus table) against NCCL's defaults.

Runs after the whole-environment search has screened its settings (planning.settings gives it no
finalist round when the table is active) and before the choice is published:

1. The defaults' channel count comes from the baseline's NCCL log; the channel candidates are half
   and double it (sweep.pertable.channel_candidates).
2. Each per-size candidate is one environment trial over every size (NCCL_ALGO/NCCL_PROTO, or
   NCCL_MIN/MAX_NCHANNELS), judged per size against the defaults (sweep.pertable.choose_per_size).
3. The table is rendered for this node's shape and the plugin built into the run's directory
   (tuner.build.build_plugin). Without a compiler the table is not active and the environment-only
   choice stands; on the CPU demo the table is computed and shown but never loaded (gloo), so the
   final check measures the environment part only and nothing from the table is claimed.
4. The final check: the whole result (best screened environment + the single-node channel variable +
   NCCL_TUNER_PLUGIN/NCCLTUNE_TUNER_TABLE/NCCLTUNE_TUNER_FINGERPRINT) and the environment part alone,
   interleaved with runs of the defaults, sweep.finalist_repeats times each, judged with
   sweep.select.judge over the profile's sizes (faster on the score, no size slower beyond noise).
   The whole result wins when eligible and better; else the environment part when eligible; else
   the defaults.

What must be published comes back as a TablePublication; the pipeline's publish stage decides how.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config
from .nccl.debuglog import SizeChoice, prevailing
from .publish import atomic_write
from .records import TrialResult
from .store import Phase
from .sweep.pertable import (
    Measured,
    PerSizeChoice,
    Seen,
    Span,
    channel_candidates,
    choose_per_size,
    spans,
    to_table,
)
from .sweep.plan import Plan
from .sweep.select import Key, judge, size_stats
from .sweep.strategy import Finalist, SearchResult, label_of
from .trials.session import TrialSession
from .tuner.build import BuildResult, build_plugin
from .tuner.table import TunerTable, render_table

log = logging.getLogger(__name__)

TABLE_NAME = "tuner-table.txt"
TABLE_ENV = "NCCLTUNE_TUNER_TABLE"
FINGERPRINT_ENV = "NCCLTUNE_TUNER_FINGERPRINT"
PLUGIN_ENV = "NCCL_TUNER_PLUGIN"
DEMO_STATUS = "not measured with NCCL: CPU demo"
WHOLE_LABEL = "environment + tuner table"


def tuner_env(plugin: Path, table: Path, fingerprint: str) -> dict[str, str]:
    """The variables that make NCCL load nccltune's plugin and the plugin read this table."""
    return {PLUGIN_ENV: str(plugin), TABLE_ENV: str(table), FINGERPRINT_ENV: fingerprint}


@dataclass(frozen=True)
class TablePublication:
    """What the per-size stage asks to publish.

    every_job_env names the plugin and table as they lie in the run's directory (as the final check
    ran them); publish() writes the generation's own copies and names those (pipeline._Sweep._publish)."""

    table_text: str
    plugin_path: Path
    fingerprint: str
    every_job_env: dict[str, str]
    single_node_env: dict[str, str]  # measured on one node: for single-node jobs only


@dataclass
class TableOutcome:
    """The per-size stage's result, for the choice, the report and the store."""

    status: str  # "active", "active, no entries: ...", "per-size tuner table not active: <reason>" or DEMO_STATUS
    choice: PerSizeChoice | None = None
    table: TunerTable | None = None
    table_text: str | None = None
    table_path: Path | None = None  # the run directory's copy
    spans: list[Span] = field(default_factory=list)
    build: BuildResult | None = None
    default_channels: int | None = None
    chosen: Finalist | None = None  # what the final check found best (None: the defaults)
    whole: Finalist | None = None
    env_only: Finalist | None = None
    publication: TablePublication | None = None  # None: nothing of the table is published
    notes: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.publication is not None

    def as_dict(self) -> dict[str, object]:
        """For --json and the run's summary."""
        return {
            "status": self.status,
            "table_path": str(self.table_path) if self.table_path else None,
            "plugin": str(self.build.path) if self.build and self.build.path else None,
            "default_channels": self.default_channels,
            "entries": [{"min_bytes": s.min_bytes, "max_bytes": s.max_bytes, "sizes": list(s.sizes),
                         "algo": s.cell.algo, "proto": s.cell.proto, "channels": s.cell.channels}
                        for s in self.spans],
            "single_node_env": dict(self.choice.single_node_env) if self.choice else {},
            "published": self.active,
            "final": {f.label: f.verdict.reason for f in (self.whole, self.env_only) if f and f.verdict},
            "notes": list(self.notes),
        }


TABLE_COLLECTIVE = "all_reduce"


def _all_reduce(by_key: Mapping[Key, float]) -> dict[int, float]:
    """The all-reduce sizes of a trial's busbw, keyed by size as the per-size choice takes them."""
    return {size: bw for (collective, size), bw in by_key.items() if collective == TABLE_COLLECTIVE}


class TableStage:
    """One sweep's per-size stage (see the module docstring)."""

    def __init__(self, cfg: Config, plan: Plan, session: TrialSession, *, work_dir: Path, common: Mapping[str, str],
                 nranks: int, fingerprint: str, demo: bool) -> None:
        self.cfg, self.plan, self.session = cfg, plan, session
        self.work_dir, self.common, self.nranks = work_dir, dict(common), nranks
        self.fingerprint, self.demo = fingerprint, demo

    def _trial(self, env: Mapping[str, str], phase: Phase, label: str) -> TrialResult | None:
        result = self.session.trial(env, phase, label)
        if not result.ok:
            log.warning("trial %d (%s) failed: %s", self.session.seq, label, result.reason)
            return None
        return result

    def run(self, result: SearchResult) -> TableOutcome:
        ps = self.plan.per_size
        if ps is None or not ps.active:
            return TableOutcome(ps.inactive_text if ps else "per-size tuner table not active: not planned")
        default_channels = self._default_channels()
        candidates = list(ps.candidates) + (channel_candidates(default_channels) if ps.channels else [])
        measured: list[Measured] = []
        for cand in candidates:
            got = self._trial({**self.common, **cand.env()}, "screen", f"per size: {cand.label}")
            if got is not None:
                measured.append(Measured(cand, size_stats([_all_reduce(got.busbw_by_key())]), _used(got)))
        # The table holds all-reduce entries: a choice per collective is a later step.
        baseline = {size: st for (collective, size), st in result.baseline.items() if collective == TABLE_COLLECTIVE}
        choice = choose_per_size(baseline, measured, default_used=self._default_used(),
                                 default_channels=default_channels, min_gain_pct=self.cfg.sweep.min_gain_pct,
                                 max_regression_pct=self.cfg.sweep.max_regression_pct)
        table = to_table(choice, fingerprint=self.fingerprint, nranks=self.nranks)
        text = render_table(table)
        table_path = self.work_dir / TABLE_NAME
        atomic_write(table_path, text)
        out = TableOutcome("active", choice, table, text, table_path, spans(choice), default_channels=default_channels,
                           notes=list(choice.notes))
        env_part = self._env_part(result)
        if self.cfg.sweep.finalist_repeats < 2:
            out.notes.append(f"sweep.finalist_repeats is {self.cfg.sweep.finalist_repeats}: the final check cannot "
                             "show a gain beyond noise with one run, so only NCCL's defaults can be published")
        if self.demo:
            out.status = DEMO_STATUS
            out.notes.append("the table is computed from gloo trials and never loaded: nothing from it is "
                             "claimed as a gain")
            out.env_only = self._final(result, [Finalist(env_part, label_of(env_part))])[0]
            out.chosen = _pick(None, out.env_only)
            return out
        if not table.entries and not choice.single_node_env:
            out.status = "active, no entries: NCCL's defaults won at every size"
            out.env_only = self._final(result, [Finalist(env_part, label_of(env_part))])[0]
            out.chosen = _pick(None, out.env_only)
            return out
        out.build = build_plugin(self.work_dir)
        if not out.build.ok or out.build.path is None:
            out.status = out.build.message
            out.env_only = self._final(result, [Finalist(env_part, label_of(env_part))])[0]
            out.chosen = _pick(None, out.env_only)
            return out
        every_job = tuner_env(out.build.path, table_path, self.fingerprint)
        whole_env = {**env_part, **choice.single_node_env, **every_job}
        whole = Finalist(whole_env, WHOLE_LABEL)
        env_only = Finalist(env_part, label_of(env_part))
        whole, env_only = self._final(result, [whole, env_only])
        out.whole, out.env_only = whole, env_only
        out.chosen = _pick(whole, env_only)
        if out.chosen is whole:
            out.publication = TablePublication(text, out.build.path, self.fingerprint, every_job,
                                               dict(choice.single_node_env))
        else:
            reason = whole.verdict.reason if whole.verdict else "no result"
            out.notes.append(f"the whole result (environment + table) was not published: {reason}")
        return out

    def _final(self, result: SearchResult, finalists: list[Finalist]) -> list[Finalist]:
        """The final check: the finalists and the defaults, round-robin, judged over the profile."""
        base_runs = list(result.baseline_runs)
        repeats = self.cfg.sweep.finalist_repeats
        for r in range(repeats):
            for f in finalists:
                got = self._trial(f.env, "final", f"{f.label} #{r + 1}")
                if got is not None:
                    f.runs.append(got.busbw_by_key())
            got = self._trial({}, "baseline", f"defaults (final check) #{r + 1}")
            if got is not None:
                base_runs.append(got.busbw_by_key())
        baseline = size_stats(base_runs)
        for f in finalists:
            if f.runs:
                f.stats = size_stats(f.runs)
                f.verdict = judge(f.stats, baseline, result.weights, min_gain_pct=self.cfg.sweep.min_gain_pct,
                                  max_regression_pct=self.cfg.sweep.max_regression_pct,
                                  # The topology file alone needs only to be no slower, as in the search.
                                  require_gain=bool(set(f.env) - {"NCCL_TOPO_FILE", *self.plan.policy}))
        return finalists

    def _default_channels(self) -> int | None:
        """The channel count NCCL's defaults used (the first good baseline trial's NCCL log)."""
        for env, r in self.session.results:
            if not env and r.ok and r.nccl.get("coll_channels"):
                return int(r.nccl["coll_channels"])
        return None

    def _default_used(self) -> dict[int, Seen]:
        """What the defaults used per size over their good trials (debuglog.prevailing decides)."""
        seen: dict[int, list[SizeChoice]] = {}
        for env, r in self.session.results:
            if not env and r.ok:
                for m in r.sizes:
                    if m.algo and m.proto:
                        seen.setdefault(m.size_bytes, []).append(SizeChoice(m.algo, m.proto, m.channels))
        out = {}
        for size, choices in seen.items():
            got = prevailing(choices)
            cell = _seen(got.algo, got.proto, got.channels) if got else None
            if cell is not None:
                out[size] = cell
        return out

    def _env_part(self, result: SearchResult) -> dict[str, str]:
        """The whole-environment search's best screened setting (with the topology file and policy)."""
        ranked = [s for s in result.screened if s[2] is not None and s[2] > 0 and s[0] != self.common]
        best = max(ranked, key=lambda s: s[2] or 0.0, default=None)
        return dict(best[0]) if best else dict(self.common)


# NCCL's log names (any case) -> the table's spelling.
_LOG_ALGOS = {"ring": "ring", "tree": "tree", "nvls": "nvls", "pat": "pat", "nvlstree": "nvls_tree",
              "collnetdirect": "collnet_direct", "collnetchain": "collnet_chain"}
_LOG_PROTOS = {"ll": "ll", "ll128": "ll128", "simple": "simple"}


def _seen(algo: str, proto: str, channels: int | None) -> Seen | None:
    a, p = _LOG_ALGOS.get(algo.lower().replace("_", "")), _LOG_PROTOS.get(proto.lower())
    return Seen(a, p, channels) if a and p else None


def _used(result: TrialResult) -> dict[int, Seen]:
    """What NCCL's log showed per size, in the table's spelling (RING/LL128 -> ring/ll128)."""
    out = {}
    for m in result.sizes:
        if m.collective != TABLE_COLLECTIVE:
            continue
        cell = _seen(m.algo, m.proto, m.channels) if m.algo and m.proto else None
        if cell is not None:
            out[m.size_bytes] = cell
    return out


def _pick(whole: Finalist | None, env_only: Finalist | None) -> Finalist | None:
    """The better eligible one (the whole result on a tie), or None for the defaults."""
    ok = [f for f in (whole, env_only) if f is not None and f.verdict is not None and f.verdict.eligible]
    if not ok:
        return None
    return max(ok, key=lambda f: (f.verdict.gain_pct if f.verdict else 0.0, f is whole))

