"""The documented workflows played through nccltune's own metric writers over simulated time.

A `SimNode` keeps a real history (a `Store` on a simulated clock), publishes real sets and writes
its textfiles with `metrics.write_metrics_from_store`, as `nccltune sweep`, `nccltune verify`
(the history's file only) and the daemon (both files) do. `play` runs the events of a workflow,
lets each running daemon write at every scrape, reads back the two files at each step and turns
their samples into promtool's `input_series`; `promtool_test` writes the test file (rules and
expectations) and runs `promtool test rules` on it. Time starts at 0, as promtool's does.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from publishing import publish_set

from nccltune import __version__
from nccltune.metrics import DAEMON_FILENAME, FILENAME, LiveState, write_metrics_from_store
from nccltune.publish import Provenance
from nccltune.records import Measurement, ReportRow
from nccltune.store import Store

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "monitoring" / "prometheus" / "nccltune.rules.yml"
DAY = 86400.0
SIZE = 4096


class SimClock:
    """The simulated wall clock, in unix seconds from 0, shared by every node of a workflow."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> datetime:
        return datetime.fromtimestamp(self.t, timezone.utc)


@dataclass
class SimNode:
    name: str
    root: Path
    clock: SimClock
    node_class: str = "k"
    daemon: str | None = None  # None (no daemon), "running" (writes at every scrape), "stopped", "hung"
    store: Store = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.root / "history.db", clock=self.clock)

    @property
    def instance(self) -> str:
        return f"{self.name}:9100"

    @property
    def fingerprint(self) -> str:
        return f"fp-{self.name}"

    def _meta(self, nccl_version: str) -> dict[str, Any]:
        return dict(fingerprint=self.fingerprint, backend="gloo", demo=False, profile=None, nccl_version=nccl_version,
                    driver_version=None, torch_version=None, nccltune_version=__version__, hostname=self.name,
                    config={})

    def _provenance(self, nccl_version: str, class_profile: Mapping[str, str | int] | None = None) -> Provenance:
        return Provenance(nccltune_version=__version__, created_at=self.clock().isoformat(),
                          topology_fingerprint=self.fingerprint, nccl_version=nccl_version, backend="gloo",
                          demo=False, profile=None, class_profile=class_profile)

    def sweep(self, *, ok: bool = True, busbw_gbps: float = 0.4, nccl_version: str = "2.21.5",
              env: Mapping[str, str] | None = None) -> None:
        """A sweep of NCCL's defaults (one trial) that publishes `env` with the generation's topology copy."""
        run_id = self.store.start_run(kind="sweep", topology={"gpus": 2}, **self._meta(nccl_version))
        self.store.add_trial(run_id, seq=1, phase="baseline", label="defaults", env={}, status="ok",
                             measurements=[Measurement(SIZE, 4.0 / busbw_gbps, busbw_gbps, busbw_gbps)])
        if not ok:
            self.store.finish_run(run_id, status="failed", summary={"error": "failed"})
        else:
            got = publish_set(self.root / "published", dict(env or {"NCCL_ALGO": "Ring"}),
                              self._provenance(nccl_version), topology_xml="<system/>")
            row = {"size_bytes": SIZE, "default_busbw_gbps": busbw_gbps, "default_noise_pct": 3.0,
                   "tuned_busbw_gbps": busbw_gbps, "ratio": 1.0}
            self.store.finish_run(run_id, status="ok", chosen_env={}, published_generation=got.generation,
                                  summary={}, rows=[ReportRow.from_dict(row)])
        self.write_history()

    def apply_profile(self, sha256: str, env: Mapping[str, str]) -> None:
        """`nccltune apply` of a class profile: one generation naming its own topology copy."""
        profile = {"file": "class.json", "path": "/etc/nccltune/class.json", "sha256": sha256,
                   "class_id": self.node_class, "chosen": "tuned", "decided_at": "1970-01-01T00:00:00+00:00",
                   "nodes": 3}
        publish_set(self.root / "published", dict(env), self._provenance("2.21.5", profile), topology_xml="<system/>")
        self.write_history()

    def verify(self, *, passed: bool, drift: float = -0.01, allowed: float = 0.1, reference: str = "sweep",
               code: str | None = None) -> None:
        """A finished verify of the published setting at one size (drift: measured over expected - 1)."""
        run_id = self.store.start_run(kind="verify", topology={}, **self._meta("2.21.5"))
        row = {"size_bytes": SIZE, "allowed_pct": allowed * 100, "drift_pct": drift * 100,
               "measured_gbps": round(0.4 * (1 + drift), 6), "expected_gbps": 0.4}
        self.store.finish_run(run_id, status="ok" if passed else "failed",
                              summary={"reference": reference, "code": code or ("passed" if passed else "drift"),
                                       "rows": [row]})
        self.write_history()

    def write_history(self) -> None:
        """What a one-shot command writes after its run; the daemon writes both files at its poll."""
        if self.daemon != "running":
            self.write(live=None)

    def write(self, live: LiveState | None) -> None:
        write_metrics_from_store(self.root / "metrics", self.store, fingerprint=self.fingerprint,
                                 node_class=self.node_class, live=live, publish_dir=self.root / "published")

    def poll(self, state: str = "idle") -> None:
        self.write(LiveState(state=state, busy_processes=0, heartbeat_ts=self.clock.t, doctor={}))

    def stop(self) -> None:
        """A planned stop: the daemon's last write says "stopped" (daemon/service.py)."""
        self.poll("stopped")
        self.daemon = "stopped"

    def samples(self) -> dict[str, float]:
        """The series in the node's textfiles now, each as promtool names it, with the scrape's labels."""
        out: dict[str, float] = {}
        for name in (FILENAME, DAEMON_FILENAME):
            path = self.root / "metrics" / name
            if not path.exists():
                continue
            for name, sample_labels, value in _parsed(path.read_text()):
                labels = {**sample_labels, "instance": self.instance, "job": "node"}
                text = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                out[f"{name}{{{text}}}"] = value
        return out


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> tuple[tuple[str, dict[str, str], float], ...]:
    """A textfile's samples as (name, labels, value), parsed once per text: a file no event
    changed reads the same at every scrape (callers copy the labels, never change them)."""
    return tuple((s.name, s.labels, float(s.value)) for fam in text_string_to_metric_families(text)
                 for s in fam.samples)


