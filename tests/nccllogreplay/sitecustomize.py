"""Replays a recorded NCCL log for the one-GPU verify tests (NCCL cannot run here; gloo logs nothing).

On sys.path (a .pth line of the tests' interpreter, test_verify_one_gpu.replay_python), Python
imports this at every start. A rank worker (worker.py) run with NCCL_DEBUG=INFO then writes, as it
exits, its NCCL log to NCCL_DEBUG_FILE (%p: its pid): on rank 0, the recording that
REPLAY_NCCL_LOG_<WORLD_SIZE> (else REPLAY_NCCL_LOG) names, with each "OLD=>NEW" line of
REPLAY_SUBST applied (the recording's table and plugin paths as this test published them); on
every rank, the line NCCL logs for the NCCL_HOSTID the rank got. Every other process is left alone.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys


def _write_log() -> None:
    if not sys.argv or not sys.argv[0].endswith("worker.py") or os.environ.get("NCCL_DEBUG") != "INFO":
        return
    pid = os.getpid()
    lines: list[str] = []
    source = os.environ.get(f"REPLAY_NCCL_LOG_{os.environ.get('WORLD_SIZE', '')}") or os.environ.get("REPLAY_NCCL_LOG")
    if source and os.environ.get("RANK") == "0":
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
        for pair in os.environ.get("REPLAY_SUBST", "").splitlines():
            if "=>" in pair:
                old, new = pair.split("=>", 1)
                text = text.replace(old, new)
        # The recording's own host id is replaced by the one this rank got.
        lines = [line for line in text.splitlines() if "NCCL_HOSTID set by environment" not in line]
    prefix = f"{socket.gethostname()}:{pid}:{pid} [0] NCCL INFO "
    lines.append(f"{prefix}NCCL_HOSTID set by environment to {os.environ.get('NCCL_HOSTID', '')}")
    with open(os.environ["NCCL_DEBUG_FILE"].replace("%p", str(pid)), "w", encoding="utf-8") as fh:
        fh.writelines(line + "\n" for line in lines)


atexit.register(_write_log)
