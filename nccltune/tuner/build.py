"""nccltune's tuner plugin for this node: the one built with the package, else compiled here; and
its env plugin (NCCL 2.28.7 and newer), compiled here the same way.

The plugin is C with no CUDA and no libnccl dependency, so any C11 compiler builds it. A wheel built
with a compiler at hand carries it prebuilt (setup.py compiles it at build time into
``nccltune/tuner/prebuilt/``, beside a stamp naming the source it came from and the machine it runs
on); ``build_plugin`` takes that copy when it matches this installation's source and this machine,
and otherwise compiles on the node, the fallback. Where neither is possible nothing fails: the
result says the per-size table is not active and why, and the rest of nccltune works as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

LIBRARY_NAME = "libnccl-tuner-nccltune.so"
SOURCE_NAME = "nccltune_tuner.c"
HEADER_NAME = "nccltune_tuner.h"
VERSION_HEADER_NAME = "nccltune_version.h"  # shared by both plugins: NCCL version numbers
TEXT_HEADER_NAME = "nccltune_text.h"  # shared by both plugins: the bounded read and the line rules
ENV_LIBRARY_NAME = "libnccl-env-nccltune.so"
ENV_SOURCE_NAME = "nccltune_env.c"
ENV_HEADER_NAME = "nccltune_env.h"
COMPILERS = ("cc", "gcc", "clang")
BASE_FLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra")
# After the source: dladdr/dlopen/dlsym (the tuner asks the NCCL that loaded it for its version) are
# in libc since glibc 2.34 and in libdl before.
LINK_FLAGS = ("-ldl",)
# -O1 and frame pointers keep sanitizer reports readable; a UB finding aborts instead of printing on.
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined")
COMPILE_TIMEOUT_S = 120
PREBUILT_DIR = "prebuilt"
# Beside the prebuilt library: "<sha256 of the source and header> <machine>", written by setup.py.
STAMP_NAME = f"{LIBRARY_NAME}.stamp"


def is_own_tuner(value: str) -> bool:
    """Whether an NCCL_TUNER_PLUGIN value names nccltune's plugin (as built, or a published copy named
    libnccl-tuner-nccltune-<fingerprint>.so), not a site's tuner."""
    return value == "nccltune" or Path(value).name.startswith(LIBRARY_NAME.removesuffix(".so"))


@dataclass(frozen=True)
class PluginSource:
    """One of the two libraries: its file name, its C source and the headers it includes."""

    library: str
    source: str
    headers: tuple[str, ...]
    what: str  # how results name it


TUNER = PluginSource(LIBRARY_NAME, SOURCE_NAME, (HEADER_NAME, VERSION_HEADER_NAME, TEXT_HEADER_NAME), "tuner plugin")
ENV_PLUGIN = PluginSource(ENV_LIBRARY_NAME, ENV_SOURCE_NAME,
                          (ENV_HEADER_NAME, HEADER_NAME, VERSION_HEADER_NAME, TEXT_HEADER_NAME), "env plugin")


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
    prebuilt: Path | None = None  # the package's prebuilt library, when that is what path is a copy of
    what: str = TUNER.what

    @property
    def message(self) -> str:
        if self.ok and self.prebuilt is not None:
            return f"{self.what}: {self.path}, the one prebuilt with the package ({self.prebuilt})"
        if self.ok:
            return f"{self.what} built: {self.path} (with {self.compiler})"
        if self.what == ENV_PLUGIN.what:
            return f"env plugin not built: {self.reason}"
        return f"per-size tuner table not active: {self.reason}"


def source_dir() -> Path:
    """The directory holding the plugin's C source and header (package data)."""
    return Path(str(resources.files("nccltune.tuner").joinpath(SOURCE_NAME))).parent


def source_digest(directory: Path | None = None) -> str:
    """sha256 over the tuner plugin's source and headers, as shipped: what a prebuilt library must match."""
    src = directory or source_dir()
    h = hashlib.sha256()
    for name in (TUNER.source, *TUNER.headers):
        h.update((src / name).read_bytes())
    return h.hexdigest()


def stamp_text(directory: Path | None = None) -> str:
    """The stamp setup.py writes beside a library it built: source digest and machine."""
    return f"{source_digest(directory)} {platform.machine()}\n"


def prebuilt_plugin() -> tuple[Path | None, str]:
    """The package's prebuilt library when it fits this installation and machine, else None; and
    what was found (for doctor): where it is, or why it is not used."""
    directory = source_dir() / PREBUILT_DIR
    library, stamp = directory / LIBRARY_NAME, directory / STAMP_NAME
    if not library.is_file():
        return None, "this installation carries no prebuilt tuner plugin (built without a C compiler, or from source)"
    try:
        wanted, found = stamp_text(), stamp.read_text()
    except OSError as exc:
        return None, f"the prebuilt tuner plugin {library} has no readable stamp ({exc.strerror})"
    if found != wanted:
        return None, (f"the prebuilt tuner plugin {library} is for another source or machine "
                      f"(stamp {found.strip()!r}, here {wanted.strip()!r})")
    return library, f"prebuilt with the package: {library}"


