"""nccl-tests' `*_perf` binaries as an alternative measuring engine: command line and output.

Each collective has its binary (collectives.Collective.perf_binary: all_reduce_perf,
all_gather_perf, ...), found beside all_reduce_perf. Every binary drives every GPU from one
process (`-g N`) and prints one row per size in the same columns: size, count, type, redop,
root, then time/algbw/busbw/#wrong out of place and again in place. nccltune reports the
out-of-place columns (nccl-tests' headline numbers); a row counts as correct when neither
#wrong column is non-zero. The size column is the larger of one rank's send and receive
buffers, which is how collectives.py defines the size, so rows compare with the worker's.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..collectives import get as get_collective
from ..nccl.debuglog import number

BINARY = "all_reduce_perf"
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)\s+(.*)$")
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")


@dataclass(frozen=True)
class PerfRow:
    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    correct: bool
    inplace_busbw_gbps: float | None = None


def find_binary(directory: str | None) -> str | None:
    """all_reduce_perf in the configured directory, else on PATH."""
    if directory:
        candidate = Path(directory) / BINARY
        return str(candidate) if candidate.exists() else None
    return shutil.which(BINARY)


def binary_for(all_reduce_perf: str, collective: str) -> str:
    """The `*_perf` binary of `collective`, in the directory of all_reduce_perf.

    Raises:
        ValueError: an unknown collective.
    """
    return str(Path(all_reduce_perf).with_name(get_collective(collective).perf_binary))


def command(binary: str, sizes: Sequence[int], nranks: int, warmup: int, iters: int) -> list[str]:
    """One process over all GPUs; a geometric ladder from the smallest to the largest size."""
    ordered = sorted(sizes)
    factor = ordered[1] // ordered[0] if len(ordered) > 1 and ordered[0] else 2
    return [binary, "-b", str(ordered[0]), "-e", str(ordered[-1]), "-f", str(max(2, factor)),
            "-g", str(nranks), "-w", str(warmup), "-n", str(iters), "-c", "1", "-d", "float", "-o", "sum"]


def parse_output(text: str) -> tuple[list[PerfRow], str | None]:
    """Rows and the NCCL version from a `*_perf` binary's output. Lines that are not rows are skipped."""
    rows: list[PerfRow] = []
    version = None
    for line in text.splitlines():
        m = _VERSION.search(line)
        if m and version is None:
            version = m.group(1)
        if line.lstrip().startswith("#"):
            continue
        r = _ROW.match(line)
        if not r:
            continue
        fields = r.group(6).split()
        if len(fields) < 4:
            continue
        t, algbw, busbw = number(fields[0], float), number(fields[1], float), number(fields[2], float)
        if t is None or algbw is None or busbw is None:
            continue
        wrong = [w for w in (fields[3], fields[7] if len(fields) >= 8 else "0") if w.isdigit()]
        rows.append(PerfRow(size_bytes=int(r.group(1)), time_us=t, algbw_gbps=algbw, busbw_gbps=busbw,
                            correct=all(int(w) == 0 for w in wrong),
                            inplace_busbw_gbps=number(fields[6], float) if len(fields) >= 8 else None))
    return rows, version
