"""The history's SQLite file: opened, checked, migrated, and written one transaction at a time.

The daemon and a command-line sweep or verify may hold the file at the same time, hence WAL
mode (readers never block the writer) and a busy timeout. History is worth less than a
working tuner: a corrupt file is moved aside, with a warning naming both paths, and a fresh
one takes its place. The file lives in the state directory root shares with nobody, so a
symlinked, foreign-owned or group/world-writable file there is refused.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from ..errors import BusyError, InputError
from ..files import trust
from ..files.atomicfile import FileError
from . import migrations
from .rows import iso

# One logger for the whole store, named as its messages have always been.
log = logging.getLogger(__package__)

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


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


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


class Database:
    """One connection to the history file; several objects (or processes) may share a file.

    Raises (from the constructor):
        InputError: the file was written by a newer nccltune, or cannot be opened or written
            (missing state directory, no permission).
        BusyError: another process held the database locked past the busy timeout.
    """

    def __init__(self, path: Path, *, clock: Clock = utc_now) -> None:
        self.path = Path(path)
        self._clock = clock
        # (device, inode) of the file as first opened, so that a file another process has
        # already replaced is not moved aside a second time.
        self._opened_file: tuple[int, int] | None = None
        self.conn = self._open()

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
                if version > migrations.schema_version():
                    raise InputError(
                        str(self.path),
                        f"history database has schema version {version}, this nccltune knows "
                        f"up to {migrations.schema_version()}",
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
            for target in range(current + 1, migrations.schema_version() + 1):
                migrations.MIGRATIONS[target - 1](conn)
                log.info("%s: schema migrated to version %d", self.path, target)
            if current < migrations.schema_version():
                conn.execute(f"PRAGMA user_version = {migrations.schema_version()}")
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

    # -- using --------------------------------------------------------------------------------

    def close(self) -> None:
        self.conn.close()

    def now(self) -> str:
        return iso(self._clock())

    def _locked(self) -> BusyError:
        return BusyError(f"{self.path}: database stayed locked for {BUSY_TIMEOUT_MS} ms",
                         hint="another nccltune process is writing to it; try again")

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; the lock is taken up front so that the busy timeout applies."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if _error_code(exc) in (_SQLITE_BUSY, _SQLITE_LOCKED):
                raise self._locked() from exc
            raise
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException as exc:
            if self.conn.in_transaction:  # some errors (SQLITE_FULL, ...) have rolled back already
                self.conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error) and _error_code(exc) in (_SQLITE_FULL, _SQLITE_IOERR):
                raise self._disk_error(_error_code(exc), exc) from exc
            if isinstance(exc, sqlite3.Error) and _error_code(exc) == _SQLITE_READONLY:
                raise InputError(str(self.path), f"cannot write the history database: {exc}",
                                 hint="nccltune keeps its history there: make the file and its state directory "
                                      "writable (or choose another --state-dir)") from exc
            raise

