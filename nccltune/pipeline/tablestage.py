"""The sweep's per-size stage: the per-size candidates, the tuner table, and the final check of the whole
result (environment plus table) against NCCL's defaults.

Runs after the whole-environment search has screened its settings (planning.settings gives it no
finalist round when the table is active) and before the choice is published:

1. The defaults' channel count comes from the baseline's NCCL log; the channel candidates are half
   of it and a third more (sweep.pertable.channel_candidates).
2. Each per-size candidate is one environment trial over every size of every measured collective
   (NCCL_ALGO/NCCL_PROTO, or NCCL_MIN/MAX_NCHANNELS), judged per collective and size against the
   defaults, for the collectives it applies to (sweep.pertable.choose_table: one channel raise
   shared by all of them).
3. The table, with entries per collective, is rendered for this node's shape and the plugin built
   into the run's directory
   (tuner.build.build_plugin). Without a compiler the table is not active and the environment-only
   choice stands; on the CPU demo the table is computed and shown but never loaded (gloo), so the
   final check measures the environment part only and nothing from the table is claimed.
4. The final check: the whole result (best screened environment + the single-node channel variable +
   NCCL_TUNER_PLUGIN/NCCLTUNE_TUNER_TABLE/NCCLTUNE_TUNER_FINGERPRINT) and the environment part alone,
   interleaved with runs of the defaults, sweep.finalist_repeats times each, judged with
   sweep.select.judge over the profile's collectives and sizes (faster on the score, no collective
   slower beyond noise at any size it weighs: a table that speeds all-reduce but slows all-gather
   is not published under fsdp).
   The whole result wins when eligible and better; else the environment part when eligible; else
   the defaults.

What must be published comes back as a TablePublication; the pipeline's publish stage decides how.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..publish import atomic_write
from ..records import Measurement, TrialResult
from ..store import Phase
from ..sweep import decision
from ..sweep.pertable import (
    TRIAL_LABEL,
    SizeCandidate,
    Span,
    TableChoice,
    channel_candidates,
    choose_table,
    nccl_name,
    spans,
    table_inputs,
    to_table,
)
from ..sweep.plan import Plan
from ..sweep.select import Key
from ..sweep.strategy import (
    FinalCheck,
    Finalist,
    SearchResult,
    final_check,
    label_of,
    rank_screened,
    round_measure,
)
from ..trials.session import TrialSession
from ..tuner.build import BuildResult, build_plugin
from ..tuner.table import TunerTable, nccl_version_code, render_table

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
    """What the per-size stage asks to publish: the table and the plugin as the final check ran them
    from the run's directory; the publish writes the generation's own copies and names those (the
    variables' scopes come with the choice, choice.split_scopes)."""

    table_text: str
    plugin_path: Path
    fingerprint: str


@dataclass
class TableOutcome:
    """The per-size stage's result, for the choice, the report and the store."""

    status: str  # "active", "active, no entries: ...", "per-size tuner table not active: <reason>" or DEMO_STATUS
    choice: TableChoice | None = None
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
    final: FinalCheck = field(default_factory=FinalCheck)  # the final check, as it ran

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
            "entries": [{"collective": nccl_name(s.collective), "min_bytes": s.min_bytes, "max_bytes": s.max_bytes,
                         "sizes": list(s.sizes), "algo": s.cell.algo, "proto": s.cell.proto,
                         "channels": s.cell.channels}
                        for s in self.spans],
            "single_node_env": dict(self.choice.single_node_env) if self.choice else {},
            "published": self.active,
            "final": {f.label: f.verdict.reason for f in (self.whole, self.env_only) if f and f.verdict},
            "notes": list(self.notes),
        }


