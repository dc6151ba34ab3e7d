"""The sweep's choice and its report: what gets published, the rows per (collective, size), the summary line.

Reads the search's result and the trials (for which algorithm and protocol NCCL used); decides
nothing the selection has not decided (sweep/select.py judges, this module only shapes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..names import DEFAULTS_LABEL
from ..nccl.debuglog import SizeChoice, prevailing
from ..publish import (
    TOPO_FILE_VAR,
    TopologyPin,
    resolve_topology,
    topology_env,
)
from ..records import ReportRow, TrialResult
from ..sweep.plan import Plan
from ..sweep.select import Key, split_key
from ..sweep.strategy import Finalist, SearchResult, label_of
from ..trials.trialenv import TUNER_VARS, names_own_topology


@dataclass(frozen=True)
class Choice:
    """What a sweep publishes, in its two scopes (decided once, by split_scopes), and how it
    reports it."""

    chosen: Finalist | None
    label: str
    # What fits every job on the node: the policy values, nccltune's topology file (the marker
    # publish.OWN_TOPOLOGY, which the publisher names as the generation's own copy), the config's
    # pins (the operator pinned them for every job) and the tuner's plugin and table.
    every_job_env: dict[str, str]
    # The tuned variables the search chose: measured between this node's GPUs, so only for
    # jobs known to run on this one node.
    single_node_env: dict[str, str]
    rows: list[ReportRow]
    summary: str
    # The stable copy of the topology file (publish.topology_file): the name the run's record
    # gives nccltune's own topology file.
    topology_file: Path

    @property
    def uses_topology_file(self) -> bool:
        """The every-job part names nccltune's own topology file (the marker), which the publish
        writes into the generation; a topology file the config pins is the site's, published as
        its path and never replaced by nccltune's."""
        return names_own_topology(self.every_job_env)

    @property
    def recorded_every_job(self) -> dict[str, str]:
        """The every-job part as the run's record and an unpublished report show it."""
        return resolve_topology(self.every_job_env, self.topology_file)

    @property
    def env(self) -> dict[str, str]:
        """Both parts as the run's record shows them: what the sweep measured as a whole (and what
        a single-node job gets)."""
        return {**self.recorded_every_job, **self.single_node_env}


def choose(result: SearchResult, plan: Plan, topology_file: Path,
           trials: Iterable[tuple[Mapping[str, str], TrialResult]], demo: bool) -> Choice:
    """The published environment for the search's winner (NCCL's defaults when none won), split
    into its scopes; `topology_file` is the stable copy the run's record names."""
    chosen = result.chosen
    every_job, single_node = split_scopes(dict(chosen.env) if chosen else {}, plan)
    return Choice(
        chosen=chosen, label=chosen.label if chosen else DEFAULTS_LABEL,
        every_job_env=every_job, single_node_env=single_node,
        rows=report_rows(result, chosen, nccl_choices(trials)), summary=summarize(result, chosen, demo),
        topology_file=topology_file)


def split_scopes(chosen_env: Mapping[str, str], plan: Plan) -> tuple[dict[str, str], dict[str, str]]:
    """(every job, single-node jobs), decided once for the candidate as it was measured: nccltune's
    topology file (as the marker), the policy values, the config pins and the tuner's variables fit
    every job; the other chosen variables were tuned on this node alone."""
    # Whose topology file: publish.topology_env's one rule over the plan's pin (a config pin is
    # published as its path, the site's conf file left to NCCL); nccltune's own (the marker) only
    # where nothing pins one and the chosen candidate carries it.
    pinned = plan.pinned.get(TOPO_FILE_VAR)
    pin = TopologyPin(pinned.value, pinned.source) if pinned is not None else None
    every_job = topology_env(pin, own=TOPO_FILE_VAR in chosen_env)
    config_pins = {n: p.value for n, p in plan.pinned.items() if p.source == "config" and n != TOPO_FILE_VAR}
    every_job.update({**plan.policy, **config_pins})
    # The tuner's variables (the per-size stage's whole result): every job gets the plugin and its
    # table, whose entries apply only to the communicator shape they were measured for.
    every_job.update({n: v for n, v in chosen_env.items() if n in TUNER_VARS and n not in every_job})
    single_node = {n: v for n, v in chosen_env.items() if n not in every_job and n != TOPO_FILE_VAR}
    return every_job, single_node


