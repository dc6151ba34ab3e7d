"""What the worker's interpreter runs: torch's version, NCCL's version and NCCL's library file.

Asked of the worker itself (`worker.py --probe`), so that the sweep and the daemon see the NCCL
the trials load, found by the same rule the worker uses for its direct NCCL calls. Runs in a
child interpreter (nccltune itself never imports torch), isolated: `python -I` on the worker's
absolute path, from `/`, with a clean environment (trust.child_env), so nothing in the caller's
working directory or environment is imported.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any

from ..files.inputfile import loads_strict
from ..files.trust import child_env, python_argv
from .runner import WORKER

log = logging.getLogger(__name__)


def parse_probe(stdout: str) -> dict[str, Any]:
    """The worker's probe record (its last line of output), with the library's size and mtime
    added as `nccl_lib_stat` when the file can be read: a new install shows as a new stat.

    Raises:
        ValueError: no JSON object on the last line.
    """
    lines = stdout.strip().splitlines()
    if not lines:
        raise ValueError("the probe printed nothing")
    info = loads_strict(lines[-1])
    if not isinstance(info, dict):
        raise ValueError(f"the probe printed {lines[-1][:80]!r}, not a JSON object")
    info.pop("event", None)
    lib = info.get("nccl_lib")
    if isinstance(lib, str) and lib:
        try:
            st = os.stat(lib)
            info["nccl_lib_stat"] = [st.st_size, int(st.st_mtime)]
        except OSError:
            pass
    return info


def probe_nccl(python: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """torch and NCCL versions (and NCCL's library file) as the worker interpreter sees them;
    {"error": ...} when the probe could not run."""
    try:
        out = subprocess.run(python_argv(python, str(WORKER), "--probe"), capture_output=True, text=True,
                             timeout=timeout_s, stdin=subprocess.DEVNULL, cwd="/", env=child_env())
        return parse_probe(out.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        log.debug("probe of %s failed: %s", python, exc)
        return {"error": str(exc)}
