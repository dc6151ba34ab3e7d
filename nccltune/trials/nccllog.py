"""Where a trial's NCCL log is written, which file is rank 0's, and how it travels between nodes.

The runner reads NCCL's INFO log of global rank 0 (nccl.debuglog): TUNING lines, which carry the
algorithm and protocol per size, are printed by rank 0 alone. Every rank of a trial runs with the
same debug variables (`debug_env`), each writing `nccl.<pid>.log` in the rank directory of its
own node's trial directory (credentials.RANK_DIR: the ranks' own, read without following links).
When rank 0 ran on another node (torchrun places ranks by its rendezvous), that node sends its log
back with the trial's result over the control channel (trials.launch), compressed (`pack`), and
the coordinator writes it as RANK0_LOG in its trial directory, where `rank0_log` finds it
before any log of its own ranks.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import itertools
import logging
import os
import zlib
from pathlib import Path

from ..files.inputfile import read_bounded
from ..logsetup import escaped
from .credentials import RANK_DIR

log = logging.getLogger(__name__)

# What NCCL logs during a trial: enough to tell versions, transports, topology file use and
# the algorithm/protocol per size, into a file so that stdout stays clean JSON lines.
NCCL_DEBUG_SUBSYS = "INIT,ENV,GRAPH,TUNING,NET,P2P,SHM"
LOG_GLOB = "nccl.*.log"  # NCCL expands %p of NCCL_DEBUG_FILE to the process id
RANK0_LOG = "nccl-rank0.log"  # rank 0's log, sent by the node it ran on (outside LOG_GLOB)
# What root reads of one NCCL log (the ranks write it): a log read or unpacked beyond this is
# cut, with a warning. Rank 0 logs one TUNING line (about 90 bytes) per collective launch, so a
# trial at the defaults (5 + 20 iterations per block) logs a small part of this. Read and parsed
# whole, 64 MiB cost 7.3 s and 440 MiB of memory on a shared 2-core machine (bench/nccl_log_parse.py).
MAX_LOG_BYTES = 64 << 20
# Entries of a rank directory looked at for the logs in it: the ranks may fill it with names; a
# trial's own are a log per rank process, a cache directory and a few files.
MAX_DIR_ENTRIES = 4096


def debug_env(trial_dir: Path) -> dict[str, str]:
    """The variables every rank of a trial gets for NCCL's log, on whichever node it runs."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": NCCL_DEBUG_SUBSYS,
            "NCCL_DEBUG_FILE": str(trial_dir / RANK_DIR / "nccl.%p.log")}


def rank0_log(trial_dir: Path, rank0_pid: object) -> Path | None:
    """Rank 0's log in `trial_dir`: the one another node sent, else `nccl.<pid>.log` of rank 0's
    process, else the first log there is (nccl-tests: one process holds every rank)."""
    shipped = trial_dir / RANK0_LOG
    if shipped.is_file():
        return shipped
    logs = rank_logs(trial_dir)
    own = trial_dir / RANK_DIR / f"nccl.{rank0_pid}.log" if rank0_pid else None
    if own is not None and own in logs:
        return own
    return logs[0] if logs else None


def rank_logs(trial_dir: Path) -> list[Path]:
    """The NCCL logs (LOG_GLOB) in `trial_dir`'s rank directory, sorted, from a look at its first
    MAX_DIR_ENTRIES entries."""
    try:
        with os.scandir(trial_dir / RANK_DIR) as entries:
            names = [e.name for e in itertools.islice(entries, MAX_DIR_ENTRIES)]
    except OSError:
        return []
    return sorted(trial_dir / RANK_DIR / name for name in names if fnmatch.fnmatchcase(name, LOG_GLOB))


def read_log(path: Path) -> bytes:
    """A log's bytes, at most MAX_LOG_BYTES (the rest is cut, with a warning). The ranks wrote it in
    their own directory: a symlink is not followed, and only a regular file is read.

    Raises:
        OSError: it cannot be opened, or is not a regular file (ELOOP for a symlink).
    """
    got = read_bounded(path, MAX_LOG_BYTES)
    if got.cut:
        # The name is the ranks' (nccl.<pid>.log as they expanded it): escaped.
        log.warning("%s: over %d bytes; reading the first %d only", escaped(path), MAX_LOG_BYTES, MAX_LOG_BYTES)
    return got.data


def pack(data: bytes) -> str:
    """A log as text for a JSON message: zlib-compressed (NCCL's lines repeat a lot), base64."""
    return base64.b64encode(zlib.compress(data, 6)).decode("ascii")


def unpack(text: str) -> bytes:
    """The log `pack` made, at most MAX_LOG_BYTES of it (a peer's message could unpack to any size).

    Raises:
        ValueError: not what `pack` makes.
    """
    try:
        packed = base64.b64decode(text.encode("ascii"), validate=True)
        inflater = zlib.decompressobj()
        data = inflater.decompress(packed, MAX_LOG_BYTES)
    except (binascii.Error, UnicodeEncodeError, zlib.error) as exc:
        raise ValueError(f"not a packed NCCL log: {exc}") from exc
    if inflater.unconsumed_tail:
        log.warning("the NCCL log sent by another node unpacks to over %d bytes; keeping the first %d",
                    MAX_LOG_BYTES, MAX_LOG_BYTES)
    return data