def _install(source: Path, out_dir: Path) -> Path:
    """Copy `source` to out_dir/libnccl-tuner-nccltune.so through a temporary file and a rename, so a
    process loading it at that moment sees the old library or the new one, never a partial one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_file(out_dir / LIBRARY_NAME)
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out_dir / LIBRARY_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out_dir / LIBRARY_NAME


def _temp_file(target: Path) -> tuple[int, Path]:
    """A new temp file next to ``target``, named as every temp file nccltune writes
    (``.<name>.tmp-<pid>-<8 hex>``, files.atomicfile.TEMP_NAME_RE; spelt here because setup.py
    loads this module without the package), so that the next start removes what a killed build
    left (atomicfile.remove_dead_temps).

    Raises:
        OSError: it cannot be created.
    """
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600), tmp


def find_compiler(cc: str | None = None) -> str | None:
    """The compiler to use: cc (a name on PATH or a path) when given, else the first of cc, gcc, clang on PATH."""
    for name in (cc,) if cc else COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def build_plugin(out_dir: Path, *, cc: str | None = None, sanitize: bool = False) -> BuildResult:
    """Put the plugin at out_dir/libnccl-tuner-nccltune.so, replacing any older one atomically: the
    package's prebuilt library when it fits (see prebuilt_plugin), else compiled here. A compiler
    named by `cc`, or a sanitizer build, always compiles.

    The library is written to a temporary file in out_dir and renamed into place, so a process that
    loads it at the same moment sees either the old or the new library, never a partial one. Never
    raises for a missing compiler, a failed compile or an unwritable out_dir: the result says why."""
    if cc is None and not sanitize:
        prebuilt, _why = prebuilt_plugin()
        if prebuilt is not None:
            try:
                target = _install(prebuilt, Path(out_dir))
            except OSError as e:
                log.warning("cannot copy the prebuilt tuner plugin %s: %s; compiling instead", prebuilt, e)
            else:
                log.info("tuner plugin: %s (prebuilt with the package)", target)
                return BuildResult(True, target, None, prebuilt=prebuilt)
    return compile_plugin(out_dir, cc=cc, sanitize=sanitize)


def plugin_available() -> bool:
    """Whether build_plugin can give a plugin here: a prebuilt one that fits, or a compiler."""
    return prebuilt_plugin()[0] is not None or find_compiler() is not None


def build_env_plugin(out_dir: Path, *, cc: str | None = None, sanitize: bool = False) -> BuildResult:
    """Compile the env plugin into out_dir/libnccl-env-nccltune.so, as compile_plugin does the tuner."""
    return compile_plugin(out_dir, cc=cc, sanitize=sanitize, plugin=ENV_PLUGIN)


def compile_plugin(out_dir: Path, *, cc: str | None = None, sanitize: bool = False,
                   plugin: PluginSource = TUNER) -> BuildResult:
    """Compile `plugin` on this node into out_dir/<its library> (see build_plugin)."""
    what = plugin.what
    compiler = find_compiler(cc)
    if compiler is None:
        wanted = f"compiler {cc!r} not found" if cc else f"no C compiler on PATH (looked for {', '.join(COMPILERS)})"
        log.info("%s not built: %s", what, wanted)
        return BuildResult(False, None, None, reason=wanted, sanitize=sanitize, what=what)
    src = source_dir() / plugin.source
    if not src.is_file() or not all((src.parent / h).is_file() for h in plugin.headers):
        return BuildResult(False, None, compiler, reason=f"plugin source missing from the installation ({src})",
                           sanitize=sanitize, what=what)
    out_dir = Path(out_dir)
    target = out_dir / plugin.library
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = _temp_file(target)
        os.close(fd)
    except OSError as e:
        return BuildResult(False, None, compiler, reason=f"cannot write to {out_dir}: {e.strerror or e}",
                           sanitize=sanitize, what=what)
    cmd = (compiler, *BASE_FLAGS, *(SANITIZE_FLAGS if sanitize else ()), "-o", str(tmp), str(src), *LINK_FLAGS)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        tmp.unlink(missing_ok=True)
        return BuildResult(False, None, compiler, cmd, reason=f"compiler did not run: {e}", sanitize=sanitize,
                           what=what)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = proc.stderr.strip().splitlines()[-5:]
        reason = f"compiling {src.name} with {compiler} failed (exit {proc.returncode}): " + " | ".join(tail)
        log.warning("%s not built: %s", what, reason)
        return BuildResult(False, None, compiler, cmd, reason=reason, sanitize=sanitize, what=what)
    try:
        tmp.chmod(0o755)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        return BuildResult(False, None, compiler, cmd, reason=f"cannot install {target}: {e.strerror or e}",
                           sanitize=sanitize, what=what)
    log.info("tuner plugin built: %s", target)
    return BuildResult(True, target, compiler, cmd, warnings=proc.stderr.strip(), sanitize=sanitize, what=what)
