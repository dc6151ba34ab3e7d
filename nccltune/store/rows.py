"""What the store hands back, and how its columns are written and read.

Times are stored as ISO-8601 UTC strings of fixed width, so that they sort as text; JSON
columns are written with sorted keys, so that equal values are equal strings. Enumerated
columns (status, kind, phase, backend) are text checked here, not by the database.
"""

from __future__ import annotations

import json
import sqlite3
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from typing import Any, Literal

from ..errors import InputError
from ..files.inputfile import loads_strict
from ..records import Measurement, ReportRow, TrialStatus
from .summaries import ImportSummary, RunSummary, SummaryError, SweepSummary, VerifySummary

RunStatus = Literal["running", "ok", "failed", "interrupted"]
# "import": a document of another tool (nccl-tests' -J output) read into the history, for
# `report` and `compare`. It measured nothing nccltune chose, so no reader that wants a sweep's
# result (verify's expectations, the upgrade gate, metrics, export, publish) may take one:
# they ask for kind "sweep" by name.
RunKind = Literal["sweep", "verify", "import"]
# What produced a run's numbers: nccltune's worker on NCCL or on gloo (the CPU demo), or
# nccl-tests' `*_perf` binaries (an imported document).
RunBackend = Literal["nccl", "gloo", "nccl-tests"]
Phase = Literal["baseline", "screen", "combine", "final", "verify", "exhaustive", "import"]

RUN_STATUSES: frozenset[str] = frozenset(typing.get_args(RunStatus))
RUN_KINDS: frozenset[str] = frozenset(typing.get_args(RunKind))
RUN_BACKENDS: frozenset[str] = frozenset(typing.get_args(RunBackend))
PHASES: frozenset[str] = frozenset(typing.get_args(Phase))
_S = typing.TypeVar("_S", SweepSummary, VerifySummary, ImportSummary)


@dataclass(frozen=True)
class RunRecord:
    """A sweep, verify or import run. JSON columns come back decoded; times are ISO-8601 UTC text.

    `rows` is a sweep's report, size by size, from the report_rows table. `summary` is the stored
    document, with the same rows under "rows" too, as the JSON documents (history, report) have
    always carried it; code reads it typed, through `sweep_summary`, `verify_summary`,
    `import_summary` or `outcome`.
    """

    id: int
    kind: RunKind
    status: RunStatus
    started_at: str
    finished_at: str | None
    fingerprint: str
    backend: RunBackend
    demo: bool
    profile: str | None
    nccl_version: str | None
    driver_version: str | None
    torch_version: str | None
    nccltune_version: str
    hostname: str
    topology: dict[str, Any]
    config: dict[str, Any]
    summary: dict[str, Any] | None
    chosen_env: dict[str, str] | None
    published_generation: int | None
    rows: tuple[ReportRow, ...] = ()

    @cached_property
    def outcome(self) -> RunSummary:
        """The summary as its kind's record (empty where the run kept none).

        Raises:
            InputError: a stored field of the wrong type (exit 78), named with the run.
        """
        kind: type[SweepSummary] | type[VerifySummary] | type[ImportSummary] = (
            VerifySummary if self.kind == "verify" else ImportSummary if self.kind == "import" else SweepSummary)
        try:
            return kind.from_doc(self.summary if isinstance(self.summary, dict) else {})
        except SummaryError as exc:
            raise InputError(f"history run {self.id}", f"summary field {exc}",
                             hint="the history holds a summary nccltune did not write") from None

    def _summary_of(self, kind: type[_S]) -> _S:
        got = self.outcome
        if not isinstance(got, kind):
            raise TypeError(f"run {self.id} is a {self.kind} run: its summary is no {kind.__name__}")
        return got

    @property
    def sweep_summary(self) -> SweepSummary:
        """The summary of a sweep run (TypeError for another kind)."""
        return self._summary_of(SweepSummary)

    @property
    def verify_summary(self) -> VerifySummary:
        """The summary of a verify run (TypeError for another kind)."""
        return self._summary_of(VerifySummary)

    @property
    def import_summary(self) -> ImportSummary:
        """The summary of an import run (TypeError for another kind)."""
        return self._summary_of(ImportSummary)

    @property
    def configured_nranks(self) -> int | None:
        """Ranks per trial as the sweep chose them: bench.nranks, else one per GPU of bench.gpus or
        of the node (in the CPU demo two, one for a recording of one GPU: node.load_node)."""
        bench = self.config.get("bench", {}) if isinstance(self.config, dict) else {}
        gpus = self.topology.get("gpus")
        nranks = bench.get("nranks") or len(bench.get("gpus") or []) or (
            min(2, gpus if isinstance(gpus, int) and gpus > 0 else 2) if self.demo else gpus)
        return int(nranks) if isinstance(nranks, int) and nranks > 0 else None

    @property
    def nranks(self) -> int | None:
        """How many ranks the run's trials had: the whole job of a job shape, else as the run
        recorded it (runs since the record has it), else `configured_nranks`."""
        job = self.topology.get("job")
        if isinstance(job, dict) and isinstance(job.get("nnodes"), int) and isinstance(job.get("ranks_per_node"), int):
            return int(job["nnodes"]) * int(job["ranks_per_node"])
        recorded = self.topology.get("nranks")
        if isinstance(recorded, int) and recorded > 0:
            return recorded
        return self.configured_nranks


