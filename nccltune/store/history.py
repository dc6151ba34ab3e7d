"""The history's records: runs, their trials and measurements, and a sweep's report rows."""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from ..records import MEASUREMENT_KEYS, TRIAL_STATUSES, Measurement, ReportRow, TrialStatus
from .database import Clock, Database, utc_now
from .rows import (
    PHASES,
    RUN_BACKENDS,
    RUN_KINDS,
    RUN_STATUSES,
    Phase,
    PublishedEnv,
    PublishedRun,
    RunBackend,
    RunKind,
    RunRecord,
    RunStatus,
    TrialRecord,
    check_choice,
    dump_json,
    insert_report_rows,
    iso,
    measurement,
    report_row,
    run_record,
    trial_record,
)
from .summaries import ImportSummary, RunSummary, SweepSummary, VerifySummary

# One logger for the whole store, named as its messages have always been.
log = logging.getLogger(__package__)


class Store:
    """The history database. One connection per object; several objects (or processes) may share
    a file.

    Raises (from the constructor):
        InputError: the file was written by a newer nccltune, or cannot be opened or written
            (missing state directory, no permission).
        BusyError: another process held the database locked past the busy timeout.
    """

    def __init__(self, path: Path, *, clock: Clock = utc_now) -> None:
        self._db = Database(path, clock=clock)
        self.path = self._db.path

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- writing ------------------------------------------------------------------------------

    def start_run(
        self,
        *,
        kind: RunKind,
        fingerprint: str,
        backend: RunBackend,
        demo: bool,
        profile: str | None,
        nccl_version: str | None,
        driver_version: str | None,
        torch_version: str | None,
        nccltune_version: str,
        hostname: str,
        topology: Mapping[str, Any],
        config: Mapping[str, Any],
    ) -> int:
        """Record a run as 'running' and return its id.

        Raises:
            ValueError: an unknown kind or backend, or topology/config that is not JSON.
        """
        check_choice("kind", kind, RUN_KINDS)
        check_choice("backend", backend, RUN_BACKENDS)
        topology_json, config_json = dump_json(dict(topology)), dump_json(dict(config))
        with self._db.write() as conn:
            cur = conn.execute(
                """
                INSERT INTO runs (started_at, status, kind, fingerprint, backend, demo, profile,
                    nccl_version, driver_version, torch_version, nccltune_version, hostname,
                    topology_json, config_json)
                VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
                (
                    self._db.now(),
                    kind,
                    fingerprint,
                    backend,
                    int(demo),
                    profile,
                    nccl_version,
                    driver_version,
                    torch_version,
                    nccltune_version,
                    hostname,
                    topology_json,
                    config_json,
                ),
            )
            run_id = cur.lastrowid
        assert run_id is not None
        return run_id

    def add_trial(
        self,
        run_id: int,
        *,
        seq: int,
        phase: Phase,
        label: str,
        env: Mapping[str, str],
        status: TrialStatus,
        reason: str | None = None,
        wall_s: float | None = None,
        nccl: Mapping[str, Any] | None = None,
        measurements: Sequence[Measurement] = (),
        started_at: datetime | None = None,
    ) -> int:
        """Record one trial and its measurements in one transaction; return the trial's id.

        `env` holds the candidate's own variables only (not the inherited environment).
        `started_at` defaults to now, for callers that record a trial as it begins.

        Raises:
            KeyError: no run with that id.
            ValueError: an unknown phase or status, a measurement that is not a finite number
                (SQLite stores NaN as NULL), or `nccl` that is not JSON.
        """
        check_choice("phase", phase, PHASES)
        check_choice("status", status, TRIAL_STATUSES)
        for m in measurements:
            numbers = (m.time_us, m.algbw_gbps, m.busbw_gbps, *(() if m.gpu_time_us is None else (m.gpu_time_us,)))
            if not all(math.isfinite(v) for v in numbers):
                raise ValueError(f"trial {label!r}: measurement at {m.size_bytes} bytes is not finite: {m}")
        env_json = dump_json(dict(sorted(env.items())))
        nccl_json = None if nccl is None else dump_json(dict(nccl))
        started = self._db.now() if started_at is None else iso(started_at)
        with self._db.write() as conn:
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
                raise KeyError(f"no run with id {run_id}")
            cur = conn.execute(
                """
                INSERT INTO trials (run_id, seq, phase, label, env_json, status, reason, wall_s,
                    nccl_json, started_at)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
                (run_id, seq, phase, label, env_json, status, reason, wall_s, nccl_json, started),
            )
            trial_id = cur.lastrowid
            assert trial_id is not None
            conn.executemany(
                f"INSERT INTO measurements (trial_id, {', '.join(MEASUREMENT_KEYS)}) "
                f"VALUES (?{', ?' * len(MEASUREMENT_KEYS)})",
                [(trial_id, *m.to_doc().values()) for m in measurements],
            )
        return trial_id

    def finish_run(
        self,
        run_id: int,
        *,
        status: RunStatus,
        summary: RunSummary | Mapping[str, Any] | None = None,
        chosen_env: Mapping[str, str] | None = None,
        published_generation: int | None = None,
        rows: Sequence[ReportRow] = (),
    ) -> None:
        """Close a run with its final status, its summary, the report's rows and what was
        published. The summary is its kind's record (what nccltune writes), or a document as an
        older nccltune stored it (the tests' histories).

        Raises:
            KeyError: no run with that id.
            ValueError: status 'running' or unknown, summary/chosen_env that is not JSON, a row
                that is not a finite number, or a summary that carries "rows" of its own (they
                belong in `rows`).
        """
        check_choice("status", status, RUN_STATUSES - {"running"})
        doc = summary.to_doc() if isinstance(summary, (SweepSummary, VerifySummary, ImportSummary)) else summary
        if doc is not None and "rows" in doc and rows:
            raise ValueError("the report's rows go in `rows`, not in the summary")
        for r in rows:
            if not all(math.isfinite(v) for v in (r.weight, r.default_busbw_gbps, r.default_noise_pct,
                                                   r.tuned_busbw_gbps, r.ratio)):
                raise ValueError(f"report row at {r.size_bytes} bytes is not finite: {r}")
        summary_json = None if doc is None else dump_json(dict(doc))
        chosen_json = None if chosen_env is None else dump_json(dict(sorted(chosen_env.items())))
        with self._db.write() as conn:
            cur = conn.execute(
                """
                UPDATE runs SET status = ?, finished_at = ?, summary_json = ?, chosen_env_json = ?,
                    published_generation = ?
                WHERE id = ?
                """,
                (status, self._db.now(), summary_json, chosen_json, published_generation, run_id),
            )
            if cur.rowcount != 1:
                raise KeyError(f"no run with id {run_id}")
            conn.execute("DELETE FROM report_rows WHERE run_id = ?", (run_id,))
            insert_report_rows(conn, run_id, rows)

    def mark_interrupted(self, published: PublishedRun | None = None) -> int:
        """Close every 'running' run; return how many there were.

        Meant for start-up after a crash, while holding the sweep lock: a run still 'running'
        then belongs to a process that died. The run ``published`` names (the one the current
        generation's provenance names: it died after its publish, before it was closed) is
        closed as 'ok' with that generation, finished when the generation was written; every
        other one as 'interrupted', its finished_at empty since when it died is not known.
        """
        with self._db.write() as conn:
            ids = [int(r[0]) for r in conn.execute("SELECT id FROM runs WHERE status = 'running'")]
            recovered = published is not None and published.run_id in ids
            if published is not None and recovered:
                trials = conn.execute("SELECT COUNT(*) FROM trials WHERE run_id = ?", (published.run_id,)).fetchone()
                summary = SweepSummary(
                    chosen="as published", trials=int(trials[0]),
                    line=f"ended after publishing generation {published.generation}, before its result was "
                         "recorded: the published set is its result")
                conn.execute(
                    "UPDATE runs SET status = 'ok', finished_at = ?, summary_json = ?, chosen_env_json = ?, "
                    "published_generation = ? WHERE id = ? AND status = 'running'",
                    (iso(published.published_at), dump_json(summary.to_doc()),
                     dump_json(dict(sorted(published.env.items()))), published.generation, published.run_id))
            conn.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
        if published is not None and recovered:
            log.warning("%s: run %d ended after publishing generation %d; recorded as published", self.path,
                        published.run_id, published.generation)
            ids.remove(published.run_id)
        if ids:
            log.warning("%s: marked %d unfinished run(s) as interrupted: %s", self.path, len(ids), ids)
        return len(ids) + (1 if recovered else 0)

    # -- reading ------------------------------------------------------------------------------

    # The one order of "the newest runs first", for every query that lists runs.
    NEWEST_FIRST = "ORDER BY started_at DESC, id DESC"

    def runs(self, limit: int | None = 20, kind: RunKind | None = None,
             kinds: Sequence[RunKind] | None = None) -> list[RunRecord]:
        """The newest runs first; `limit=None` for all of them. `kind` (or several, `kinds`)
        keeps runs of that kind only; without either, every kind (imports too)."""
        wanted = [kind] if kind is not None else list(kinds or ())
        sql = "SELECT * FROM runs"
        params: list[Any] = []
        if wanted:
            sql += f" WHERE kind IN ({', '.join('?' for _ in wanted)})"
            params.extend(wanted)
        sql += f" {self.NEWEST_FIRST} LIMIT ?"
        params.append(-1 if limit is None else limit)
        return [self._run_record(row) for row in self._db.conn.execute(sql, params).fetchall()]

    def run_count(self, kind: RunKind) -> int:
        """How many runs of `kind` the history holds, counted without reading them."""
        return int(self._db.conn.execute("SELECT COUNT(*) FROM runs WHERE kind = ?", (kind,)).fetchone()[0])

    def run_outcomes(self, kind: RunKind, limit: int) -> list[tuple[str, RunStatus, bool]]:
        """The newest `limit` runs of `kind`, in runs()' order, each as (fingerprint, status,
        finished): those columns alone, no record decoded (the daemon's metrics ask at every poll)."""
        rows = self._db.conn.execute(f"SELECT fingerprint, status, finished_at FROM runs WHERE kind = ? "
                                     f"{self.NEWEST_FIRST} LIMIT ?", (kind, limit))
        return [(str(r["fingerprint"]), r["status"], r["finished_at"] is not None) for r in rows]

    def run(self, run_id: int) -> RunRecord | None:
        row = self._db.conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else self._run_record(row)

    def report_rows(self, run_id: int) -> tuple[ReportRow, ...]:
        """A run's report, size by size, in the order it was written."""
        return tuple(
            report_row(row)
            for row in self._db.conn.execute("SELECT * FROM report_rows WHERE run_id = ? ORDER BY position", (run_id,))
        )

    def _run_record(self, row: sqlite3.Row) -> RunRecord:
        return run_record(row, self.report_rows(int(row["id"])))

    def trials(self, run_id: int) -> list[TrialRecord]:
        """A run's trials in seq order, each with its measurements in the order they were added."""
        by_trial: dict[int, list[Measurement]] = {}
        for row in self._db.conn.execute(
            """
            SELECT m.* FROM measurements m JOIN trials t ON t.id = m.trial_id
            WHERE t.run_id = ? ORDER BY m.rowid
            """,
            (run_id,),
        ):
            by_trial.setdefault(int(row["trial_id"]), []).append(measurement(row))
        return [
            trial_record(row, tuple(by_trial.get(int(row["id"]), ())))
            for row in self._db.conn.execute("SELECT * FROM trials WHERE run_id = ? ORDER BY seq, id", (run_id,))
        ]

    def iter_trials(self, run_id: int, *, measurements: bool = True) -> Iterator[TrialRecord]:
        """A run's trials as trials() gives them, one at a time: what is held is one trial's
        measurements, however many the run has (nccltune export streams a whole history);
        without `measurements`, the trials alone (their measurements empty)."""
        conn = self._db.conn
        for row in conn.execute("SELECT * FROM trials WHERE run_id = ? ORDER BY seq, id", (run_id,)):
            if not measurements:
                yield trial_record(row, ())
                continue
            measured = conn.execute("SELECT * FROM measurements WHERE trial_id = ? ORDER BY rowid", (int(row["id"]),))
            yield trial_record(row, tuple(measurement(m) for m in measured))

    def run_ids(self, kind: RunKind, status: RunStatus, fingerprint: str) -> list[int]:
        """The ids of the runs of `kind` and `status` measured on topology `fingerprint`, oldest
        first: the runs themselves are read one at a time (run())."""
        rows = self._db.conn.execute(
            "SELECT id FROM runs WHERE kind = ? AND status = ? AND fingerprint = ? ORDER BY id",
            (kind, status, fingerprint))
        return [int(r["id"]) for r in rows]

    def latest_run(
        self, fingerprint: str, kind: RunKind = "sweep", status: RunStatus | None = "ok"
    ) -> RunRecord | None:
        """The most recently started run for this fingerprint; `status=None` for any status."""
        sql = "SELECT * FROM runs WHERE fingerprint = ? AND kind = ?"
        params: list[Any] = [fingerprint, kind]
        if status is not None:
            sql += " AND status = ?"
            params.append(status)
        row = self._db.conn.execute(f"{sql} {self.NEWEST_FIRST} LIMIT 1", params).fetchone()
        return None if row is None else self._run_record(row)

    def latest_published(self, fingerprint: str) -> PublishedEnv | None:
        """The chosen environment and publish generation of the latest ok sweep, if any."""
        latest = self.latest_run(fingerprint, kind="sweep")
        if latest is None:
            return None
        return PublishedEnv(
            run_id=latest.id,
            env=dict(latest.chosen_env or {}),
            generation=latest.published_generation,
            finished_at=latest.finished_at,
        )
