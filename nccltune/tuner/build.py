"""Compile nccltune's tuner plugin on the node with the system C compiler.

The plugin is C with no CUDA and no libnccl dependency, so any C11 compiler builds it. Where none is
installed nothing fails: the result says the per-size table is not active and why, and the rest of
nccltune works as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

LIBRARY_NAME = "libnccl-tuner-nccltune.so"
SOURCE_NAME = "nccltune_tuner.c"
HEADER_NAME = "nccltune_tuner.h"
COMPILERS = ("cc", "gcc", "clang")
BASE_FLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra")
# -O1 and frame pointers keep sanitizer reports readable; a UB finding aborts instead of printing on.
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined")
COMPILE_TIMEOUT_S = 120


def is_own_tuner(value: str) -> bool:
    """Whether an NCCL_TUNER_PLUGIN value names nccltune's plugin (as built, or a published copy named
    libnccl-tuner-nccltune-<fingerprint>.so), not a site's tuner."""
    return value == "nccltune" or Path(value).name.startswith(LIBRARY_NAME.removesuffix(".so"))


@dataclass(frozen=True)
class BuildResult:
    """What build_plugin did: the library's path when it built, otherwise why the table is not active."""

    ok: bool
    path: Path | None
    compiler: str | None
    command: tuple[str, ...] = ()
    reason: str | None = None
    warnings: str = ""  # the compiler's diagnostics of a successful build (empty when clean)
    sanitize: bool = False

    @property
    def message(self) -> str:
        if self.ok:
            return f"tuner plugin built: {self.path} (with {self.compiler})"
        return f"per-size tuner table not active: {self.reason}"


def source_dir() -> Path:
    """The directory holding the plugin's C source and header (package data)."""
    return Path(str(resources.files("nccltune.tuner").joinpath(SOURCE_NAME))).parent


def find_compiler(cc: str | None = None) -> str | None:
    """The compiler to use: cc (a name on PATH or a path) when given, else the first of cc, gcc, clang on PATH."""
    for name in (cc,) if cc else COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def build_plugin(out_dir: Path, *, cc: str | None = None, sanitize: bool = False) -> BuildResult:
    """Compile the plugin into out_dir/libnccl-tuner-nccltune.so, replacing any older build atomically.

    The library is written to a temporary file in out_dir and renamed into place, so a process that
    loads it at the same moment sees either the old or the new library, never a partial one. Never
    raises for a missing compiler, a failed compile or an unwritable out_dir: the result says why."""
    compiler = find_compiler(cc)
    if compiler is None:
        wanted = f"compiler {cc!r} not found" if cc else f"no C compiler on PATH (looked for {', '.join(COMPILERS)})"
        log.info("per-size tuner table not active: %s", wanted)
        return BuildResult(False, None, None, reason=wanted, sanitize=sanitize)
    src = source_dir() / SOURCE_NAME
    if not src.is_file() or not (src.parent / HEADER_NAME).is_file():
        return BuildResult(False, None, compiler, reason=f"plugin source missing from the installation ({src})",
                           sanitize=sanitize)
    out_dir = Path(out_dir)
    target = out_dir / LIBRARY_NAME
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{LIBRARY_NAME}.", suffix=".tmp", dir=out_dir)
        os.close(fd)
    except OSError as e:
        return BuildResult(False, None, compiler, reason=f"cannot write to {out_dir}: {e.strerror or e}",
                           sanitize=sanitize)
    tmp = Path(tmp_name)
    cmd = (compiler, *BASE_FLAGS, *(SANITIZE_FLAGS if sanitize else ()), "-o", str(tmp), str(src))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        tmp.unlink(missing_ok=True)
        return BuildResult(False, None, compiler, cmd, reason=f"compiler did not run: {e}", sanitize=sanitize)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = proc.stderr.strip().splitlines()[-5:]
        reason = f"compiling {src.name} with {compiler} failed (exit {proc.returncode}): " + " | ".join(tail)
        log.warning("per-size tuner table not active: %s", reason)
        return BuildResult(False, None, compiler, cmd, reason=reason, sanitize=sanitize)
    try:
        tmp.chmod(0o755)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        return BuildResult(False, None, compiler, cmd, reason=f"cannot install {target}: {e.strerror or e}",
                           sanitize=sanitize)
    log.info("tuner plugin built: %s", target)
    return BuildResult(True, target, compiler, cmd, warnings=proc.stderr.strip(), sanitize=sanitize)