Event = tuple[float, Callable[[], None]]


def play(clock: SimClock, nodes: Sequence[SimNode], events: Iterable[Event], *, end_s: float,
         interval_s: float) -> list[dict[str, str]]:
    """Run the events in time order; at every scrape (each `interval_s`) each running daemon polls
    first, then the files are read. Returns promtool's input_series."""
    pending = sorted(events, key=lambda e: e[0])
    steps = int(end_s // interval_s) + 1
    seen: dict[str, list[float | None]] = {}
    for k in range(steps):
        t = k * interval_s
        while pending and pending[0][0] <= t:
            clock.t, action = pending.pop(0)
            action()
        clock.t = t
        for node in nodes:
            if node.daemon == "running":
                node.poll()
        for node in nodes:
            for key, value in node.samples().items():
                seen.setdefault(key, [None] * steps)[k] = value
    return [{"series": key, "values": _values(vals)} for key, vals in sorted(seen.items())]


def _values(vals: list[float | None]) -> str:
    """promtool's notation: runs of one value as `vxN` (N+1 samples), missing samples as `_`."""
    parts: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[i]:
            j += 1
        run = j - i + 1
        if vals[i] is None:
            parts.extend(["_"] * run)
        else:
            text = f"{vals[i]:.17g}"
            parts.append(text if run == 1 else f"{text}x{run - 1}")
        i = j + 1
    return " ".join(parts)


def alert_names() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return sorted(r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r)


def only(eval_s: float, firing: Mapping[str, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Expectations at one time: the alerts of `firing` with those alerts, every other shipped alert silent."""
    firing = firing or {}
    assert set(firing) <= set(alert_names()), firing
    return [{"eval_time": f"{int(eval_s)}s", "alertname": name, "exp_alerts": firing.get(name, [])}
            for name in alert_names()]


def promtool_test(promtool: Path, tmp: Path, input_series: list[dict[str, str]], interval_s: float,
                  expectations: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    doc = {"rule_files": [str(RULES)], "evaluation_interval": f"{int(interval_s)}s",
           "tests": [{"interval": f"{int(interval_s)}s", "input_series": input_series,
                      "alert_rule_test": expectations}]}
    path = tmp / "workflow.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=1 << 16))
    return subprocess.run([str(promtool), "test", "rules", str(path)], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
