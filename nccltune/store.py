"""Results store: every run, trial and measurement, in one SQLite file (`history.db`).

The file outlives nccltune upgrades, so its schema is versioned with `PRAGMA user_version`
and grown by an ordered list of migrations; a file written by a newer nccltune is refused
rather than guessed at. The daemon and a command-line sweep or verify may hold the file
at the same time, hence WAL mode (readers never block the writer) and a busy timeout.
History is worth less than a working tuner: a corrupt file is moved aside, with a warning
naming both paths, and a fresh one takes its place.

Times are stored as ISO-8601 UTC strings of fixed width, so that they sort as text;
JSON columns are written with sorted keys, so that equal values are equal strings.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import sqlite3
import statistics
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from . import trust
from .atomicfile import FileError
from .errors import BusyError, InputError
from .records import TRIAL_STATUSES, Measurement, ReportRow, TrialStatus

log = logging.getLogger(__name__)

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

_RUN_STATUSES: frozenset[str] = frozenset(typing.get_args(RunStatus))
_RUN_KINDS: frozenset[str] = frozenset(typing.get_args(RunKind))
_RUN_BACKENDS: frozenset[str] = frozenset(typing.get_args(RunBackend))
_PHASES: frozenset[str] = frozenset(typing.get_args(Phase))

BUSY_TIMEOUT_MS = 5000

# SQLite primary result codes (sqlite3.h) that decide how an error is reported.
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_SQLITE_IOERR = 10
_SQLITE_FULL = 13
# Python 3.10 lacks `sqlite_errorcode` on exceptions; there the message is all there is.
_CODE_BY_MESSAGE = {
    "database is locked": _SQLITE_BUSY,
    "database disk image is malformed": _SQLITE_CORRUPT,
    "file is not a database": _SQLITE_NOTADB,
    "database or disk is full": _SQLITE_FULL,
    "attempt to write a readonly database": _SQLITE_READONLY,
    "disk I/O error": _SQLITE_IOERR,
}
# Files SQLite keeps beside the database. They go aside with a corrupt file: SQLite replays a
# leftover WAL or hot journal into whatever database next opens under the same name.
_COMPANION_SUFFIXES = ("-wal", "-shm", "-journal")

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


# ---------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class RunRecord:
    """A sweep, verify or import run. JSON columns come back decoded; times are ISO-8601 UTC text.

    `rows` is a sweep's report, size by size, from the report_rows table. `summary` shows the
    same rows under "rows" too, as the JSON documents (history, report) have always carried them.
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
class PublishedEnv:
    """What the latest ok sweep chose; `env` is empty when it kept NCCL's defaults."""

    run_id: int
    env: dict[str, str]
    generation: int | None
    finished_at: str | None


# ---------------------------------------------------------------------------------------------
# Schema


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


_REPORT_ROW_COLUMNS = ("size_bytes", "collective", "weight", "default_busbw_gbps", "default_noise_pct",
                       "tuned_busbw_gbps", "ratio", "default_algo_proto", "tuned_algo_proto")


