"""procfs reader for process facts: which processes descend from a given one. The root is injected.

The daemon must not count its own trial ranks as a job on the GPUs; those ranks are its
descendants, found here from each process's parent pid in /proc/<pid>/stat.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def _parent_pid(stat_text: str) -> int | None:
    """The ppid field of a /proc/<pid>/stat line, or None when the line is not one.

    The command name (field 2) is in parentheses and may itself hold spaces and parentheses,
    so the fields after it are found from the last ')'.
    """
    _, sep, rest = stat_text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 2:
        return None
    try:
        return int(fields[1])
    except ValueError:
        return None


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
            text = (base / entry.name / "stat").read_text(errors="replace")
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
