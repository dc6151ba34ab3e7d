"""Two "nodes" on this machine for the multi-node tests: the rendezvous and control ports, each
node's environment, and the processes a trial left, found by their working directory (every
torchrun agent and worker runs in its node's trial directory)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from nccltune.trials.worker import FAULT_VAR

REPO = Path(__file__).resolve().parent.parent


def node_env(**extra: str) -> dict[str, str]:
    """This environment without NCCL's, Slurm's (an enclosing allocation would pick srun) or a fault
    variable; gloo on the loopback; nccltune from this checkout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCL", "TORCH_NCCL", "SLURM_", "NOTIFY_SOCKET", "WATCHDOG_")) and k != FAULT_VAR}
    env.update({"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", **extra})
    return env


def multinode_key(root: Path) -> tuple[Path, Path]:
    """A multi-node key under `root` and a config naming it (multinode.key_file): what every node
    of a job needs before its control channel admits it."""
    from nccltune.trials.launch.sealing import write_key

    key_file = write_key(root / "keys" / "multinode.key")
    config = root / "multinode.yaml"
    config.write_text(f"multinode:\n  key_file: {key_file}\n")
    return key_file, config


def port_pair() -> int:
    """A port P with P+1 free too (rendezvous and control channel), both picked by the OS's rules."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair")


def processes_in(root: Path) -> dict[int, Path]:
    """Live processes whose working directory lies under `root`, by pid."""
    out: dict[int, Path] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = Path(os.readlink(f"/proc/{entry}/cwd"))
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and cwd.is_relative_to(root):
            out[int(entry)] = cwd
    return out


def wait_gone(root: Path, wait_s: float = 60.0) -> dict[int, Path]:
    """What is still running under `root` after `wait_s` (nothing, once every kill has landed)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = processes_in(root)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def end(proc: subprocess.Popen[bytes] | subprocess.Popen[str], wait_s: float = 30.0) -> None:
    """Stop a process the test started (its own session) and everything in that session."""
    if proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def kill_under(root: Path) -> None:
    """SIGKILL whatever still runs under `root` (a failed test's leftovers), by pid."""
    for pid in processes_in(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
