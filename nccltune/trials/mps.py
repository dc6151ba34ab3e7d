"""CUDA MPS for rank processes that share one GPU (NCCL hosts on one GPU: verify's one-GPU check
and the bench rigs).

Without MPS, the contexts of processes on one GPU time-slice: every NCCL step waits for the other
rank's slice (a 4.5 ms floor for any all-reduce between two such ranks, measured on the lent
H100). Under the MPS control daemon the ranks' kernels run concurrently and what is left is NCCL's
socket transport over loopback (about 50 us). Starting the daemon changes no GPU setting (the
compute mode stays Default): it serves only clients that name its pipe directory, which only the
ranks nccltune starts are given. It is started where it can be: its binary in a system directory
root trusts, the GPU not in a compute mode that refuses it; otherwise the ranks time-slice, and
every output says which of the two it was (`Sharing.label`).

The daemon runs as the rank user (the ranks are its clients, and nothing root-owned need be
reachable by them); its pipe and log directories are fresh ones under the run's directory, and it
is stopped with `quit` when the ranks are done.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from ..files.trust import system_program
from .credentials import RankUser, rank_preexec

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
# Where root looks for the control binary: system directories only, never the caller's PATH.
SEARCH = ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin", "/usr/local/cuda/bin", "/usr/sbin")
START_TIMEOUT_S = 10.0
PIPE_VAR, LOG_VAR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
CONCURRENT = "ranks run concurrently under CUDA MPS"
TIME_SLICED = "ranks time-slice the one GPU (no CUDA MPS)"


@dataclass(frozen=True)
class Sharing:
    """How the ranks on one GPU share it, and what they must carry for that."""

    mps: bool
    reason: str = ""  # why not MPS
    env: dict[str, str] = field(default_factory=dict)  # the pipe and log directories for the ranks

    @property
    def label(self) -> str:
        return CONCURRENT if self.mps else f"{TIME_SLICED}: {self.reason}" if self.reason else TIME_SLICED

    def doc(self) -> dict[str, object]:
        return {"mps": self.mps, "label": self.label}


def control_binary() -> Path | None:
    """The MPS control binary in a system directory, if root may run it."""
    try:
        return system_program(CONTROL, "the CUDA MPS control binary", os.pathsep.join(SEARCH))
    except FileNotFoundError:
        return None
    except (InputError, OSError) as exc:
        log.warning("%s", exc)
        return None


def _control(binary: Path, env: dict[str, str], user: RankUser | None, stdin: str | None,
             *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), *args], input=stdin, env=env, capture_output=True, text=True,
                          timeout=START_TIMEOUT_S, cwd="/", preexec_fn=rank_preexec(os.getpid(), user),
                          check=False)


@contextmanager
def shared_gpu(work_dir: Path, user: RankUser | None, *, enabled: bool = True) -> Iterator[Sharing]:
    """Run the MPS control daemon for the ranks started inside (as the rank `user`, pipe and log
    directories under `work_dir`), or say why they time-slice; stopped on the way out."""
    if not enabled:
        yield Sharing(False, "not asked for")
        return
    binary = control_binary()
    if binary is None:
        yield Sharing(False, f"{CONTROL} is not installed in a system directory")
        return
    work_dir.mkdir(parents=True, exist_ok=True)
    top = Path(tempfile.mkdtemp(prefix="mps-", dir=work_dir))
    pipe, logs = top / "pipe", top / "log"
    for d in (pipe, logs):
        d.mkdir(mode=0o700)
        if user is not None:
            os.chown(d, user.uid, user.gid)
    if user is not None:
        os.chown(top, user.uid, user.gid)
    env = {"PATH": "/usr/bin:/bin", PIPE_VAR: str(pipe), LOG_VAR: str(logs)}
    started = False
    try:
        got: subprocess.CompletedProcess[str] | None = None
        try:
            got = _control(binary, env, user, None, "-d")
            why = f"{CONTROL} -d exited {got.returncode}: {(got.stderr or got.stdout).strip()[:200]}"
        except (OSError, subprocess.SubprocessError) as exc:
            why = f"{CONTROL} -d failed: {exc}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while got is not None and got.returncode == 0 and time.monotonic() < deadline:
            if (pipe / "control").exists():
                started = True
                break
            time.sleep(0.05)
        if not started:
            if got is not None and got.returncode == 0:
                why = f"{CONTROL} started but made no control pipe in {START_TIMEOUT_S:.0f} s"
            log.warning("CUDA MPS not started (%s): the ranks time-slice the GPU", why)
            yield Sharing(False, why)
            return
        log.info("CUDA MPS control daemon started (pipe directory %s)", pipe)
        yield Sharing(True, env={PIPE_VAR: str(pipe), LOG_VAR: str(logs)})
    finally:
        if started:
            try:
                _control(binary, env, user, "quit\n")
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("stopping the CUDA MPS control daemon: %s", exc)
        shutil.rmtree(top, ignore_errors=True)