def _insert_report_rows(conn: sqlite3.Connection, run_id: int, rows: Sequence[ReportRow]) -> None:
    conn.executemany(
        f"INSERT INTO report_rows (run_id, position, {', '.join(_REPORT_ROW_COLUMNS)}) "
        f"VALUES (?, ?, {', '.join('?' for _ in _REPORT_ROW_COLUMNS)})",
        [(run_id, i, *(getattr(r, c) for c in _REPORT_ROW_COLUMNS)) for i, r in enumerate(rows)],
    )


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
        summary = _load(text)
        if not isinstance(summary, dict) or not isinstance(summary.get("rows"), list):
            continue
        try:
            rows = [ReportRow.from_dict(doc) for doc in summary["rows"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("run %s: report rows kept in its summary, not readable as rows (%s)", run_id, exc)
            continue
        _insert_report_rows(conn, int(run_id), rows)
        rest = {k: v for k, v in summary.items() if k != "rows"}
        conn.execute("UPDATE runs SET summary_json = ? WHERE id = ?", (_dump(rest), run_id))


# Migration i (0-based) takes the schema from user_version i to i + 1. Append, never edit:
# files in the field have already run the earlier ones.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_v1, _migrate_v2)


def schema_version() -> int:
    """The user_version this code writes and understands."""
    return len(MIGRATIONS)


# ---------------------------------------------------------------------------------------------
# Helpers


def _iso(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError("the store's clock must return timezone-aware datetimes")
    # Fixed width (always microseconds, always +00:00) so that text order is time order.
    return moment.astimezone(timezone.utc).isoformat(timespec="microseconds")


def _dump(value: Any) -> str:
    # allow_nan=False: NaN and Infinity are not JSON, and other readers (sqlite's json1, jq)
    # would reject the column.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _check(name: str, value: str, allowed: frozenset[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(sorted(allowed))}; got {value!r}")


def _error_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF  # extended codes carry the primary code in the low byte
    for message, mapped in _CODE_BY_MESSAGE.items():
        if message in str(exc):
            return mapped
    return None


def _is_corruption(exc: sqlite3.Error) -> bool:
    return _error_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class _CorruptDatabase(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Store


class Store:
    """The history database. One connection per object; several objects (or processes) may share
    a file.

    Raises (from the constructor):
        InputError: the file was written by a newer nccltune, or cannot be opened or written
            (missing state directory, no permission).
        BusyError: another process held the database locked past the busy timeout.
    """

    def __init__(self, path: Path, *, clock: Clock = _utc_now) -> None:
        self.path = Path(path)
        self._clock = clock
        # (device, inode) of the file as first opened, so that a file another process has
        # already replaced is not moved aside a second time.
        self._opened_file: tuple[int, int] | None = None
        self._conn = self._open()

    # -- opening ------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        existed = os.path.lexists(self.path)
        self._check_trust(existed)
        try:
            return self._open_checked()
        except sqlite3.Error as exc:
            code = _error_code(exc)
            if not existed:
                self._remove_new_file()
            if code in (_SQLITE_FULL, _SQLITE_IOERR):
                raise self._disk_error(code, exc) from exc
            raise
        except BaseException:
            if not existed:
                self._remove_new_file()
            raise

    def _disk_error(self, code: int | None, exc: sqlite3.Error) -> FileError:
        """Disk full or an I/O error is no bad config: exit 1 with the OS's words. SQLite reports
        a write that failed for want of space as SQLITE_IOERR as often as SQLITE_FULL; a file
        system with no block left is called full, whichever it said."""
        full = code == _SQLITE_FULL
        if not full:
            with contextlib.suppress(OSError):
                full = os.statvfs(self.path.parent).f_bavail == 0
        os_error = OSError(errno.ENOSPC, "No space left on device") if full else OSError(errno.EIO, str(exc))
        return FileError(self.path, os_error, action="cannot write the history database")

    def _check_trust(self, existed: bool) -> None:
        """The database lives in the state directory root shares with nobody: refuse a symlinked,
        foreign-owned or group/world-writable file there (sqlite would follow a link)."""
        try:
            trust.check_dir(self.path.parent, "state directory")
            if existed:
                trust.check_file(self.path, "history database")
        except FileNotFoundError:
            return  # sqlite's own error names what is missing

    def _remove_new_file(self) -> None:
        """A database this open created but could not finish must not stay behind empty."""
        for suffix in ("", *_COMPANION_SUFFIXES):
            with contextlib.suppress(OSError):
                os.unlink(self.path.with_name(self.path.name + suffix))

    def _open_checked(self) -> sqlite3.Connection:
        try:
            try:
                return self._connect()
            except _CorruptDatabase as corrupt:
                self._move_aside(corrupt.detail)
            try:
                return self._connect()
            except _CorruptDatabase as corrupt:  # a file created a moment ago: not ours to fix
                raise InputError(str(self.path), f"database is unusable: {corrupt.detail}") from None
        except sqlite3.Error as exc:
            if _error_code(exc) in (_SQLITE_BUSY, _SQLITE_LOCKED):
                raise self._locked() from exc
            if _error_code(exc) in (_SQLITE_FULL, _SQLITE_IOERR):
                raise
            raise InputError(
                str(self.path),
                f"cannot open the history database: {exc}",
                hint="check that the state directory exists and is writable (--state-dir)",
            ) from exc

    def _connect(self) -> sqlite3.Connection:
        """Open, check and migrate; raises _CorruptDatabase for a file that needs moving aside."""
        self._opened_file = _file_id(self.path)
        # isolation_level=None: transactions are begun explicitly (see _write), so that writers
        # take the lock with BEGIN IMMEDIATE instead of upgrading a read transaction, which in
        # WAL mode fails with SQLITE_BUSY without waiting on the busy timeout.
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            try:
                # The first read of the header is where a file that is not SQLite shows itself.
                version = int(conn.execute("PRAGMA user_version").fetchone()[0])
                if version > schema_version():
                    raise InputError(
                        str(self.path),
                        f"history database has schema version {version}, this nccltune knows "
                        f"up to {schema_version()}",
                        hint="upgrade nccltune (the file was written by a newer version)",
                    )
                problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check")]
                if problems != ["ok"]:
                    raise _CorruptDatabase("quick_check: " + "; ".join(problems[:5]))
                conn.execute("PRAGMA journal_mode = WAL")
            except sqlite3.DatabaseError as exc:
                if _is_corruption(exc):
                    raise _CorruptDatabase(str(exc)) from exc
                raise
            conn.execute("PRAGMA foreign_keys = ON")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read again under the write lock: another process may have migrated meanwhile.
            current = int(conn.execute("PRAGMA user_version").fetchone()[0])
            for target in range(current + 1, schema_version() + 1):
                MIGRATIONS[target - 1](conn)
                log.info("%s: schema migrated to version %d", self.path, target)
            if current < schema_version():
                conn.execute(f"PRAGMA user_version = {schema_version()}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # some errors (SQLITE_FULL, ...) have rolled back already
                conn.execute("ROLLBACK")
            raise

    def _move_aside(self, detail: str) -> None:
        if _file_id(self.path) != self._opened_file:
            # Another process moved it aside (and maybe made a new one) since we looked.
            log.info("%s was replaced while being checked; opening it again", self.path)
            return
        stamp = self._clock().astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.replace(self.path, target)
        except FileNotFoundError:
            return
        for suffix in _COMPANION_SUFFIXES:
            companion = self.path.with_name(self.path.name + suffix)
            if companion.exists():
                os.replace(companion, target.with_name(target.name + suffix))
        log.warning(
            "history database %s is corrupt (%s); moved it to %s and started a new one",
            self.path,
            detail,
            target,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _locked(self) -> BusyError:
        return BusyError(f"{self.path}: database stayed locked for {BUSY_TIMEOUT_MS} ms",
                         hint="another nccltune process is writing to it; try again")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; the lock is taken up front so that the busy timeout applies."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if _error_code(exc) in (_SQLITE_BUSY, _SQLITE_LOCKED):
                raise self._locked() from exc
            raise
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException as exc:
            if self._conn.in_transaction:  # some errors (SQLITE_FULL, ...) have rolled back already
                self._conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error) and _error_code(exc) in (_SQLITE_FULL, _SQLITE_IOERR):
                raise self._disk_error(_error_code(exc), exc) from exc
            if isinstance(exc, sqlite3.Error) and _error_code(exc) == _SQLITE_READONLY:
                raise InputError(str(self.path), f"cannot write the history database: {exc}",
                                 hint="nccltune keeps its history there: make the file and its state directory "
                                      "writable (or choose another --state-dir)") from exc
            raise

    def _now(self) -> str:
        return _iso(self._clock())

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
        _check("kind", kind, _RUN_KINDS)
        _check("backend", backend, _RUN_BACKENDS)
        topology_json, config_json = _dump(dict(topology)), _dump(dict(config))
        with self._write() as conn:
            cur = conn.execute(
                """
                INSERT INTO runs (started_at, status, kind, fingerprint, backend, demo, profile,
                    nccl_version, driver_version, torch_version, nccltune_version, hostname,
                    topology_json, config_json)
                VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
                (
                    self._now(),
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
        _check("phase", phase, _PHASES)
        _check("status", status, TRIAL_STATUSES)
        for m in measurements:
            numbers = (m.time_us, m.algbw_gbps, m.busbw_gbps, *(() if m.gpu_time_us is None else (m.gpu_time_us,)))
            if not all(math.isfinite(v) for v in numbers):
                raise ValueError(f"trial {label!r}: measurement at {m.size_bytes} bytes is not finite: {m}")
        env_json = _dump(dict(sorted(env.items())))
        nccl_json = None if nccl is None else _dump(dict(nccl))
        started = self._now() if started_at is None else _iso(started_at)
        with self._write() as conn:
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
                """
                INSERT INTO measurements (trial_id, size_bytes, time_us, algbw_gbps, busbw_gbps,
                    algo, proto, correct, collective, channels, gpu_time_us)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
                [
                    (
                        trial_id,
                        m.size_bytes,
                        m.time_us,
                        m.algbw_gbps,
                        m.busbw_gbps,
                        m.algo,
                        m.proto,
                        int(m.correct),
                        m.collective,
                        m.channels,
                        m.gpu_time_us,
                    )
                    for m in measurements
                ],
            )
        return trial_id

    def finish_run(
        self,
        run_id: int,
        *,
        status: RunStatus,
        summary: Mapping[str, Any] | None = None,
        chosen_env: Mapping[str, str] | None = None,
        published_generation: int | None = None,
        rows: Sequence[ReportRow] = (),
    ) -> None:
        """Close a run with its final status, the selector's summary, the report's rows and what
        was published.

        Raises:
            KeyError: no run with that id.
            ValueError: status 'running' or unknown, summary/chosen_env that is not JSON, a row
                that is not a finite number, or a summary that carries "rows" of its own (they
                belong in `rows`).
        """
        _check("status", status, _RUN_STATUSES - {"running"})
        if summary is not None and "rows" in summary and rows:
            raise ValueError("the report's rows go in `rows`, not in the summary")
        for r in rows:
            if not all(math.isfinite(v) for v in (r.weight, r.default_busbw_gbps, r.default_noise_pct,
                                                   r.tuned_busbw_gbps, r.ratio)):
                raise ValueError(f"report row at {r.size_bytes} bytes is not finite: {r}")
        summary_json = None if summary is None else _dump(dict(summary))
        chosen_json = None if chosen_env is None else _dump(dict(sorted(chosen_env.items())))
        with self._write() as conn:
            cur = conn.execute(
                """
                UPDATE runs SET status = ?, finished_at = ?, summary_json = ?, chosen_env_json = ?,
                    published_generation = ?
                WHERE id = ?
                """,
                (status, self._now(), summary_json, chosen_json, published_generation, run_id),
            )
            if cur.rowcount != 1:
                raise KeyError(f"no run with id {run_id}")
            conn.execute("DELETE FROM report_rows WHERE run_id = ?", (run_id,))
            _insert_report_rows(conn, run_id, rows)

    def mark_interrupted(self) -> int:
        """Turn every 'running' run into 'interrupted'; return how many there were.

        Meant for start-up after a crash, while holding the sweep lock: a run still 'running'
        then belongs to a process that died. finished_at stays empty, since when it died is
        not known.
        """
        with self._write() as conn:
            ids = [int(r[0]) for r in conn.execute("SELECT id FROM runs WHERE status = 'running'")]
            conn.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
        if ids:
            log.warning("%s: marked %d unfinished run(s) as interrupted: %s", self.path, len(ids), ids)
        return len(ids)

    # -- reading ------------------------------------------------------------------------------

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
        sql += " ORDER BY started_at DESC, id DESC LIMIT ?"
        params.append(-1 if limit is None else limit)
        return [self._run_record(row) for row in self._conn.execute(sql, params).fetchall()]

    def run(self, run_id: int) -> RunRecord | None:
        row = self._conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else self._run_record(row)

    def report_rows(self, run_id: int) -> tuple[ReportRow, ...]:
        """A run's report, size by size, in the order it was written."""
        return tuple(
            _report_row(row)
            for row in self._conn.execute("SELECT * FROM report_rows WHERE run_id = ? ORDER BY position", (run_id,))
        )

    def _run_record(self, row: sqlite3.Row) -> RunRecord:
        return _run_record(row, self.report_rows(int(row["id"])))

    def trials(self, run_id: int) -> list[TrialRecord]:
        """A run's trials in seq order, each with its measurements in the order they were added."""
        by_trial: dict[int, list[Measurement]] = {}
        for row in self._conn.execute(
            """
            SELECT m.* FROM measurements m JOIN trials t ON t.id = m.trial_id
            WHERE t.run_id = ? ORDER BY m.rowid
            """,
            (run_id,),
        ):
            by_trial.setdefault(int(row["trial_id"]), []).append(_measurement(row))
        return [
            _trial_record(row, tuple(by_trial.get(int(row["id"]), ())))
            for row in self._conn.execute("SELECT * FROM trials WHERE run_id = ? ORDER BY seq, id", (run_id,))
        ]

    def latest_run(
        self, fingerprint: str, kind: RunKind = "sweep", status: RunStatus | None = "ok"
    ) -> RunRecord | None:
        """The most recently started run for this fingerprint; `status=None` for any status."""
        sql = "SELECT * FROM runs WHERE fingerprint = ? AND kind = ?"
        params: list[Any] = [fingerprint, kind]
        if status is not None:
            sql += " AND status = ?"
            params.append(status)
        row = self._conn.execute(sql + " ORDER BY started_at DESC, id DESC LIMIT 1", params).fetchone()
        return None if row is None else self._run_record(row)

    def baseline(self, fingerprint: str) -> dict[int, float] | None:
        """Median busbw (GB/s) per size of the baseline trials of the latest ok sweep.

        This is what `verify` compares against. Only ok trials and correct measurements count.
        None when there is no ok sweep for this fingerprint or it measured no baseline.
        """
        latest = self.latest_run(fingerprint, kind="sweep")
        if latest is None:
            return None
        samples: dict[int, list[float]] = {}
        for row in self._conn.execute(
            """
            SELECT m.size_bytes, m.busbw_gbps FROM measurements m JOIN trials t ON t.id = m.trial_id
            WHERE t.run_id = ? AND t.phase = 'baseline' AND t.status = 'ok' AND m.correct = 1
            """,
            (latest.id,),
        ):
            samples.setdefault(int(row[0]), []).append(float(row[1]))
        if not samples:
            return None
        return {size: statistics.median(values) for size, values in sorted(samples.items())}

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


# ---------------------------------------------------------------------------------------------
# Row decoding


def _run_record(row: sqlite3.Row, rows: tuple[ReportRow, ...]) -> RunRecord:
    summary = _load(row["summary_json"])
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
        topology=_load(row["topology_json"]),
        config=_load(row["config_json"]),
        summary=summary,
        chosen_env=_load(row["chosen_env_json"]),
        published_generation=row["published_generation"],
        rows=rows,
    )


def _trial_record(row: sqlite3.Row, measurements: tuple[Measurement, ...]) -> TrialRecord:
    return TrialRecord(
        id=int(row["id"]),
        run_id=int(row["run_id"]),
        seq=int(row["seq"]),
        phase=typing.cast(Phase, row["phase"]),
        label=str(row["label"]),
        env=_load(row["env_json"]),
        status=typing.cast(TrialStatus, row["status"]),
        reason=row["reason"],
        wall_s=row["wall_s"],
        nccl=_load(row["nccl_json"]),
        started_at=str(row["started_at"]),
        measurements=measurements,
    )


def _measurement(row: sqlite3.Row) -> Measurement:
    return Measurement(
        size_bytes=int(row["size_bytes"]),
        time_us=float(row["time_us"]),
        algbw_gbps=float(row["algbw_gbps"]),
        busbw_gbps=float(row["busbw_gbps"]),
        algo=row["algo"],
        proto=row["proto"],
        correct=bool(row["correct"]),
        channels=row["channels"],
        gpu_time_us=row["gpu_time_us"],
        collective=str(row["collective"]),
    )


def _report_row(row: sqlite3.Row) -> ReportRow:
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
