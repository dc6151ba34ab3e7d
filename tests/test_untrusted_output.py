"""What root reads from the processes of the rank user is bounded in bytes and time, and their text
is escaped before it reaches a log: the one reader (files.inputfile.read_bounded), the one
escaping (logsetup.escaped), and their use for the ranks' output and NCCL's log (trials.launch,
trials.nccllog, nccl.debuglog). A rank's file of 40 GiB is a sparse one: it costs no disk, and
a reader that read it whole would need 40 GiB of memory."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest

from nccltune.files.inputfile import read_bounded
from nccltune.logsetup import escaped
from nccltune.nccl.debuglog import MAX_KEPT_MESSAGES, MAX_MESSAGE_CHARS, parse_nccl_log
from nccltune.trials import nccllog
from nccltune.trials.credentials import RANK_DIR
from nccltune.trials.launch import ERR_TAIL_BYTES, MAX_OUT_BYTES, read_text

HUGE = 40 << 30


def _sparse(path: Path, head: bytes = b"", size: int = HUGE, tail: bytes = b"") -> Path:
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size - len(tail))
        fh.seek(0, os.SEEK_END)
        fh.write(tail)
    return path


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- escaping ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "shown"), [
    ("plain text, 100% (ok) [x]", "plain text, 100% (ok) [x]"),
    ("two\nlines", "two\\nlines"),
    ("cr\rhere", "cr\\rhere"),
    ("\x1b[2J\x1b]0;title\x07", "\\x1b[2J\\x1b]0;title\\x07"),
    ("nul\x00 del\x7f c1\x85\x9b", "nul\\x00 del\\x7f c1\\x85\\x9b"),
    ("sep\u2028par\u2029rtl\u202e", "sep\\u2028par\\u2029rtl\\u202e"),
    ("tab\there", "tab\\there"),
    ("grüße, 東京", "grüße, 東京"),
])
def test_text_from_a_less_trusted_process_is_one_printable_line(text: str, shown: str) -> None:
    out = escaped(text)
    assert out == shown
    assert out.isprintable() and len(out.splitlines()) <= 1


def test_escaped_text_is_cut_and_says_so() -> None:
    assert escaped("x" * 10_000) == "x" * 500 + "..."
    assert escaped("\n" * 10, 3) == "\\n\\n\\n..."
    assert escaped("short", 3) == "sho..."
    assert escaped("a" * 600, None) == "a" * 600
    assert escaped(ValueError("bad\nline")) == "bad\\nline"


# -- the bounded reader ------------------------------------------------------------------------------------


def test_a_huge_file_is_read_within_its_bound_from_either_end(tmp_path: Path) -> None:
    path = _sparse(tmp_path / "rank0.out", head=b"first line\nsecond", tail=b"\nlast but one\nthe last line\n")
    before = _peak_mib()
    started = time.monotonic()
    head = read_bounded(path, 1 << 20)
    tail = read_bounded(path, 1 << 20, tail=True)
    assert time.monotonic() - started < 5 and _peak_mib() - before < 64
    assert head.cut and len(head.data) == 1 << 20 and head.size == HUGE
    assert head.lines()[0] == "first line"
    assert tail.cut and len(tail.data) == 1 << 20 and tail.lines()[-2:] == ["last but one", "the last line"]
    # A line longer than the bound: its end is what there is.
    assert read_bounded(_sparse(tmp_path / "one", tail=b"its end\n"), 100, tail=True).lines() == ["\0" * 92 + "its end"]
    small = read_bounded(_sparse(tmp_path / "small", size=10, tail=b"end\n"), 100, tail=True)
    assert not small.cut and small.data.endswith(b"end\n")


def test_the_reader_takes_only_a_regular_file_and_follows_no_link(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # nothing writes it: a blocking open or read would hang
    with pytest.raises(OSError, match="not a regular file"):
        read_bounded(tmp_path / "fifo", 100)
    (tmp_path / "real").write_text("root's own\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        read_bounded(tmp_path / "link", 100)
    with pytest.raises(OSError, match="not a regular file"):
        read_bounded(Path("/dev/zero"), 100)


def test_a_trials_output_is_read_within_its_bounds(tmp_path: Path) -> None:
    out = _sparse(tmp_path / "agent.out", head=b'{"event": "start"}\n')
    err = _sparse(tmp_path / "agent.err", tail=b"\nthe rank's own last words\n")
    before = _peak_mib()
    text, last = read_text(out), read_text(err, tail=True)
    assert _peak_mib() - before < 64
    assert len(text) == MAX_OUT_BYTES and text.startswith('{"event": "start"}\n')
    assert len(last) <= ERR_TAIL_BYTES and last.splitlines()[-1] == "the rank's own last words"
    assert read_text(tmp_path / "missing") == ""


# -- NCCL's log ---------------------------------------------------------------------------------------------


def test_an_nccl_log_is_read_to_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccllog, "MAX_LOG_BYTES", 1 << 20)
    path = _sparse(tmp_path / "nccl.1.log", head=b"host:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda12.9\n")
    assert len(nccllog.read_log(path)) == 1 << 20
    (tmp_path / "nccl.2.log").symlink_to("/etc/passwd")
    with pytest.raises(OSError):
        nccllog.read_log(tmp_path / "nccl.2.log")


def test_a_rank_directory_full_of_names_is_looked_at_to_its_bound(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccllog, "MAX_DIR_ENTRIES", 100)
    ranks = tmp_path / RANK_DIR
    ranks.mkdir()
    for i in range(1000):
        (ranks / f"nccl.{i}.log").write_text("")
    assert len(nccllog.rank_logs(tmp_path)) == 100
    assert nccllog.rank_logs(tmp_path / "nowhere") == []


def test_what_the_parser_keeps_of_a_hostile_log_is_escaped_and_bounded() -> None:
    prefix = "host:1:1 [0] NCCL WARN "
    lines = [
        "host:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda12.9",
        # A forged line, and an escape sequence, in one warning; and a failure in another.
        prefix + "fine\x1b[2J\x1b[1;31m WARNING forged\x85next",
        prefix + "Cuda failure 'out of memory'\x1b]0;owned\x07",
        *(prefix + f"warning {i}" for i in range(10 * MAX_KEPT_MESSAGES)),
        prefix + "w" * (10 * MAX_MESSAGE_CHARS),
        prefix + "x" * (1 << 20),  # a line no NCCL prints, skipped whole
        "host:1:1 [0] NCCL INFO NCCL_TOPO_FILE set by environment to /tmp/\x1b[31mtopo.xml",
    ]
    log = parse_nccl_log("\n".join(lines))
    kept = [*log.warnings, *log.errors, log.topo_file or ""]
    assert all(text.isprintable() for text in kept)
    assert len(log.warnings) == MAX_KEPT_MESSAGES and all(len(w) <= MAX_MESSAGE_CHARS for w in log.warnings)
    assert log.warnings[0] == "fine\\x1b[2J\\x1b[1;31m WARNING forged"  # \x85 ends a line for splitlines
    assert log.errors == ["Cuda failure 'out of memory'\\x1b]0;owned\\x07"]
    assert log.topo_file == "/tmp/\\x1b[31mtopo.xml"
    assert log.version == "2.28.9"
