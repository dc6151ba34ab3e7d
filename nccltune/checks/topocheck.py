"""`nccltune topo check XML`: does NCCL really load this topology file?

Runs a small all-reduce over all local GPUs (one rank per GPU; one rank on a one-GPU node, where
NCCL loads the topology file all the same) with NCCL_TOPO_FILE=XML, NCCL's INFO log on and
NCCL_TOPO_DUMP_FILE set, then reports: whether NCCL opened and loaded the file, any WARN or
"missing or faulty information" hints, the transports and graph NCCL chose, whether the result
was correct, and how NCCL's own re-dump differs from the file. NCCL treats an unreadable file
as absent (it silently auto-detects), which is why loading has to be checked in its own log.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UnavailableError
from ..files.atomicfile import atomic_write
from ..hw.nvml import read_nvml
from ..nccl.debuglog import NcclLog, choices_by_size, parse_nccl_log
from ..records import TrialResult
from ..topology.diff import Change, TopoDiff, diff_trees
from ..topology.ncclxml import load_xml
from ..trials.credentials import RANK_DIR
from ..trials.nccllog import MAX_LOG_BYTES, rank_logs, read_log
from ..trials.runner import Runner, find_worker_python

CHECK_SIZES = (1 << 20, 64 << 20)


@dataclass
class TopoCheck:
    xml: str
    passed: bool
    verdict: str
    loaded: bool
    open_error: str | None
    hints: list[str]
    warnings: list[str]
    errors: list[str]
    transports: dict[str, int]
    graphs: list[dict[str, Any]]
    algo_proto: dict[str, str]
    correct: bool | None
    busbw_gbps: dict[int, float]
    trial_status: str
    trial_reason: str | None
    nccl_version: str | None
    dump: str | None
    dump_diff: TopoDiff | None
    log_dir: str | None
    notes: list[str] = field(default_factory=list)
    nranks: int = 2


def verdict_of(log: NcclLog, result: TrialResult) -> tuple[bool, str]:
    """Did NCCL take the file? From its INFO log and the trial: ignored (could not open it),
    rejected (parse or attribute errors, or init failed without loading), silently not loaded,
    loaded but the all-reduce failed or was wrong, or loaded and correct."""
    loaded = bool(log.topo_loaded) and not log.topo_open_error
    correct = None if not result.sizes else all(s.correct for s in result.sizes)
    if log.topo_open_error:
        return False, f"NCCL ignored the file: could not open it ({log.topo_open_error})"
    if log.errors or (result.status in ("crashed", "error") and not loaded):
        return False, f"NCCL rejected the file: {(log.errors or [result.reason or result.status])[0]}"
    if not loaded:
        return False, "NCCL did not say it loaded the file (no 'Loading topology file' line)"
    if result.status != "ok":
        return False, f"NCCL loaded the file but the all-reduce failed: {result.reason}"
    if correct is False:
        return False, "NCCL loaded the file but the all-reduce result was wrong"
    return True, "NCCL loaded the file and the all-reduce was correct"


DUMP_NAME = "nccl-redump.xml"
ONE_RANK_NOTE = ("one GPU: NCCL ran with one rank; it loads the topology file for one rank too, and a "
                 "one-rank all-reduce moves nothing between GPUs (bus bandwidth 0)")


def _rank_logs_text(trial_dir: Path) -> str:
    """Every rank's NCCL log of the check, as one text of at most nccllog.MAX_LOG_BYTES (the ranks
    wrote them: a log that is no regular file of theirs is left out)."""
    parts: list[bytes] = []
    left = MAX_LOG_BYTES
    for path in rank_logs(trial_dir):
        if left <= 0:
            break
        try:
            parts.append(read_log(path)[:left])
        except OSError:
            continue
        left -= len(parts[-1])
    return b"\n".join(parts).decode(errors="replace")


def check_topology_file(xml: Path, *, python: str | None = None, timeout_s: float = 180.0,
                        keep_dump: Path | None = None, env: dict[str, str] | None = None,
                        gpu_count: int | None = None, bench_user: str | None = None) -> TopoCheck:
    """One rank per GPU (``gpu_count``, else as many as NVML sees; one on a one-GPU node).

    Raises: InputError when the file is not valid for NCCL's parser (checked before running);
    UnavailableError when there are no GPUs or no worker interpreter."""
    ours = load_xml(xml)  # our own dialect check first: a clear message beats an NCCL crash
    nranks = len(read_nvml().gpus) if gpu_count is None else gpu_count
    if nranks < 1:
        raise UnavailableError("no GPU to run NCCL on")
    work = Path(tempfile.mkdtemp(prefix="nccltune-topocheck-"))
    dump = keep_dump or (work / DUMP_NAME)
    base = dict(os.environ if env is None else env)
    # The re-dump is NCCL's, written by a rank: relative, so into the ranks' own directory (which
    # bench.user may write), and copied from there by root without following a link.
    base.update({"NCCL_TOPO_FILE": str(xml.resolve()), "NCCL_TOPO_DUMP_FILE": DUMP_NAME})
    runner = Runner(python=find_worker_python(python), backend="nccl", nranks=nranks,
                    base_env=base, work_dir=work, timeout_s=timeout_s, user=bench_user)
    try:
        result = runner.run({}, list(CHECK_SIZES), warmup=2, iters=5)
    finally:
        runner.close()
    try:
        redump = read_log(Path(result.log_dir or work) / RANK_DIR / DUMP_NAME)
    except OSError:  # NCCL wrote none (it failed first), or what is there is no file of its own
        redump = None
    if redump is not None:
        atomic_write(dump, redump)
    log = parse_nccl_log(_rank_logs_text(Path(result.log_dir or work)))
    dump_diff = None
    if dump.exists():
        try:
            dump_diff = diff_trees(ours.system, load_xml(dump).system)
        except Exception as exc:
            dump_diff = TopoDiff(changed=[Change(f"NCCL's re-dump could not be read: {exc}", "", None, None)])
    loaded = bool(log.topo_loaded) and not log.topo_open_error
    correct = None if not result.sizes else all(s.correct for s in result.sizes)
    passed, verdict = verdict_of(log, result)
    check = TopoCheck(
        xml=str(xml), passed=passed, verdict=verdict, loaded=loaded, open_error=log.topo_open_error,
        hints=list(log.topo_hints), warnings=list(log.warnings), errors=list(log.errors),
        transports=dict(log.transports),
        graphs=[{"pattern": g.pattern, "nchannels": g.nchannels, "bw_intra": g.bw_intra,
                 "type_intra": g.type_intra, "type_inter": g.type_inter} for g in log.graphs],
        algo_proto={str(size): c.label for size, c in choices_by_size(log).items()},
        correct=correct, busbw_gbps={s.size_bytes: s.busbw_gbps for s in result.sizes},
        trial_status=result.status, trial_reason=result.reason, nccl_version=log.version,
        dump=str(dump) if dump.exists() else None, dump_diff=dump_diff, log_dir=result.log_dir, nranks=nranks)
    if nranks == 1:
        check.notes.append(ONE_RANK_NOTE)
    if check.hints:
        check.notes.append("NCCL found missing or faulty information in the file (see hints)")
    if dump_diff is not None and not dump_diff.same:
        check.notes.append("NCCL's re-dump differs from the file beyond attributes NCCL fills in itself")
    return check
