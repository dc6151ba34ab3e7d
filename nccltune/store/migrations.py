"""The history file's schema, versioned with `PRAGMA user_version` and grown by migrations.

The file outlives nccltune upgrades: migration i (0-based) takes it from user_version i to
i + 1, and a file written by a newer nccltune is refused rather than guessed at.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable

from ..records import ReportRow
from .rows import dump_json, insert_report_rows, load_json

# One logger for the whole store, named as its messages have always been.
log = logging.getLogger(__package__)


def _migrate_v1(conn: sqlite3.Connection) -> None:
    # Enumerated columns (status, kind, phase, backend) are checked in Python, not with CHECK
    # constraints: SQLite cannot alter a CHECK without rebuilding the table, and a new status
    # should not cost a migration.
    conn.execute(
        """
        CREATE TABLE runs (
            id INTEGER PRIMARY KEY,
            started_at TEXT NOT NULL,
            finished_at TEXT,
            status TEXT NOT NULL,
            kind TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            backend TEXT NOT NULL,
            demo INTEGER NOT NULL,
            profile TEXT,
            nccl_version TEXT,
            driver_version TEXT,
            torch_version TEXT,
            nccltune_version TEXT NOT NULL,
            hostname TEXT NOT NULL,
            topology_json TEXT NOT NULL,
            config_json TEXT NOT NULL,
            summary_json TEXT,
            chosen_env_json TEXT,
            published_generation INTEGER
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE trials (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            phase TEXT NOT NULL,
            label TEXT NOT NULL,
            env_json TEXT NOT NULL,
            status TEXT NOT NULL,
            reason TEXT,
            wall_s REAL,
            nccl_json TEXT,
            started_at TEXT NOT NULL
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE measurements (
            trial_id INTEGER NOT NULL REFERENCES trials(id) ON DELETE CASCADE,
            size_bytes INTEGER NOT NULL,
            time_us REAL NOT NULL,
            algbw_gbps REAL NOT NULL,
            busbw_gbps REAL NOT NULL,
            algo TEXT,
            proto TEXT,
            correct INTEGER NOT NULL
        )
        """
    )
    conn.execute("CREATE INDEX runs_by_fingerprint ON runs(fingerprint, started_at)")
    # (run_id, seq) rather than run_id alone: the same index also yields trials in order.
    conn.execute("CREATE INDEX trials_by_run ON trials(run_id, seq)")
    # Without it every trial's measurements (and every cascade delete) scans the whole table.
    conn.execute("CREATE INDEX measurements_by_trial ON measurements(trial_id)")


def _migrate_v2(conn: sqlite3.Connection) -> None:
    # What a measurement now says beyond v1: which collective, how many channels NCCL used,
    # and the GPU-clock time beside the host-clock one. Old rows were all all-reduce.
    conn.execute("ALTER TABLE measurements ADD COLUMN collective TEXT NOT NULL DEFAULT 'all_reduce'")
    conn.execute("ALTER TABLE measurements ADD COLUMN channels INTEGER")
    conn.execute("ALTER TABLE measurements ADD COLUMN gpu_time_us REAL")
    # A sweep's report, one row per size (and collective), instead of a list inside summary_json.
    conn.execute(
        """
        CREATE TABLE report_rows (
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            size_bytes INTEGER NOT NULL,
            collective TEXT NOT NULL,
            weight REAL NOT NULL,
            default_busbw_gbps REAL NOT NULL,
            default_noise_pct REAL NOT NULL,
            tuned_busbw_gbps REAL NOT NULL,
            ratio REAL NOT NULL,
            default_algo_proto TEXT,
            tuned_algo_proto TEXT,
            PRIMARY KEY (run_id, position)
        )
        """
    )
    # Sweeps recorded before this version kept their rows in summary_json: move them over.
    for run_id, text in conn.execute(
        "SELECT id, summary_json FROM runs WHERE kind = 'sweep' AND summary_json IS NOT NULL"
    ).fetchall():
        # The version-1 document as it lies in the file: a migration reads the layout it migrates
        # from, not today's records (summaries.py), so that it stays as it ran in the field.
        v1_doc = load_json(text)
        if not isinstance(v1_doc, dict) or not isinstance(v1_doc.get("rows"), list):
            continue
        try:
            rows = [ReportRow.from_dict(doc) for doc in v1_doc["rows"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("run %s: report rows kept in its summary, not readable as rows (%s)", run_id, exc)
            continue
        insert_report_rows(conn, int(run_id), rows)
        rest = {k: v for k, v in v1_doc.items() if k != "rows"}
        conn.execute("UPDATE runs SET summary_json = ? WHERE id = ?", (dump_json(rest), run_id))


# Migration i (0-based) takes the schema from user_version i to i + 1. Append, never edit:
# files in the field have already run the earlier ones.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_v1, _migrate_v2)


def schema_version() -> int:
    """The user_version this code writes and understands."""
    return len(MIGRATIONS)
