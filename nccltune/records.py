"""The measurement records: what a trial measured, how it ended, and what a report shows per size.

The runner produces them, the store keeps them, the selection reads them and the reports render
them, so that one per-size fact keeps one shape from the worker's JSON line to the published
files. Standard library only: every layer may import this module, and it imports none of them.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Backend = Literal["nccl", "gloo"]
TrialStatus = Literal["ok", "failed", "timeout", "crashed", "wrong_result", "error"]
BACKENDS: frozenset[str] = frozenset(typing.get_args(Backend))
TRIAL_STATUSES: frozenset[str] = frozenset(typing.get_args(TrialStatus))

# The collective every record measures unless it says otherwise (the name torch and the worker use).
ALL_REDUCE = "all_reduce"


def backend_of(name: str) -> Backend:
    """`name` as a Backend; anything but gloo measures NCCL.

    Raises:
        ValueError: neither nccl nor gloo.
    """
    if name == "gloo":
        return "gloo"
    if name == "nccl":
        return "nccl"
    raise ValueError(f"backend must be nccl or gloo; got {name!r}")


# A measurement's document keys, in the order every document and the store's columns list them.
MEASUREMENT_KEYS = ("size_bytes", "collective", "time_us", "gpu_time_us", "algbw_gbps", "busbw_gbps",
                    "correct", "algo", "proto", "channels")


@dataclass(frozen=True)
class Measurement:
    """One message size of one trial, as the worker (or all_reduce_perf) reported it, with the
    algorithm, protocol and channel count NCCL logged for that size where its log was read."""

    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    algo: str | None = None
    proto: str | None = None
    correct: bool = True
    channels: int | None = None
    gpu_time_us: float | None = None  # CUDA-event time beside the host-clock time, where both exist
    collective: str = ALL_REDUCE

    def to_doc(self) -> dict[str, Any]:
        """The measurement as every document and row carries it (the store's row, an export's
        measurement, history's row): `size_bytes` and `collective` first, every field present."""
        return {key: getattr(self, key) for key in MEASUREMENT_KEYS}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Measurement:
        """A measurement from its document: `to_doc`'s, a store row, or the worker's `size` line
        (which names no algorithm, protocol or channels). Other keys are ignored; a missing
        collective is all_reduce (what older exports and histories measured), missing optional
        fields are None, a missing `correct` is not accepted.

        Raises:
            KeyError: a required field is missing.
            TypeError, ValueError: a field is not of its type (a number, a boolean, a name).
        """
        def number(key: str) -> float:
            value = doc[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{key} must be a number; got {value!r}")
            return float(value)

        def optional(key: str, kind: type) -> Any:
            value = doc.get(key)
            if value is None:
                return None
            if kind is float:
                return number(key)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"{key} must be {kind.__name__} or null; got {value!r}")
            return value

        size = doc["size_bytes"]
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size_bytes must be an integer; got {size!r}")
        correct = doc["correct"]
        if correct not in (True, False):  # SQLite keeps it as 0/1
            raise TypeError(f"correct must be a boolean; got {correct!r}")
        collective = doc.get("collective") or ALL_REDUCE
        if not isinstance(collective, str):
            raise TypeError(f"collective must be a name; got {collective!r}")
        return cls(
            size_bytes=size, time_us=number("time_us"), algbw_gbps=number("algbw_gbps"),
            busbw_gbps=number("busbw_gbps"), algo=optional("algo", str), proto=optional("proto", str),
            correct=bool(correct), channels=optional("channels", int), gpu_time_us=optional("gpu_time_us", float),
            collective=collective,
        )


@dataclass
class TrialResult:
    """How one trial ended: its status and reason, what each size measured, the worker's start
    record (versions, timing method) and the digest of NCCL's log (`nccl`)."""

    status: TrialStatus
    reason: str | None
    sizes: list[Measurement]
    wall_s: float
    start: dict[str, Any] = field(default_factory=dict)
    nccl: dict[str, Any] = field(default_factory=dict)
    log_dir: str | None = None
    # collective -> why this backend could not measure it (e.g. gloo's one-rank send to itself)
    not_measured: dict[str, str] = field(default_factory=dict)
    # the job shape and node class the trial ran as (trials.launch.Launch.record)
    shape: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def busbw(self) -> dict[int, float]:
        """busbw per size; for a trial of one collective (a trial of several: `busbw_by_key`)."""
        return {s.size_bytes: s.busbw_gbps for s in self.sizes}

    def busbw_by_key(self) -> dict[tuple[str, int], float]:
        """busbw per (collective, size): what the selection compares."""
        return {(s.collective, s.size_bytes): s.busbw_gbps for s in self.sizes}

    @property
    def nccl_version(self) -> str | None:
        """As the worker reported it at start, else as NCCL's log said."""
        got = self.start.get("nccl_version") or self.nccl.get("version")
        return str(got) if got else None

    @property
    def torch_version(self) -> str | None:
        got = self.start.get("torch_version")
        return str(got) if got else None

    @property
    def method(self) -> str | None:
        """How the trial measured, 'placement; timing' (e.g. 'out-of-place; host clock, ...'), from
        the worker's start record; None when no worker started."""
        if self.start.get("engine") == "nccl-tests":
            binaries = self.start.get("binaries") or ["all_reduce_perf"]
            return f"out-of-place; {', '.join(str(b) for b in binaries)} (nccl-tests)"
        if not self.start.get("timing"):
            return None
        return f"{self.start.get('placement', 'in-place')}; {self.start['timing']}"


@dataclass(frozen=True)
class ReportRow:
    """One size of one collective in a sweep's report: NCCL's defaults (median and noise) against the published
    setting (median, ratio), and the algorithm/protocol NCCL used for each ("Ring/LL")."""

    size_bytes: int
    weight: float
    default_busbw_gbps: float
    default_noise_pct: float
    tuned_busbw_gbps: float
    ratio: float
    default_algo_proto: str | None = None
    tuned_algo_proto: str | None = None
    collective: str = ALL_REDUCE

    def as_dict(self) -> dict[str, Any]:
        """The row as the JSON documents (`sweep --json`, `report --json`, history) show it."""
        return {
            "size_bytes": self.size_bytes, "weight": self.weight,
            "default_busbw_gbps": self.default_busbw_gbps, "default_noise_pct": self.default_noise_pct,
            "tuned_busbw_gbps": self.tuned_busbw_gbps, "ratio": self.ratio,
            "default_algo_proto": self.default_algo_proto, "tuned_algo_proto": self.tuned_algo_proto,
            "collective": self.collective,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ReportRow:
        """A row from its JSON form (as older history files kept it). Missing weight counts as
        1 (every size counted), missing noise as 0, a missing ratio is tuned over default.

        Raises:
            KeyError, TypeError, ValueError: no size or default/tuned busbw, or not numbers.
        """
        default = float(doc["default_busbw_gbps"])
        tuned = float(doc["tuned_busbw_gbps"])
        ratio = doc.get("ratio")
        return cls(
            size_bytes=int(doc["size_bytes"]),
            weight=float(doc.get("weight", 1.0)),
            default_busbw_gbps=default,
            default_noise_pct=float(doc.get("default_noise_pct", 0.0)),
            tuned_busbw_gbps=tuned,
            ratio=float(ratio) if ratio is not None else (round(tuned / default, 4) if default > 0 else 1.0),
            default_algo_proto=doc.get("default_algo_proto"),
            tuned_algo_proto=doc.get("tuned_algo_proto"),
            collective=str(doc.get("collective", ALL_REDUCE)),
        )
