"""The names things go by, each spelled in one place: the CPU demo's label, which environment
variables are NCCL's (and nccltune's), how a byte count is written, and this node's short name.

Standard library only, imported from every layer.
"""

from __future__ import annotations

import re
import socket

# Shown on everything a CPU demo produces (tables, JSON documents, published files), so that
# gloo numbers are never taken for NCCL's.
DEMO_LABEL = "CPU DEMO (gloo backend): these are not NCCL numbers"

# NCCL's defaults, as every output names them: the `chosen` of a sweep or a class profile that kept
# them (what decides a published set's state "defaults"), the setting of the baseline trials (the
# report's column, the plot's line, a profile's per-node numbers), a per-size candidate that
# changes nothing.
DEFAULTS_LABEL = "NCCL defaults"

# Prefixes of the variables a sweep may set (NCCL's own and torch's NCCL settings) and, for the
# published files, nccltune's own provenance variables too.
TUNED_PREFIXES = ("NCCL", "TORCH_NCCL")
PUBLISHED_PREFIXES = (*TUNED_PREFIXES, "NCCLTUNE")


def _name_rule(prefixes: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(rf"^({'|'.join(prefixes)})_[A-Z0-9_]+$")


VARIABLE_NAME_RE = _name_rule(TUNED_PREFIXES)
# For str.startswith: a variable of the calling environment that a sweep would have to respect.
TUNED_NAME_STARTS = tuple(f"{p}_" for p in TUNED_PREFIXES)
PUBLISHED_NAME_RE = _name_rule(PUBLISHED_PREFIXES)

# What may be published: one allow-list, applied to every decider's set and to what feeds one (a
# class profile, an import's environment, a config's pins and swept values). Every NCCL_* and
# TORCH_NCCL_* name but NCCL's identity variables, and of nccltune's own NCCLTUNE_* names only
# those a published set carries for its tuner. The value rules and the variables that name files
# (publish.policy) apply on top.
#
# NCCL's identity variables tell one host, job or NVLink domain from another: each node or job has
# its own, so one value for every job of a node (or of a whole class) would make different hosts
# one host to NCCL, send every job's bootstrap to one address, or join domains that are apart.
IDENTITY_VARIABLES: dict[str, str] = {
    "NCCL_HOSTID": "names this node to NCCL; every node keeps its own",
    "NCCL_COMM_ID": "is the address of one job's bootstrap root; every job has its own",
    "NCCL_RAS_ADDR": "is the address this node's RAS thread listens on; every node has its own",
    "NCCL_MNNVL_UUID": "names the NVLink domain a node is in; NVML gives each node its own",
    "NCCL_MNNVL_CLIQUE_ID": "names the NVLink clique a node is in; NVML gives each node its own",
}
# nccltune's variables in a published set: the tuner plugin's table and the fingerprint it checks,
# and the env plugin's file (NCCLTUNE_ENV_TABLE), which the publisher writes for the generation's
# own files. Every other NCCLTUNE_* name is
# nccltune's internal (a job's NCCLTUNE_DISABLE and NCCLTUNE_JOB_NNODES, the CDI spec's
# NCCLTUNE_ENV_FILE, the launch forms' NCCLTUNE_APPLIED) or a test hook (NCCLTUNE_WORKER_FAULT),
# never a setting of a job's NCCL.
PUBLISHED_OWN = frozenset({"NCCLTUNE_TUNER_TABLE", "NCCLTUNE_TUNER_FINGERPRINT", "NCCLTUNE_ENV_TABLE"})


def unpublishable(name: str) -> str | None:
    """Why the variable ``name`` is never published (so never pinned, swept, imported or decided
    for a class either), worded to follow the name; None for a name on the allow-list."""
    if not PUBLISHED_NAME_RE.fullmatch(name):
        return "is not an NCCL_*, TORCH_NCCL_* or NCCLTUNE_* name in capitals, digits and _"
    if name in IDENTITY_VARIABLES:
        return f"{IDENTITY_VARIABLES[name]}, so it is never pinned, swept or published"
    if name.startswith("NCCLTUNE_") and name not in PUBLISHED_OWN:
        return "is nccltune's own (a switch, a job's shape or a test hook), never a published setting"
    return None

_SIZE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_size(size_bytes: int) -> str:
    """The shortest exact spelling of a byte count, one the config's size parser reads back:
    65536 -> "64KiB", 1000 -> "1000B"."""
    for unit, factor in _SIZE_UNITS:
        if size_bytes >= factor and size_bytes % factor == 0:
            return f"{size_bytes // factor}{unit}"
    return f"{size_bytes}B"


def short_hostname() -> str:
    """This node's host name without its domain, as runs and snapshots record it."""
    return socket.gethostname().split(".")[0]
