"""The launchers by name: the one list that `--launcher` and `resolve_launcher` read.

Standard library only and importing nothing of the launch package, so that the command line's
parser reads the choices without loading a launcher, and a launcher module never imports this
package's `__init__` to learn its own name.
"""

from __future__ import annotations

AUTO = "auto"  # not a launcher: resolve_launcher picks one from the job's shape and Slurm
LAUNCHER_NAMES = ("local", "torchrun", "srun")
CHOICES = (AUTO, *LAUNCHER_NAMES)  # what --launcher accepts, in the order its help lists them