@dataclass(frozen=True)
class TrialRecord:
    """One candidate environment measured in one fresh set of rank processes."""

    id: int
    run_id: int
    seq: int
    phase: Phase
    label: str
    env: dict[str, str]
    status: TrialStatus
    reason: str | None
    wall_s: float | None
    nccl: dict[str, Any] | None
    started_at: str
    measurements: tuple[Measurement, ...]


@dataclass(frozen=True)
class PublishedRun:
    """A run named by the current generation's provenance, as a dead run's recovery reads it:
    the generation it published, when (the provenance's created_at) and what every job got."""

    run_id: int
    generation: int
    published_at: datetime
    env: Mapping[str, str]


@dataclass(frozen=True)
class PublishedEnv:
    """What the latest ok sweep chose; `env` is empty when it kept NCCL's defaults."""

    run_id: int
    env: dict[str, str]
    generation: int | None
    finished_at: str | None


# ---------------------------------------------------------------------------------------------
# Writing columns


def iso(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError("the store's clock must return timezone-aware datetimes")
    # Fixed width (always microseconds, always +00:00) so that text order is time order.
    return moment.astimezone(timezone.utc).isoformat(timespec="microseconds")


def dump_json(value: Any) -> str:
    # allow_nan=False: NaN and Infinity are not JSON, and other readers (sqlite's json1, jq)
    # would reject the column.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def load_json(text: str | None) -> Any:
    """A JSON column, read as every JSON nccltune reads is (files.inputfile.loads_strict), but for
    a lone surrogate: the history keeps a run's text as it was given (an environment's undecodable
    byte is one, by Python's surrogateescape), and what writes it out names it (the export: "a text
    without a UTF-8 form").

    Raises:
        ValueError: not strict JSON (a column another program wrote)."""
    return None if text is None else loads_strict(text, lone_surrogates=True)


def check_choice(name: str, value: str, allowed: frozenset[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(sorted(allowed))}; got {value!r}")


REPORT_ROW_COLUMNS = ("size_bytes", "collective", "weight", "default_busbw_gbps", "default_noise_pct",
                      "tuned_busbw_gbps", "ratio", "default_algo_proto", "tuned_algo_proto")


def insert_report_rows(conn: sqlite3.Connection, run_id: int, rows: Sequence[ReportRow]) -> None:
    conn.executemany(
        f"INSERT INTO report_rows (run_id, position, {', '.join(REPORT_ROW_COLUMNS)}) "
        f"VALUES (?, ?, {', '.join('?' for _ in REPORT_ROW_COLUMNS)})",
        [(run_id, i, *(getattr(r, c) for c in REPORT_ROW_COLUMNS)) for i, r in enumerate(rows)],
    )


# ---------------------------------------------------------------------------------------------
# Reading rows


def run_record(row: sqlite3.Row, rows: tuple[ReportRow, ...]) -> RunRecord:
    summary = load_json(row["summary_json"])
    if rows and isinstance(summary, dict):
        # Sorted like every JSON column, so that the document reads as it did when the rows were
        # stored inside the summary.
        summary = dict(sorted({**summary, "rows": [r.as_dict() for r in rows]}.items()))
    return RunRecord(
        id=int(row["id"]),
        kind=typing.cast(RunKind, row["kind"]),
        status=typing.cast(RunStatus, row["status"]),
        started_at=str(row["started_at"]),
        finished_at=row["finished_at"],
        fingerprint=str(row["fingerprint"]),
        backend=typing.cast(RunBackend, row["backend"]),
        demo=bool(row["demo"]),
        profile=row["profile"],
        nccl_version=row["nccl_version"],
        driver_version=row["driver_version"],
        torch_version=row["torch_version"],
        nccltune_version=str(row["nccltune_version"]),
        hostname=str(row["hostname"]),
        topology=load_json(row["topology_json"]),
        config=load_json(row["config_json"]),
        summary=summary,
        chosen_env=load_json(row["chosen_env_json"]),
        published_generation=row["published_generation"],
        rows=rows,
    )


def trial_record(row: sqlite3.Row, measurements: tuple[Measurement, ...]) -> TrialRecord:
    return TrialRecord(
        id=int(row["id"]),
        run_id=int(row["run_id"]),
        seq=int(row["seq"]),
        phase=typing.cast(Phase, row["phase"]),
        label=str(row["label"]),
        env=load_json(row["env_json"]),
        status=typing.cast(TrialStatus, row["status"]),
        reason=row["reason"],
        wall_s=row["wall_s"],
        nccl=load_json(row["nccl_json"]),
        started_at=str(row["started_at"]),
        measurements=measurements,
    )


def measurement(row: sqlite3.Row) -> Measurement:
    return Measurement.from_doc(dict(zip(row.keys(), row, strict=True)))


def report_row(row: sqlite3.Row) -> ReportRow:
    return ReportRow(
        size_bytes=int(row["size_bytes"]),
        weight=float(row["weight"]),
        default_busbw_gbps=float(row["default_busbw_gbps"]),
        default_noise_pct=float(row["default_noise_pct"]),
        tuned_busbw_gbps=float(row["tuned_busbw_gbps"]),
        ratio=float(row["ratio"]),
        default_algo_proto=row["default_algo_proto"],
        tuned_algo_proto=row["tuned_algo_proto"],
        collective=str(row["collective"]),
    )
