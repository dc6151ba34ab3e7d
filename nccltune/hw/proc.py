"""What /proc says about a process: enough to tell a live rank from a reused pid."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def start_time_ticks(pid: int, proc: Path = PROC) -> int | None:
    """The process's start time (field 22 of /proc/<pid>/stat, clock ticks since boot), or None
    when there is no such process. The pair (pid, start time) names one process for the life of the
    machine; a pid alone may have been reused."""
    try:
        text = (proc / str(pid) / "stat").read_text(errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
    except (IndexError, ValueError):
        return None
