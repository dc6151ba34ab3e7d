"""The class profile at profile.path as the daemon watches it: has the file changed, and what
the daemon last made of it.

A file is compared by what it resolves to, not by the name configured: a Kubernetes ConfigMap
update swaps a `..data` symlink to a new directory, config management renames a new file over
the old one, a shared filesystem may only change the mtime. The stamp (the file links resolve
to, its device, inode, size and mtime) changes in every one of those cases, and is read with one
stat per poll; the file itself is read only when its stamp changed (or when the node or the
config did), and applied only when its content is not what is already published.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stamp:
    """What a change of the file at the configured path changes."""

    real_path: str
    device: int
    inode: int
    size: int
    mtime_ns: int


def stamp_of(path: Path) -> Stamp | None:
    """The stamp of the file `path` resolves to (symlinks followed), None when there is none."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return Stamp(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class ProfileStatus:
    """The daemon's last look at profile.path.

    state: "absent" (no file for this node there), "in_force" (applied and valid) or "refused";
    code and reason: why it is refused (fleet.apply.REFUSAL_CODES, and the exit-78 text).
    """

    state: str
    file: str | None = None
    code: str | None = None
    reason: str | None = None
