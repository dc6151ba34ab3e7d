"""The launchers by name: the one table that `--launcher`, `resolve_launcher` and `make_launch` read.

Each entry says a launcher's name, the module and the function that make its `Launch` from a
request (loaded with importlib only when that launcher is chosen), and where its ranks learn their
place in the job. The table imports nothing of the launch package (and nothing but the standard
library and the standard-library-only rank entry point, trials/rankexec.py), so the command line's
parser reads the choices without loading a launcher, and a launcher module never imports this
package's `__init__` to learn its own name.

A launcher is two files: its module under trials/launch/ (a `Launch` subclass and a factory
`factory(request, shape, *, node_class, gpus) -> Launch`, importing what it needs from
trials/launch/base.py) and its entry in ENTRIES below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..rankexec import SLURM_TO_TORCH

AUTO = "auto"  # not a launcher: resolve_launcher picks one from the job's shape and Slurm
# What a rank reads of its place in the job (the worker, and torch's env:// init): torch's names.
WORKER_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
_AS_TORCH = tuple((name, name) for name in WORKER_RANK_VARS)


@dataclass(frozen=True)
class Launcher:
    """One launcher: `name` (what --launcher takes), `module` and `factory` (the function there that
    makes its Launch from a request), `rank_vars` (pairs: the variable the launcher sets in each
    rank's environment, the one of WORKER_RANK_VARS it gives the rank), and `sets_rank_vars`: who
    sets them ("launch": the Launch itself, per process; "launcher": the program it starts,
    unchanged; "rankexec": the program's own, which rankexec.py maps to torch's names)."""

    name: str
    module: str
    factory: str
    rank_vars: tuple[tuple[str, str], ...]
    sets_rank_vars: str

    def load(self) -> Callable[..., Any]:
        """The factory, its module imported on first use."""
        return getattr(importlib.import_module(self.module), self.factory)  # type: ignore[no-any-return]


ENTRIES: tuple[Launcher, ...] = (
    # One process per rank here, each given its place by LocalLaunch.rank_env.
    Launcher("local", "nccltune.trials.launch.local", "from_request", _AS_TORCH, "launch"),
    # torchrun's agent sets torch's own names for each worker.
    Launcher("torchrun", "nccltune.trials.launch.torchrun", "from_request", _AS_TORCH, "launcher"),
    # srun sets Slurm's; rankexec.py --slurm maps them (its SLURM_TO_TORCH, the one table).
    Launcher("srun", "nccltune.trials.launch.srun", "from_request", SLURM_TO_TORCH, "rankexec"),
)
LAUNCHER_NAMES = tuple(e.name for e in ENTRIES)
CHOICES = (AUTO, *LAUNCHER_NAMES)  # what --launcher accepts, in the order its help lists them
LOOPBACK = "local"  # the launcher that runs NIC loopback (one node, one rank per NIC)


def entry(name: str) -> Launcher | None:
    """The registered launcher called `name`, None for AUTO or a name not registered."""
    return next((e for e in ENTRIES if e.name == name), None)


def choices() -> tuple[str, ...]:
    """What --launcher accepts, read from ENTRIES as it is when asked (CHOICES, at import)."""
    return (AUTO, *(e.name for e in ENTRIES))
