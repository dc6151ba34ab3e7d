"""Plays NCCL's INFO log for the multi-node tests (NCCL cannot run on this machine; gloo logs nothing).

On sys.path (a .pth line of the tests' interpreter, test_multinode.standin_python), Python
imports this at every start, isolated or not. A rank worker (worker.py) run with
NCCL_DEBUG=INFO then writes, as it exits, lines in NCCL's format to NCCL_DEBUG_FILE (%p: its
pid), as NCCL would: the version this node's STANDIN_NCCL_VERSION names, the NCCL_DEBUG_SUBSYS
it was given, and, on rank 0 only (NCCL prints TUNING lines there alone), one all-reduce choice
per size. Every other process is left alone.
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
    prefix = f"{socket.gethostname()}:{pid}:{pid} [0] NCCL INFO "
    lines = [f"NCCL version {os.environ.get('STANDIN_NCCL_VERSION', '2.28.9')}+cuda12.9",
             f"NCCL_DEBUG_SUBSYS set by environment to {os.environ.get('NCCL_DEBUG_SUBSYS', '')}"]
    if os.environ.get("RANK") == "0" and "--sizes" in sys.argv:
        sizes = sys.argv[sys.argv.index("--sizes") + 1].split(",")
        lines += [f"AllReduce: {size} Bytes -> Algo RING proto SIMPLE channel{{Lo..Hi}}={{0..1}}" for size in sizes]
    with open(os.environ["NCCL_DEBUG_FILE"].replace("%p", str(pid)), "w") as fh:
        fh.writelines(prefix + line + "\n" for line in lines)


atexit.register(_write_log)