def nccl_choices(trials: Iterable[tuple[Mapping[str, str], TrialResult]]) -> dict[str, dict[Key, SizeChoice]]:
    """Candidate label -> (collective, size) -> what NCCL used there over the candidate's good
    trials (the one rule of nccl.debuglog.prevailing decides when trials differ)."""
    seen: dict[str, dict[Key, list[SizeChoice]]] = {}
    for env, result in trials:
        if not result.ok:
            continue
        by_size = seen.setdefault(label_of(env), {})
        for m in result.sizes:
            if m.algo and m.proto:
                by_size.setdefault((m.collective, m.size_bytes), []).append(SizeChoice(m.algo, m.proto))
    out: dict[str, dict[Key, SizeChoice]] = {}
    for label, sizes in seen.items():
        for size, choices in sizes.items():
            got = prevailing(choices)
            if got is not None:
                out.setdefault(label, {})[size] = got
    return out


def report_rows(result: SearchResult, chosen: Finalist | None,
                choices: Mapping[str, Mapping[Key, SizeChoice]]) -> list[ReportRow]:
    """One row per (collective, size) of the baseline, collectives in the profile's order:
    defaults against the chosen setting (itself the defaults when nothing was chosen)."""
    rows = []
    tuned = chosen.stats if chosen else {}
    defaults = choices.get(label_of({}), {})
    chosen_choices = choices.get(label_of(chosen.env), {}) if chosen else defaults
    order = {c: i for i, c in enumerate(dict.fromkeys(split_key(k)[0] for k in result.weights))}
    for key, base in sorted(result.baseline.items(),
                            key=lambda kv: (order.get(split_key(kv[0])[0], len(order)), split_key(kv[0]))):
        collective, size = split_key(key)
        t = tuned.get(key)
        d_choice, t_choice = defaults.get(key), chosen_choices.get(key)
        rows.append(ReportRow(
            size_bytes=size, weight=result.weights.get(key, 0.0), collective=collective,
            default_busbw_gbps=round(base.median, 3), default_noise_pct=round(base.noise_pct, 2),
            tuned_busbw_gbps=round(t.median, 3) if t else round(base.median, 3),
            ratio=round(t.median / base.median, 4) if t and base.median > 0 else 1.0,
            default_algo_proto=d_choice.label if d_choice else None,
            tuned_algo_proto=t_choice.label if t_choice else None,
        ))
    return rows


def summarize(result: SearchResult, chosen: Finalist | None, demo: bool) -> str:
    """What is published and why, plus what the search noted about its own evidence (too few
    runs to support a claim, for example)."""
    prefix = "[CPU demo, not NCCL numbers] " if demo else ""
    notes = "".join(f" {note}" for note in result.notes)
    return prefix + _verdict_sentence(result, chosen) + notes


def _verdict_sentence(result: SearchResult, chosen: Finalist | None) -> str:
    if chosen is None:
        return "Nothing beat NCCL's defaults beyond the measured noise: publishing the defaults."
    v = chosen.verdict
    what = "NCCL's defaults with nccltune's topology file" if chosen is result.topo_only else chosen.label
    gain = (f"{v.gain_pct:+.2f}% (at least {v.lower_pct or 0.0:+.2f}% at {v.confidence_pct:.1f}% confidence from "
            f"{v.pairs} paired run(s); minimum {v.threshold_pct:.2f}%)") if v else ""
    return f"Publishing {what}: weighted gain {gain} over NCCL's defaults."
