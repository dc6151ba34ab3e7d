"""The sweep, as a pipeline of stages (stages.py: load the node, check it is idle, plan, run the
trials, choose, publish, report), with what the stages share: planning.py (config + node ->
plan, search settings, workload, estimates), tablestage.py (the per-size stage and the tuner
table), choice.py (the search's result -> what is published and the report rows); the tuning
fingerprint it re-exports is publish/tuning.py's. Used by `nccltune sweep` and by the daemon.
"""

from __future__ import annotations

from .stages import (
    POLICY_VAR,
    UNMEASURED_SUMMARY,
    Node,
    ProgressFn,
    SweepPipeline,
    SweepReport,
    load_node,
    probe_nccl,
    run_topology,
    tuning_fingerprint,
)

__all__ = [
    "POLICY_VAR", "UNMEASURED_SUMMARY", "Node", "ProgressFn", "SweepPipeline", "SweepReport", "load_node",
    "probe_nccl", "run_topology", "tuning_fingerprint",
]
