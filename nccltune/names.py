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
