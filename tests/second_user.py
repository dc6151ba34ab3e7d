"""A second, unprivileged local user for the attacks a node's other users could make on root.

CI runs the tests as root; the user is created once (useradd --system, no home, no shell) and
kept. Files "she" owns are made by root and chowned to her, which is all the trust rule looks at.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

MALLORY = "nccltune-test-mallory"


def mallory_uid() -> int:
    """The second user's uid, created when absent. Skips where no such user can be made."""
    if os.geteuid() != 0:
        pytest.skip("files of another user can be built only as root (CI runs as root)")
    try:
        return pwd.getpwnam(MALLORY).pw_uid
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        pytest.skip("useradd is not available to create a second local user")
    got = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", MALLORY],
                         capture_output=True, text=True, check=False)
    try:
        return pwd.getpwnam(MALLORY).pw_uid
    except KeyError:
        pytest.skip(f"useradd could not create {MALLORY}: {got.stderr.strip()}")


def give(path: Path, uid: int) -> Path:
    """`path` (a file, directory or the link itself) now belongs to `uid`."""
    os.lchown(path, uid, uid)
    return path


def published_digests(state: Path) -> dict[str, str]:
    """Every file of the published set and the state directory's own files, links followed,
    except the history and what each run adds (its log directory, the lock)."""
    skip = ("history.db", "sweep.lock", "ranks.running")
    out: dict[str, str] = {}
    for path in sorted(state.rglob("*")):
        rel = path.relative_to(state)
        if rel.parts[0] in ("runs", "join") or path.name.startswith(skip) or not path.is_file():
            continue
        out[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
