"""What the control channel's messages may hold, however authentic: what a joining node accepts of
the coordinator (`check_welcome`, `check_trial`) and the coordinator of a joiner's report
(`check_result`), and a report cut to fit one message (`fit_report`).

What a joiner accepts (check_welcome, check_trial), however authentic the message: ranks per node
up to this node's GPUs (or the demo's ranks); the candidate under publishing's own rules
(publish.validate_env: names and the safe value alphabet) and none of REFUSED_VARIABLES (what NCCL
reads as a path or library, and NCCL's log settings, which the joiner sets itself when nccl_debug
asks); the topology file only as text it writes itself (SHIPPED_FILES); worker arguments the runner
makes, with sizes, iterations and timeouts within the config's bounds; no NaN, infinity or
non-integer where an integer belongs. A refused trial is reported as exit 78 with the reason.

Bounds: a line is at most sealing.MAX_LINE_BYTES; a joiner's report fits in one line (rank 0's
output and NCCL log are cut to fit). Text a peer sends is escaped (logsetup.escaped) before it
reaches a log or a message.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...collectives import NAMES as COLLECTIVE_NAMES
from ...config import MAX_MESSAGE_BYTES as MAX_SIZE_BYTES
from ...errors import InputError, UnavailableError
from ...publish import PATH_VARIABLES, TOPO_FILE_VAR, validate_env
from .. import nccllog
from .sealing import MAX_LINE_BYTES, MAX_TAIL_CHARS

log = logging.getLogger(__name__)

# Variables naming a file whose text goes to the other nodes, and the name it gets there: the
# run's topology file (the candidate names it by the marker publish.OWN_TOPOLOGY), which a joining
# node writes itself and resolves the variable to.
SHIPPED_FILES = {TOPO_FILE_VAR: "ncclTopology.xml"}
# What never comes over the channel: every variable NCCL reads as a path or a library name
# (publishing's own list) but the shipped topology, which the joiner writes itself, and NCCL's log
# settings, which the joiner sets itself when the coordinator reads NCCL's log (nccl_debug).
DEBUG_VARIABLES = frozenset(nccllog.debug_env(Path("/")))
REFUSED_VARIABLES = (PATH_VARIABLES - set(SHIPPED_FILES)) | DEBUG_VARIABLES
# What one trial may ask of a joining node. Sizes are the config's own bound; the config leaves
# iterations and timeouts open above, so these bounds only keep a message from asking for days.
MAX_NODES = 4096
MAX_SIZES = 256
MAX_ITERS = 1_000_000
MAX_BLOCKS = 1000
MAX_TIMEOUT_S = 24 * 3600.0
MAX_TRIAL_SEQ = 10_000_000
MAX_FILE_CHARS = 256 << 10  # a topology file's text (a few dozen KiB on real nodes), escapes fit the line
MAX_RANK0_OUT_CHARS = 256 << 10
MAX_NCCL_LOG_CHARS = 384 << 10
_RDZV_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_INT = re.compile(r"[0-9]{1,12}")
_WORKER_CHOICES = {"--backend": ("nccl", "gloo"), "--timing": ("auto", "graph", "direct", "events")}
_WORKER_INTS = {"--warmup": (0, MAX_ITERS), "--start-warmup": (0, MAX_ITERS), "--iters": (1, MAX_ITERS),
                "--max-blocks": (1, MAX_BLOCKS)}
_WORKER_FLAGS = ("--no-check", "--no-prequeue")


def check_welcome(nnodes: int, nproc_per_node: int, max_ranks: int, who: str) -> None:
    """Raises UnavailableError (exit 69) for a job this node cannot be part of."""
    if not 2 <= nnodes <= MAX_NODES:
        raise UnavailableError(f"{who} asks for {nnodes} nodes: between 2 and {MAX_NODES}")
    if not 1 <= nproc_per_node <= max_ranks:
        raise UnavailableError(f"{who} asks for {nproc_per_node} ranks per node; this node runs 1 to {max_ranks} "
                               "(its GPUs, or the demo's ranks)")


@dataclass(frozen=True)
class TrialOrder:
    """One trial as a joining node runs it, every field checked (check_trial)."""

    seq: int
    rdzv_id: str
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    worker_args: list[str] = field(default_factory=list)
    timeout_s: float = 180.0
    nccl_debug: bool = False


def trial_seq(msg: Mapping[str, Any]) -> int | None:
    """The trial number of a trial message, or None when it has none that can be one."""
    seq = msg.get("trial")
    return seq if type(seq) is int and 1 <= seq <= MAX_TRIAL_SEQ else None


def check_trial(msg: Mapping[str, Any]) -> TrialOrder:
    """A trial message as the module's rules allow it.

    Raises:
        InputError: the first field that breaks them, named (exit 78).
    """
    seq = trial_seq(msg)
    source = f"trial {seq if seq is not None else '?'} from the coordinator"
    if seq is None:
        raise InputError(source, f"trial: {msg.get('trial')!r:.40} is not a trial number (1 to {MAX_TRIAL_SEQ})")
    rdzv_id = msg.get("rdzv_id")
    if not isinstance(rdzv_id, str) or not _RDZV_ID.fullmatch(rdzv_id):
        raise InputError(source, "rdzv_id: not a rendezvous id (letters, digits, _ . -, at most 128)")
    env = msg.get("env", {})
    if not isinstance(env, dict):
        raise InputError(source, "env: not a mapping of variables")
    env = validate_env(env, source=source)
    refused = sorted(set(env) & REFUSED_VARIABLES)
    if refused:
        raise InputError(source, f"{refused[0]}: a joining node takes no variable that names a file or library, "
                         "nor NCCL's log settings, from the coordinator")
    files = msg.get("files", {})
    if not isinstance(files, dict):
        raise InputError(source, "files: not a mapping")
    for name, text in files.items():
        if name not in SHIPPED_FILES or name not in env:
            raise InputError(source, f"files: {str(name)[:40]!r} is not a file the candidate ships")
        if not isinstance(text, str) or len(text) > MAX_FILE_CHARS:
            raise InputError(source, f"files: {name} is not a text of at most {MAX_FILE_CHARS} characters")
    for name in SHIPPED_FILES:
        if name in env and name not in files:
            raise InputError(source, f"{name}: names a file on the coordinator whose text did not come with it")
    args = msg.get("worker_args", [])
    timeout = msg.get("timeout_s", 180.0)
    if type(timeout) not in (int, float) or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise InputError(source, f"timeout_s: {timeout!r:.40} is not a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    nccl_debug = msg.get("nccl_debug", False)
    if type(nccl_debug) is not bool:
        raise InputError(source, "nccl_debug: not true or false")
    return TrialOrder(seq, rdzv_id, env, dict(files), check_worker_args(args, source), float(timeout), nccl_debug)


def check_worker_args(args: object, source: str) -> list[str]:
    """The worker's arguments as the runner makes them (trials.runner), every value in bounds.

    Raises:
        InputError: an argument the runner never makes, or a value out of bounds (exit 78).
    """
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args) or len(args) > 64:
        raise InputError(source, "worker_args: not a list of at most 64 texts")
    out = list(args)
    it = iter(enumerate(out))
    for _, flag in it:
        if flag in _WORKER_FLAGS:
            continue
        value = next(it, (0, None))[1]
        if value is None:
            raise InputError(source, f"worker_args: {flag[:40]!r} without its value")
        if flag in _WORKER_CHOICES:
            ok = value in _WORKER_CHOICES[flag]
        elif flag in _WORKER_INTS:
            low, high = _WORKER_INTS[flag]
            ok = _INT.fullmatch(value) is not None and low <= int(value) <= high
        elif flag == "--sizes":
            sizes = value.split(",")
            ok = 0 < len(sizes) <= MAX_SIZES and all(_INT.fullmatch(s) and 1 <= int(s) <= MAX_SIZE_BYTES
                                                     for s in sizes)
        elif flag == "--collectives":
            ok = all(c in COLLECTIVE_NAMES for c in value.split(","))
        elif flag == "--timeout-s":
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            ok = math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S
        else:
            raise InputError(source, f"worker_args: {flag[:40]!r} is not an argument of the worker")
        if not ok:
            raise InputError(source, f"worker_args: {flag} {value[:40]!r} is out of bounds")
    return out


def fit_report(report: dict[str, Any]) -> dict[str, Any]:
    """A joiner's report cut to one line: rank 0's output and NCCL log within their bounds, and
    the log left out (said why) if the whole would still be too long."""
    out = dict(report)
    if isinstance(out.get("rank0_out"), str):
        out["rank0_out"] = out["rank0_out"][:MAX_RANK0_OUT_CHARS]
    if isinstance(out.get("err_tail"), str):
        out["err_tail"] = out["err_tail"][:MAX_TAIL_CHARS]
    log_text = out.get("nccl_log")
    if isinstance(log_text, str) and len(log_text) > MAX_NCCL_LOG_CHARS:
        out.pop("nccl_log")
        out["nccl_log_missing"] = f"rank 0's NCCL log is over {MAX_NCCL_LOG_CHARS} characters packed; it stays there"
    # JSON escapes (and the sealed envelope's own) can make a text several times longer.
    while len(json.dumps(json.dumps(out))) > MAX_LINE_BYTES - 512:
        if "nccl_log" in out:
            out.pop("nccl_log")
            out["nccl_log_missing"] = "rank 0's NCCL log does not fit in one message; it stays there"
        elif out.get("rank0_out"):
            out["rank0_out"] = out["rank0_out"][: len(out["rank0_out"]) // 2]
        else:
            break
    return out


def check_result(doc: Mapping[str, Any], who: str) -> dict[str, Any]:
    """A joiner's report as the coordinator uses it; a malformed one becomes a failed trial."""
    text_fields = {"rank0_out": MAX_RANK0_OUT_CHARS, "err_tail": MAX_TAIL_CHARS, "nccl_log": MAX_NCCL_LOG_CHARS,
                   "nccl_log_missing": MAX_TAIL_CHARS}
    code = doc.get("exit")
    bad = None if type(code) is int else "no integer exit status"
    for name, limit in text_fields.items():
        value = doc.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > limit):
            bad = bad or f"{name} is not a text of at most {limit} characters"
    if bad:
        log.error("%s: a malformed report: %s", who, bad)
        return {"result": doc.get("result"), "exit": 1, "err_tail": f"a malformed report: {bad}"}
    return {k: doc[k] for k in ("result", "exit", "wall_s", *text_fields) if k in doc}