class TableStage:
    """One sweep's per-size stage (see the module docstring)."""

    def __init__(self, cfg: Config, plan: Plan, session: TrialSession, *, work_dir: Path, common: Mapping[str, str],
                 nranks: int, fingerprint: str, demo: bool, nnodes: int = 1) -> None:
        """`nranks`, `nnodes`: the communicator the trials form (the job shape's, over several nodes)."""
        self.cfg, self.plan, self.session = cfg, plan, session
        self.work_dir, self.common, self.nranks, self.nnodes = work_dir, dict(common), nranks, nnodes
        self.fingerprint, self.demo = fingerprint, demo
        # Every run of NCCL's defaults once the final check ran (the search's and the check's):
        # the defaults' medians the choice judged are those the report and the store show.
        self.baseline_runs: list[dict[Key, float]] | None = None
        self.final = FinalCheck()

    def _trial(self, env: Mapping[str, str], phase: Phase, label: str) -> TrialResult | None:
        result = self.session.trial(env, phase, label)
        if not result.ok:
            log.warning("trial %d (%s) failed: %s", self.session.seq, label, result.reason)
            return None
        return result

    def _busbw(self, env: Mapping[str, str], phase: Phase, label: str) -> dict[Key, float] | None:
        got = self._trial(env, phase, label)
        return None if got is None else got.busbw_by_key()

    def run(self, result: SearchResult) -> TableOutcome:
        ps = self.plan.per_size
        if ps is None or not ps.active:
            return TableOutcome(ps.inactive_text if ps else "per-size tuner table not active: not planned")
        default_channels = self._default_channels()
        candidates = list(ps.candidates) + (channel_candidates(default_channels) if ps.channels else [])
        measured: list[tuple[SizeCandidate, list[list[Measurement]]]] = []
        for cand in candidates:
            got = self._trial({**self.common, **cand.env()}, "screen", f"{TRIAL_LABEL}{cand.label}")
            if got is not None:
                measured.append((cand, [got.sizes]))
        # Every steered collective from its own numbers in the same trials, and what NCCL's log
        # showed the defaults used (their good trials).
        defaults = [r.sizes for env, r in self.session.results if not env and r.ok]
        inputs = table_inputs(ps.collectives, result.baseline, measured, defaults)
        choice = choose_table(inputs, default_channels=default_channels, min_gain_pct=self.cfg.sweep.min_gain_pct,
                              max_regression_pct=self.cfg.sweep.max_regression_pct)
        # The table is keyed by the NCCL the trials ran. Gloo (the demo) runs none: its table, never
        # loaded, is shown as spans and has no file.
        nccl = self.session.nccl_version or ""
        keyed = nccl_version_code(nccl) is not None
        if not keyed and not self.demo:
            return TableOutcome(f"per-size tuner table not active: the trials' NCCL version is unknown ({nccl!r}), "
                                "and a table applies only to the version it was measured with")
        table = to_table(choice, fingerprint=self.fingerprint, nranks=self.nranks, nnodes=self.nnodes, nccl=nccl)
        text = render_table(table) if keyed else None
        table_path = self.work_dir / TABLE_NAME if text is not None else None
        if table_path is not None and text is not None:
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
            if text is None:
                out.notes.append("the table has no file: gloo ran no NCCL, so there is no NCCL version to key it by")
            out.env_only = self._final(result, [Finalist(env_part, label_of(env_part))])[0]
            out.chosen = _pick(None, out.env_only)
            return out
        if self.nnodes > 1:
            # The other nodes never load a library or table the coordinator names (the control
            # channel refuses such variables): the job shape's table is decided from these per-size
            # trials by `fleet decide`, and the final check measures the environment part alone.
            out.status = (f"active for {self.nnodes} nodes: the table goes into a class profile (nccltune export, "
                          "nccltune fleet decide)")
            out.env_only = self._final(result, [Finalist(env_part, label_of(env_part))])[0]
            out.chosen = _pick(None, out.env_only)
            return out
        assert text is not None and table_path is not None  # keyed: only the demo has no NCCL version
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
        out.whole, out.env_only, out.final = whole, env_only, self.final
        out.chosen = _pick(whole, env_only)
        if out.chosen is whole:
            out.publication = TablePublication(text, out.build.path, self.fingerprint)
        else:
            reason = whole.verdict.reason if whole.verdict else "no result"
            out.notes.append(f"the whole result (environment + table) was not published: {reason}")
        return out

    def _final(self, result: SearchResult, finalists: list[Finalist]) -> list[Finalist]:
        """The final check: the finalists and the defaults in interleaved rounds, judged over the
        profile by the one decision rule, rounds added while a finalist is undecided
        (sweep.strategy.final_check)."""
        base_runs = list(result.baseline_runs)
        measure = round_measure(self._busbw, base_runs, lambda r: f"defaults (final check) #{r + 1}")
        s = self.cfg.sweep
        self.final = final_check(finalists, measure, result.weights,
                                 decision.Rule(s.min_gain_pct, s.max_regression_pct),
                                 first=s.finalist_repeats, last=s.max_finalist_repeats,
                                 max_trials=s.max_final_trials)
        self.baseline_runs = base_runs
        return finalists

    def _default_channels(self) -> int | None:
        """The channel count NCCL's defaults used (the first good baseline trial's NCCL log)."""
        for env, r in self.session.results:
            if not env and r.ok and r.nccl.get("coll_channels"):
                return int(r.nccl["coll_channels"])
        return None

    def _env_part(self, result: SearchResult) -> dict[str, str]:
        """The whole-environment search's best screened setting (with the topology file and policy)."""
        ranked = rank_screened(result.screened, result.screen_worst_pct, self.cfg.sweep.max_regression_pct,
                               leave_out=self.common)
        return dict(ranked[0][0]) if ranked else dict(self.common)


def _pick(whole: Finalist | None, env_only: Finalist | None) -> Finalist | None:
    """The better eligible one (the whole result on a tie), or None for the defaults."""
    ok = [f for f in (whole, env_only) if f is not None and f.verdict is not None and f.verdict.eligible]
    if not ok:
        return None
    return max(ok, key=lambda f: (f.verdict.gain_pct if f.verdict else 0.0, f is whole))

