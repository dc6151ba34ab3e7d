"""Log line format: plain with a timestamp, or journald priority prefixes on the journal stream."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest

from nccltune.logsetup import setup_logging, syslog_priority

TIMESTAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"


@pytest.fixture(autouse=True)
def restore_nccltune_logger() -> Iterator[None]:
    logger = logging.getLogger("nccltune")
    handlers, level = list(logger.handlers), logger.level
    yield
    for handler in list(logger.handlers):
        if handler not in handlers:
            logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def log_file(tmp_path: Path) -> Iterator[TextIO]:
    with open(tmp_path / "stderr.log", "w+", encoding="utf-8") as f:
        yield f


def journal_env(stream: TextIO) -> dict[str, str]:
    st = os.fstat(stream.fileno())
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


def written(stream: TextIO) -> str:
    stream.flush()
    stream.seek(0)
    return stream.read()


def test_plain_lines_carry_an_iso_timestamp(log_file: TextIO) -> None:
    setup_logging(stream=log_file, env={})
    logging.getLogger("nccltune.daemon").info("sweep done in %.1f s", 12.25)
    assert re.fullmatch(TIMESTAMP + r" INFO nccltune\.daemon: sweep done in 12\.2 s\n", written(log_file))


def test_journald_prefix_when_journal_stream_is_this_fd(log_file: TextIO) -> None:
    setup_logging(level=logging.DEBUG, stream=log_file, env=journal_env(log_file))
    log = logging.getLogger("nccltune.sweep")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    log.critical("c")
    assert written(log_file) == (
        "<7>DEBUG nccltune.sweep: d\n"
        "<6>INFO nccltune.sweep: i\n"
        "<4>WARNING nccltune.sweep: w\n"
        "<3>ERROR nccltune.sweep: e\n"
        "<2>CRITICAL nccltune.sweep: c\n"
    )


def test_journal_stream_of_another_file_is_ignored(log_file: TextIO, tmp_path: Path) -> None:
    # A child inherits JOURNAL_STREAM even when its stderr was redirected to a file.
    with open(tmp_path / "other", "w") as other:
        setup_logging(stream=log_file, env=journal_env(other))
    logging.getLogger("nccltune").warning("careful")
    assert re.fullmatch(TIMESTAMP + r" WARNING nccltune: careful\n", written(log_file))


@pytest.mark.parametrize("value", ["", "garbage", "1:", ":2", "a:b"])
def test_malformed_journal_stream_means_plain(log_file: TextIO, value: str) -> None:
    setup_logging(stream=log_file, env={"JOURNAL_STREAM": value})
    logging.getLogger("nccltune").info("x")
    assert not written(log_file).startswith("<")


def test_stream_without_fd_is_plain() -> None:
    stream = io.StringIO()
    setup_logging(stream=stream, env={"JOURNAL_STREAM": "1:2"})
    logging.getLogger("nccltune").info("x")
    assert re.fullmatch(TIMESTAMP + r" INFO nccltune: x\n", stream.getvalue())


def test_multi_line_messages_prefixed_on_every_line(log_file: TextIO) -> None:
    setup_logging(stream=log_file, env=journal_env(log_file))
    log = logging.getLogger("nccltune.bench")
    log.warning("two\nlines")
    try:
        raise RuntimeError("NCCL error: unhandled cuda error")
    except RuntimeError:
        log.exception("trial failed")
    lines = written(log_file).splitlines()
    assert lines[:3] == [
        "<4>WARNING nccltune.bench: two",
        "<4>lines",
        "<3>ERROR nccltune.bench: trial failed",
    ]
    assert lines[3] == "<3>Traceback (most recent call last):"
    assert lines[-1] == "<3>RuntimeError: NCCL error: unhandled cuda error"
    assert all(line.startswith("<3>") for line in lines[2:])


def test_level_filters(log_file: TextIO) -> None:
    setup_logging(level=logging.WARNING, stream=log_file, env={})
    logging.getLogger("nccltune.x").info("hidden")
    logging.getLogger("nccltune.x").warning("shown")
    assert "hidden" not in written(log_file)
    assert "shown" in written(log_file)


def test_one_handler_and_global_root_untouched(log_file: TextIO, tmp_path: Path) -> None:
    root_handlers = list(logging.getLogger().handlers)
    setup_logging(stream=log_file, env={})
    with open(tmp_path / "second", "w+") as second:
        setup_logging(stream=second, env={})
        logging.getLogger("nccltune").info("once")
        assert written(second).count("once") == 1
    assert "once" not in written(log_file)
    assert logging.getLogger().handlers == root_handlers
    assert len(logging.getLogger("nccltune").handlers) == 1


def test_default_stream_is_current_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(env={})
    logging.getLogger("nccltune").error("to stderr")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(TIMESTAMP + r" ERROR nccltune: to stderr\n", captured.err)


@pytest.mark.parametrize(
    ("levelno", "priority"),
    [
        (logging.DEBUG, 7),
        (5, 7),
        (logging.INFO, 6),
        (25, 6),
        (logging.WARNING, 4),
        (logging.ERROR, 3),
        (60, 2),
    ],
)
def test_syslog_priority(levelno: int, priority: int) -> None:
    assert syslog_priority(levelno) == priority
