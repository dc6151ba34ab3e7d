"""Logging for the command line and the service: one stderr handler on the 'nccltune' logger.

Under journald, lines carry the syslog priority prefix "<N>" that journald parses from a
service's stderr (SyslogLevelPrefix=, on by default), so `journalctl -p warning -u nccltune`
filters by level; journald stamps entries itself, so no timestamp is written there. Anywhere
else (a terminal, a file, a pipe) lines start with an ISO 8601 timestamp.

Text that comes from a less trusted process (a rank, the rank server, another node, NCCL's log
the ranks write) reaches the log only through `escaped`: one line, no terminal escape, so it can
neither forge a log line nor act on the terminal that shows it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import TextIO

LOGGER_NAME = "nccltune"

# What a message from a less trusted process keeps of its text, before escaping: a reason, a line
# of stderr, a peer's refusal. The longest nccltune's own messages quote (a JSON line's first 80
# characters, a rank's last line's 200) fit.
ESCAPED_CHARS = 500
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")


def escaped(text: object, limit: int | None = ESCAPED_CHARS) -> str:
    """`text` (str() of it) as one line that is safe in a log and on a terminal: every character
    that is not printable (newline, CR, tab, the C0 and C1 controls with ESC among them, the line
    and paragraph separators, bidirectional overrides) written as Python writes it escaped
    (\\n, \\x1b, \\u2028); cut to its first `limit` characters (None: whole), "..." saying so."""
    text = str(text)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]
    if _NOT_PLAIN.search(text) is not None:
        text = _NOT_PLAIN.sub(lambda m: m[0] if m[0].isprintable() else ascii(m[0])[1:-1], text)
    return text + "..." if cut else text


# sd-daemon(3) levels; logging has no NOTICE, so 5 is never written.
_PRIORITIES = (
    (logging.CRITICAL, 2),
    (logging.ERROR, 3),
    (logging.WARNING, 4),
    (logging.INFO, 6),
)
_DEBUG_PRIORITY = 7


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level; levels between the named ones round down."""
    for threshold, priority in _PRIORITIES:
        if levelno >= threshold:
            return priority
    return _DEBUG_PRIORITY


def is_journal_stream(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """Whether `stream` is the journald stream systemd connected, per systemd.exec(5).

    JOURNAL_STREAM ("<st_dev>:<st_ino>", decimal) is inherited by children whose stderr may
    have been redirected elsewhere, so it only counts when it names this very file descriptor.
    """
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        # io.StringIO and pytest's capture raise UnsupportedOperation (an OSError/ValueError).
        return False


class JournalFormatter(logging.Formatter):
    """`<N>LEVEL name: message`, the prefix repeated on every line of a multi-line record."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        # journald makes one entry per line and reads the prefix of each, so a traceback
        # without it would be filed at the default priority (info) and vanish from -p err.
        return "\n".join(prefix + line for line in super().format(record).splitlines() or [""])


class PlainFormatter(logging.Formatter):
    """`2024-05-01T12:00:00.123+02:00 LEVEL name: message`, local time with its UTC offset."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at emit time when no stream was given.

    Holding on to the sys.stderr of setup time breaks when it is later swapped (pytest's capture
    closes its stream after each test, and logging then reports "I/O operation on closed file").
    """

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self._follow_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow_stderr:
            self.stream = sys.stderr
        super().emit(record)


def setup_logging(
    level: int = logging.INFO, stream: TextIO | None = None, env: Mapping[str, str] | None = None
) -> None:
    """Configure the 'nccltune' logger (never the global root) with one handler to `stream`.

    `stream` defaults to sys.stderr, `env` to os.environ (for JOURNAL_STREAM). Calling it again
    replaces the handler installed before, so the CLI and tests can call it freely. Records still
    propagate to the root logger, which has no handler unless an embedding program adds one.
    """
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):
        if isinstance(old, _StderrHandler):
            logger.removeHandler(old)
            old.close()
    handler = _StderrHandler(stream)
    journal = is_journal_stream(stream if stream is not None else sys.stderr, env)
    handler.setFormatter(JournalFormatter() if journal else PlainFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
