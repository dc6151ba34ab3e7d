"""What the Slurm allocation this runs in says of itself: its nodes, their count, their CPUs, this
node's name. Read from the environment Slurm sets (and `scontrol show hostnames`); shared by the
srun launch, which runs its steps there, by a torchrun launch, which admits the allocation's nodes
first, and by resolve_launcher, which picks srun inside an allocation of several nodes."""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping

from ...errors import UnavailableError

log = logging.getLogger(__name__)


def slurm_nodes(env: Mapping[str, str], scontrol: str = "scontrol") -> list[str]:
    """The allocation's host names, in order, from `scontrol show hostnames $SLURM_JOB_NODELIST`.

    Raises:
        UnavailableError: not in an allocation, or scontrol failed (exit 69).
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UnavailableError("SLURM_JOB_NODELIST is not set: srun trials need a Slurm allocation",
                               hint="run inside sbatch/salloc, or use --launcher torchrun")
    exe = shutil.which(scontrol, path=env.get("PATH")) or scontrol
    try:
        done = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60,
                              env=dict(env), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UnavailableError(f"scontrol show hostnames failed: {exc}") from exc
    hosts = done.stdout.split()
    if done.returncode != 0 or not hosts:
        raise UnavailableError(f"scontrol show hostnames {nodelist} failed: {done.stderr.strip()[:200]}")
    return hosts


def allocation_hosts(env: Mapping[str, str]) -> list[str]:
    """The nodes of the Slurm allocation this runs in, by name; [] outside one, or where scontrol
    cannot name them (said at debug level: they only order admission, trials.launch.admission)."""
    if not env.get("SLURM_JOB_ID") or not (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")):
        return []
    try:
        return slurm_nodes(env)
    except UnavailableError as exc:
        log.debug("the allocation's nodes are not known here: %s", exc)
        return []


def slurm_node_count(env: Mapping[str, str]) -> int:
    """Nodes of the enclosing allocation; 0 outside one."""
    if not env.get("SLURM_JOB_ID"):
        return 0
    text = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return int(text) if text.isdigit() else 1


def cpus_per_node(env: Mapping[str, str]) -> list[int]:
    """The CPUs the allocation holds on each of its nodes, in node order, from
    SLURM_JOB_CPUS_PER_NODE ("2(x3),1": two on each of three nodes, then one); [] where Slurm
    does not say or says it otherwise."""
    out: list[int] = []
    for part in env.get("SLURM_JOB_CPUS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return []
        out += [int(m[1])] * int(m[2] or 1)
    return out


def this_node(env: Mapping[str, str]) -> str:
    """This node's Slurm name: SLURMD_NODENAME inside a job (several slurmd may share a host name),
    else the host name."""
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
