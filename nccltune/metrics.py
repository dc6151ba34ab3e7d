"""node_exporter textfile metrics (`<metrics_dir>/nccltune.prom`), written atomically.

Names carry the `nccltune_` prefix and base units (bytes per second, seconds, ratios).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .publish import atomic_write

FILENAME = "nccltune.prom"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in sorted(labels.items())) + "}"


def _value(value: float | None) -> str:
    """A sample value as the text format spells it: NaN, +Inf and -Inf (Python writes inf)."""
    if value is None or math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


@dataclass
class MetricsState:
    """What the daemon (or a one-shot command) knows; rendered as one textfile."""

    fingerprint: str | None = None
    gpus: int = 0
    driver_version: str | None = None
    nccl_version: str | None = None
    demo: bool = False
    degraded: bool = False
    last_sweep_ts: float | None = None
    last_sweep_duration_s: float | None = None
    last_sweep_success: bool | None = None
    published_generation: int | None = None
    busbw: dict[tuple[int, str], float] = field(default_factory=dict)  # (size, "default"|"published") -> GB/s
    last_verify_ts: float | None = None
    last_verify_success: bool | None = None
    verify_drift: dict[int, float] = field(default_factory=dict)  # size -> ratio measured/expected - 1
    doctor: dict[str, int] = field(default_factory=dict)  # severity -> count
    sweeps_total: int = 0
    topology_changes_total: int = 0


def render(state: MetricsState) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str,
               samples: Sequence[tuple[Mapping[str, str], float | None]]) -> None:
        if not samples:
            return
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{_labels(labels)} {_value(value)}")

    metric("nccltune_build_info", "gauge", "nccltune version (always 1)", [({"version": __version__}, 1)])
    metric("nccltune_topology_info", "gauge", "topology of this node (always 1)",
           [({"fingerprint": state.fingerprint or "", "gpus": str(state.gpus),
              "driver_version": state.driver_version or "", "nccl_version": state.nccl_version or "",
              "demo": "1" if state.demo else "0"}, 1)])
    metric("nccltune_degraded", "gauge", "1 when NVML failed or a GPU is lost; the last safe files are kept",
           [({}, 1.0 if state.degraded else 0.0)])
    if state.last_sweep_ts is not None:
        metric("nccltune_last_sweep_timestamp_seconds", "gauge", "end of the last sweep (unix time)",
               [({}, state.last_sweep_ts)])
    if state.last_sweep_duration_s is not None:
        metric("nccltune_last_sweep_duration_seconds", "gauge", "wall time of the last sweep",
               [({}, state.last_sweep_duration_s)])
    if state.last_sweep_success is not None:
        metric("nccltune_last_sweep_success", "gauge", "1 if the last sweep published, else 0",
               [({}, 1.0 if state.last_sweep_success else 0.0)])
    if state.published_generation is not None:
        metric("nccltune_published_generation", "gauge", "generation of the published environment",
               [({}, state.published_generation)])
    metric("nccltune_busbw_bytes_per_second", "gauge", "all-reduce bus bandwidth measured by the last sweep",
           [({"size_bytes": str(s), "setting": which}, bw * 1e9) for (s, which), bw in sorted(state.busbw.items())])
    ratios = []
    for (s, which), bw in sorted(state.busbw.items()):
        base = state.busbw.get((s, "default"))
        if which == "published" and base:
            ratios.append(({"size_bytes": str(s)}, bw / base))
    metric("nccltune_tuned_ratio", "gauge", "published over default bus bandwidth", ratios)
    if state.last_verify_ts is not None:
        metric("nccltune_last_verify_timestamp_seconds", "gauge", "end of the last verify (unix time)",
               [({}, state.last_verify_ts)])
    if state.last_verify_success is not None:
        metric("nccltune_last_verify_success", "gauge", "1 if the last verify passed",
               [({}, 1.0 if state.last_verify_success else 0.0)])
    metric("nccltune_verify_drift_ratio", "gauge", "last verify: measured over expected bus bandwidth, minus 1",
           [({"size_bytes": str(s)}, d) for s, d in sorted(state.verify_drift.items())])
    metric("nccltune_doctor_findings", "gauge", "doctor findings by severity",
           [({"severity": sev}, float(state.doctor.get(sev, 0))) for sev in ("error", "warning", "info")])
    metric("nccltune_sweeps_total", "counter", "sweeps started by this process", [({}, state.sweeps_total)])
    metric("nccltune_topology_changes_total", "counter", "fingerprint changes seen by this process",
           [({}, state.topology_changes_total)])
    return "\n".join(lines) + "\n"


def write_metrics(directory: Path, state: MetricsState) -> Path:
    path = directory / FILENAME
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(path, render(state))
    return path
