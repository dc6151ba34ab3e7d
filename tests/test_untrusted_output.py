"""What root reads from the processes of the rank user is bounded in bytes and time, and their text
is escaped before it reaches a log: the one reader (files.inputfile.read_bounded), the one
escaping (logsetup.escaped), and their use for the ranks' output and NCCL's log (trials.launch,
trials.nccllog, nccl.debuglog). A rank's file of 40 GiB is a sparse one: it costs no disk, and
a reader that read it whole would need 40 GiB of memory."""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO

from nccltune.checks.doctor import read_conf_file
from nccltune.files.inputfile import read_bounded
from nccltune.hw import procfs, sysfs
from nccltune.hw.sysfs import SysfsReader
from nccltune.logsetup import escaped
from nccltune.nccl import site
from nccltune.nccl.debuglog import MAX_KEPT_MESSAGES, MAX_MESSAGE_CHARS, parse_nccl_log
from nccltune.trials import nccllog
from nccltune.trials.credentials import RANK_DIR
from nccltune.trials.launch.base import ERR_TAIL_BYTES, MAX_OUT_BYTES, read_text

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


# -- /proc, sysfs, NCCL's conf files and libraries: the same reader ----------------------------------------


def _within(seconds: float, read: Callable[[], object], *fifos: Path) -> object:
    """What `read` returns, failing (after letting it go: each FIFO opened for writing) where it
    hangs, as a blocking open of a FIFO nothing writes would."""
    got: list[object] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            got.append(read())
        except BaseException as exc:  # raised again below, in the test's own thread
            failed.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(seconds)
        pytest.fail(f"the reader hung on {', '.join(map(str, fifos))}")
    if failed:
        raise failed[0]
    return got[0]


def test_a_file_that_claims_another_size_is_cut_by_what_the_read_found(tmp_path: Path) -> None:
    """A sysfs attribute says 4096 bytes and holds a few; a /proc file says 0 and holds more."""
    candidates = [Path("/sys/devices/system/cpu/online"), *sorted(Path("/sys/class/net").glob("*/operstate"))]
    attributes = [p for p in candidates if p.is_file()]
    if not attributes:
        pytest.skip("no sysfs here")
    got = read_bounded(attributes[0], 1024)
    assert os.stat(attributes[0]).st_size > len(got.data) > 0
    assert not got.cut and got.size == len(got.data)
    stat_line = read_bounded(Path("/proc/self/stat"), 16)
    assert os.stat("/proc/self/stat").st_size == 0
    assert stat_line.cut and len(stat_line.data) == 16
    assert not read_bounded(Path("/proc/self/stat"), 1 << 16).cut


def test_follow_reads_through_a_link_but_still_only_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "real").write_text("the site's own\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_bounded(tmp_path / "link", 100, follow=True).text() == "the site's own\n"
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        _within(10, lambda: read_bounded(tmp_path / "to-fifo", 100, follow=True), tmp_path / "fifo")


def test_proc_and_sysfs_readers_take_no_fifo_and_no_file_past_their_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    proc = tmp_path / "proc"
    for pid in (123, 124):
        (proc / str(pid)).mkdir(parents=True)
    os.mkfifo(proc / "123" / "stat")
    (proc / "124" / "stat").write_text("124 (a (b) c) S 1 124 124 0 -1\n")
    (proc / "sys" / "kernel" / "random").mkdir(parents=True)
    os.mkfifo(proc / "sys" / "kernel" / "random" / "boot_id")
    fifos = (proc / "123" / "stat", proc / "sys" / "kernel" / "random" / "boot_id")
    assert _within(10, lambda: procfs.parent_pids(proc), *fifos) == {124: 1}
    assert _within(10, lambda: procfs.boot_id(proc), *fifos) is None
    (proc / "125").mkdir()
    (proc / "125" / "stat").write_text("125 (x) S 1" + " 0" * procfs.MAX_PROC_BYTES + "\n")
    assert procfs.parent_pid(125, proc) is None

    os.mkfifo(tmp_path / "cpuinfo")
    reader = SysfsReader(tmp_path)
    assert _within(10, lambda: reader._read("cpuinfo"), tmp_path / "cpuinfo") is None
    monkeypatch.setattr(sysfs, "MAX_FILE_BYTES", 64)
    (tmp_path / "big").write_text("x" * 65)
    (tmp_path / "fits").write_text("x" * 63 + "\n")
    with caplog.at_level(logging.WARNING, logger=sysfs.__name__):
        assert reader._read("big") is None
    assert f"{tmp_path / 'big'}: longer than 64 bytes" in caplog.text
    assert reader._read("fits") == "x" * 63


def test_nccl_conf_files_and_libraries_are_read_as_regular_files_within_bounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "fifo.conf")
    fifo = tmp_path / "fifo.conf"
    assert _within(10, lambda: site.read_conf(fifo), fifo) == {}
    assert _within(10, lambda: read_conf_file(fifo), fifo) == {}
    assert _within(10, lambda: site.defined_symbols(fifo, site.TUNER_SYMBOL_RE), fifo) == ()
    # NCCL follows a link to its conf file: so do both readers.
    (tmp_path / "real.conf").write_text("NCCL_ALGO=Ring\n")
    (tmp_path / "nccl.conf").symlink_to(tmp_path / "real.conf")
    assert site.read_conf(tmp_path / "nccl.conf") == read_conf_file(tmp_path / "nccl.conf") == {"NCCL_ALGO": "Ring"}
    monkeypatch.setattr(site, "MAX_CONF_BYTES", 8)
    assert site.read_conf(tmp_path / "nccl.conf") == read_conf_file(tmp_path / "nccl.conf") == {}


# Modules that read what other processes and users shape: /proc, sysfs, NCCL's files, a rank's output.
# The worker and the rank server run in an interpreter of their own and import nothing of nccltune.
UNTRUSTED_READERS = ["nccltune/hw", "nccltune/nccl", "nccltune/trials", "nccltune/checks"]
ISOLATED = {"nccltune/trials/worker.py", "nccltune/trials/rankserver.py"}


def _whole_reads(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("read_text", "read_bytes"):
            found.append((node.lineno, func.attr))
            continue
        builtin = isinstance(func, ast.Name) and func.id == "open"
        method = (isinstance(func, ast.Attribute) and func.attr == "open"
                  and not (isinstance(func.value, ast.Name) and func.value.id in ("os", "Held")))
        if builtin or method:
            rest = node.args[1:] if builtin else node.args[:1]
            mode = next((k.value for k in node.keywords if k.arg == "mode"), rest[0] if rest else None)
            text = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"
            if not set(text) & set("wax+"):
                found.append((node.lineno, "open"))
    return found


def test_what_other_processes_shape_is_read_only_by_the_bounded_reader() -> None:
    offenders = []
    for top in UNTRUSTED_READERS:
        for path in sorted((REPO / top).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if name not in ISOLATED:
                offenders += [f"{name}:{line}: {what}" for line, what in _whole_reads(ast.parse(path.read_text()))]
    assert not offenders, "read with files.inputfile.read_bounded (or read_input_file):\n" + "\n".join(offenders)
    code = "p.read_text()\nopen(p)\nopen(p, 'rb')\nopen(p, 'wb')\np.open(mode='a')\nos.open(p, 0)\nPath(p).open()\n"
    assert [what for _, what in sorted(_whole_reads(ast.parse(code)))] == ["read_text", "open", "open", "open"]
