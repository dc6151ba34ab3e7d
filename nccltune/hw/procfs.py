"""procfs reader for process facts, the only reader of /proc besides hw/sysfs.py. The root is injected;
every file is read within a bound (files.inputfile.read_bounded).

- Which processes descend from a given one: the daemon must not count its own trial ranks as a
  job on the GPUs; those ranks are its descendants, found from each process's parent pid.
- When a process started: (pid, start time) names one process for the life of the machine (one
  boot: `boot_id` tells boots apart), so a record of running ranks is never fooled by a reused pid.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from ..files.inputfile import read_bounded

log = logging.getLogger(__name__)

# Far above any /proc/<pid>/stat line (a command name of at most 64 bytes, some 50 numbers) or boot_id.
MAX_PROC_BYTES = 64 << 10


def _read_proc(path: Path) -> str:
    """A /proc file's text, read by files.inputfile.read_bounded like every file another process
    shapes (a process names itself in its stat line).

    Raises:
        OSError: it cannot be read, is no regular file, or is longer than MAX_PROC_BYTES (EFBIG).
    """
    got = read_bounded(path, MAX_PROC_BYTES)
    if got.cut:
        raise OSError(errno.EFBIG, f"longer than {MAX_PROC_BYTES} bytes", str(path))
    return got.text()


def _stat_field(stat_text: str, number: int) -> int | None:
    """Field `number` (1-based, as proc(5) counts) of a /proc/<pid>/stat line, for fields after
    the command name; None when the line has no such integer field.

    The command name (field 2) is in parentheses and may itself hold spaces and parentheses,
    so the fields after it are found from the last ')'.
    """
    _, sep, rest = stat_text.rpartition(")")
    fields = rest.split()  # fields[0] is field 3 (state)
    if not sep or len(fields) < number - 2:
        return None
    try:
        return int(fields[number - 3])
    except ValueError:
        return None


def _parent_pid(stat_text: str) -> int | None:
    return _stat_field(stat_text, 4)


def _stat_of(pid: int, root: str | os.PathLike[str], number: int) -> int | None:
    """Field `number` of /proc/<pid>/stat, or None when there is no such process."""
    try:
        text = _read_proc(Path(root) / str(pid) / "stat")
    except OSError:
        return None
    return _stat_field(text, number)


def start_time_ticks(pid: int, root: str | os.PathLike[str] = "/proc") -> int | None:
    """The process's start time (field 22 of /proc/<pid>/stat, clock ticks since boot), or None
    when there is no such process."""
    return _stat_of(pid, root, 22)


def boot_id(root: str | os.PathLike[str] = "/proc") -> str | None:
    """This boot's id (/proc/sys/kernel/random/boot_id), or None where it cannot be read."""
    try:
        text = _read_proc(Path(root) / "sys" / "kernel" / "random" / "boot_id").strip()
    except OSError:
        return None
    return text if text and all(c in "0123456789abcdef-" for c in text) else None


def parent_pid(pid: int, root: str | os.PathLike[str] = "/proc") -> int | None:
    """The process's parent pid (field 4 of /proc/<pid>/stat), or None when there is no such process."""
    return _stat_of(pid, root, 4)


def parent_pids(root: str | os.PathLike[str] = "/proc") -> dict[int, int]:
    """pid -> parent pid of every process readable under `root`.

    Processes that exit while the tree is walked are skipped, as are entries that cannot be read.
    """
    out: dict[int, int] = {}
    base = Path(root)
    try:
        entries = list(os.scandir(base))
    except OSError as exc:
        log.debug("cannot list %s: %s", base, exc)
        return out
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            text = _read_proc(base / entry.name / "stat")
        except OSError:
            continue  # gone since the listing, or not ours to read
        ppid = _parent_pid(text)
        if ppid is not None:
            out[int(entry.name)] = ppid
    return out


def descendants(pid: int | None = None, root: str | os.PathLike[str] = "/proc") -> set[int]:
    """Every process below `pid` (default: this process) in the process tree, `pid` excluded."""
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for child, parent in parent_pids(root).items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child != pid:
                found.add(child)
                todo.append(child)
    return found
