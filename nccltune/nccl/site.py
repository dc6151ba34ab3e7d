"""What the site already gives NCCL on this node, found the way NCCL itself finds it.

* **Conf-file settings.** NCCL reads ``NCCL_CONF_FILE`` (2.23+; when set and not empty) or else
  ``~/.nccl.conf``, then always ``/etc/nccl.conf``, and applies each ``KEY=VALUE`` line with
  ``setenv(key, value, 0)``: the environment wins over every file, the first file over the second,
  and the first line of a key over a later one (``misc/param.cc``). A value there is the site's
  (a cloud image's curated ``NCCL_TOPO_FILE``, say) and counts as a pin exactly like one in the
  environment. nccltune's own managed block is not the site's and is left out.
* **A tuner.** With ``NCCL_TUNER_PLUGIN`` unset NCCL opens ``libnccl-tuner.so``; failing that it takes
  the network plugin's library (``NCCL_NET_PLUGIN``, default ``libnccl-net.so``; a name ``X`` is
  also tried as ``libnccl-net-X.so``) and looks there for ``ncclTunerPlugin_v6`` down to ``_v2``
  (``plugin/tuner.cc``, ``plugin/plugin_open.cc``). aws-ofi-nccl ships its tuner this way. The
  library is found as the dynamic loader would (a path as given; a bare name in LD_LIBRARY_PATH,
  the loader's cache, the default directories) and its symbols are read from the ELF dynamic
  symbol table: nothing of it is loaded or run.

Standard library only.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..files.inputfile import open_regular, read_bounded, read_output
from ..files.trust import system_program

log = logging.getLogger(__name__)

# The first lines of nccltune's managed block in a conf file (publish writes them); recognised by
# prefix, as the publisher does.
_BLOCK_BEGIN = "# BEGIN nccltune"
_BLOCK_END = "# END nccltune"
SYSTEM_CONF = Path("/etc/nccl.conf")
DEFAULT_NET_PLUGIN = "libnccl-net.so"
DEFAULT_TUNER_LIBRARY = "libnccl-tuner.so"
# The tuner versions NCCL looks for, newest first (plugin/tuner.cc).
TUNER_SYMBOL_RE = re.compile(rb"^ncclTunerPlugin_v([0-9]+)$")
# NCCL keeps a network plugin library open only when it defines one of these (plugin/net.cc
# ncclNetPluginLoad closes it otherwise), and only an open one is asked for a tuner.
NET_SYMBOL_RE = re.compile(rb"^ncclNetPlugin_v([0-9]+)$")
DEFAULT_LIBRARY_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib", "/usr/local/lib")
# A conf file is a few lines; anything much larger is not one.
MAX_CONF_BYTES = 1 << 20
# `ldconfig -p` prints a line per library the loader's cache holds (under 100 bytes each; a node
# with every CUDA and MPI stack installed lists a few thousand): past this it is not a cache.
MAX_LOADER_CACHE_BYTES = 8 << 20
# Bounds on what is read of a library's ELF tables.
MAX_DYNSYM_BYTES = 64 << 20
_ELF_MAGIC = b"\x7fELF"
_SHT_DYNSYM = 11


@dataclass(frozen=True)
class ConfSetting:
    value: str
    path: Path


def conf_files(env: Mapping[str, str]) -> list[Path]:
    """The conf files NCCL reads for a process with environment `env`, in NCCL's order."""
    first = env.get("NCCL_CONF_FILE") or str(Path(env.get("HOME", "/root")) / ".nccl.conf")
    return [Path(first), SYSTEM_CONF]


def conf_text(path: Path) -> str | None:
    """One conf file's text (undecodable bytes replaced, no newline translation), read within
    MAX_CONF_BYTES by files.inputfile.read_bounded, links followed as NCCL follows them (a FIFO or a
    device refused); None where it cannot be read or is longer. Every reader of NCCL's conf files
    (this module, doctor) reads them through it."""
    try:
        got = read_bounded(path, MAX_CONF_BYTES, follow=True)
    except OSError:
        return None
    return None if got.cut else got.text()


def read_conf(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of one conf file as NCCL reads them (no trimming, '#' only at the start of a
    line, lines end at '\\n' only, the first line of a key wins), less nccltune's managed block."""
    text = conf_text(path)
    if text is None:
        return {}
    out: dict[str, str] = {}
    in_block = False
    for line in text.split("\n"):
        if line.startswith(_BLOCK_BEGIN):
            in_block = True
        elif line.startswith(_BLOCK_END):
            in_block = False
        elif not in_block and line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key, value)
    return out


def conf_settings(env: Mapping[str, str], files: list[Path] | None = None) -> dict[str, ConfSetting]:
    """What the site's conf files give a process with environment `env` and that the environment
    does not set itself (the environment wins in NCCL): name -> value and the file it comes from."""
    got: dict[str, ConfSetting] = {}
    for path in conf_files(env) if files is None else files:
        for key, value in read_conf(path).items():
            if key not in env and key not in got:
                got[key] = ConfSetting(value, path)
    return got


# -- the tuner a site already has ------------------------------------------------------------


@dataclass(frozen=True)
class SiteTuner:
    """A tuner NCCL would load on this node without nccltune: what names it, and where it is."""

    value: str  # NCCL_TUNER_PLUGIN's value, or the library found
    source: str  # "the environment", a conf file, or how NCCL finds it without NCCL_TUNER_PLUGIN
    symbols: tuple[str, ...] = ()  # the ncclTunerPlugin_v* symbols found in the library, newest first

    @property
    def named(self) -> bool:
        """Named by NCCL_TUNER_PLUGIN (environment or conf file), not found by NCCL's fallbacks."""
        return not self.symbols

    def describe(self) -> str:
        if self.named:
            return f"NCCL_TUNER_PLUGIN={self.value} (from {self.source})"
        return f"the tuner in {self.value} ({', '.join(self.symbols)}; {self.source})"


def tuner_symbols(path: Path) -> tuple[str, ...]:
    """The ncclTunerPlugin_v* symbols a 64-bit ELF shared library defines, newest version first;
    () for anything else or what cannot be read. Reads the section headers and the dynamic symbol
    table only."""
    return defined_symbols(path, TUNER_SYMBOL_RE)


def defined_symbols(path: Path, pattern: re.Pattern[bytes]) -> tuple[str, ...]:
    """The symbols matching `pattern` (one group: the version) that a 64-bit ELF shared library
    defines, newest version first (see tuner_symbols)."""
    try:
        with os.fdopen(open_regular(path, follow=True)[0], "rb") as fh:
            ident = fh.read(64)
            if len(ident) < 64 or ident[:4] != _ELF_MAGIC or ident[4] != 2:  # ELFCLASS64
                return ()
            end = "<" if ident[5] == 1 else ">"
            shoff, = struct.unpack_from(end + "Q", ident, 0x28)
            shentsize, shnum = struct.unpack_from(end + "HH", ident, 0x3A)
            if shoff == 0 or shentsize < 64 or shnum == 0 or shentsize * shnum > MAX_DYNSYM_BYTES:
                return ()
            fh.seek(shoff)
            table = fh.read(shentsize * shnum)
            if len(table) < shentsize * shnum:
                return ()
            sections = [struct.unpack_from(end + "IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
            names: set[str] = set()
            for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
                if sh_type != _SHT_DYNSYM or entsize < 24 or size > MAX_DYNSYM_BYTES or link >= shnum:
                    continue
                str_offset, str_size = sections[link][4], sections[link][5]
                if str_size > MAX_DYNSYM_BYTES:
                    continue
                fh.seek(offset)
                symbols = fh.read(size)
                fh.seek(str_offset)
                strings = fh.read(str_size)
                for i in range(len(symbols) // entsize):
                    st_name, _st_info, _st_other, st_shndx = struct.unpack_from(end + "IBBH", symbols, i * entsize)
                    if st_shndx == 0 or st_name >= len(strings):  # undefined: a reference, not a definition
                        continue
                    name = strings[st_name:strings.find(b"\0", st_name)]
                    if pattern.match(name):
                        names.add(name.decode())
    except (OSError, struct.error, ValueError):
        return ()
    return tuple(sorted(names, key=lambda n: -int(n.rsplit("_v", 1)[1])))


def _loader_cache() -> dict[str, Path]:
    """Library name -> path from the dynamic loader's cache (`ldconfig -p`), first entry wins."""
    # Root runs only the system's ldconfig, never one the caller's PATH names.
    try:
        ldconfig = system_program("ldconfig", "the dynamic loader's cache (ldconfig)")
    except (InputError, OSError) as exc:
        log.info("not reading the loader's cache: %s", exc)
        return {}
    try:
        proc = subprocess.Popen([str(ldconfig), "-p"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError:
        return {}
    done = read_output(proc, limit=MAX_LOADER_CACHE_BYTES, err_limit=4096, timeout_s=10)
    if done.returncode != 0:  # killed at its bound or its timeout, or failed: no cache to go by
        return {}
    text = done.stdout.text()
    found: dict[str, Path] = {}
    for line in text.splitlines():
        name, arrow, path = line.strip().partition(" => ")
        if arrow:
            found.setdefault(name.split(" ", 1)[0], Path(path))
    return found


def find_library(name: str, env: Mapping[str, str], cache: Mapping[str, Path] | None = None) -> Path | None:
    """Where dlopen(name) would find a library for a process with environment `env`: a name with a
    '/' as given; a bare name in LD_LIBRARY_PATH, the loader's cache, then the default directories."""
    if "/" in name:
        return Path(name) if os.path.isfile(name) else None
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    for d in dirs:
        if os.path.isfile(os.path.join(d, name)):
            return Path(d, name)
    hit = (_loader_cache() if cache is None else cache).get(name)
    if hit is not None and hit.is_file():
        return hit
    for d in DEFAULT_LIBRARY_DIRS:
        if os.path.isfile(os.path.join(d, name)):
            return Path(d, name)
    return None


def _plugin_candidates(value: str | None, prefix: str) -> list[str]:
    """The names NCCL tries for a plugin value (plugin_open.cc openPluginLib): the value (or
    PREFIX.so when unset), then PREFIX-value.so for a value that is neither a path nor a library name."""
    if not value:
        return [f"{prefix}.so"]
    names = [value]
    if "/" not in value and not (value.startswith("lib") and value.endswith(".so")):
        names.append(f"{prefix}-{value}.so")
    return names


def net_plugin_library(env: Mapping[str, str], conf: Mapping[str, ConfSetting],
                       cache: Mapping[str, Path] | None = None) -> Path | None:
    """The network plugin library NCCL would keep open first, or None (NCCL_NET_PLUGIN=none, or none
    found): the first name that resolves to a library defining an ncclNetPlugin_v* symbol."""
    setting = env.get("NCCL_NET_PLUGIN")
    if setting is None and "NCCL_NET_PLUGIN" in conf:
        setting = conf["NCCL_NET_PLUGIN"].value
    if setting is not None and setting.lower() == "none":
        return None
    for entry in (setting.split(",") if setting else [None]):
        for name in _plugin_candidates(entry, DEFAULT_NET_PLUGIN.removesuffix(".so")):
            path = find_library(name, env, cache)
            if path is not None and defined_symbols(path, NET_SYMBOL_RE):
                return path
    return None


def site_tuner(env: Mapping[str, str], conf: Mapping[str, ConfSetting] | None = None, *,
               is_own: Callable[[str], bool] | None = None,
               cache: Mapping[str, Path] | None = None) -> SiteTuner | None:
    """The tuner NCCL would load for a process with environment `env` without nccltune, or None.

    NCCL_TUNER_PLUGIN from the environment or a conf file names it (``none`` too: it turns tuners
    off, which is a site decision as well); without it, ``libnccl-tuner.so`` where the loader finds
    one, else the network plugin's library when it defines a ``ncclTunerPlugin_v*`` symbol. `is_own`
    (a predicate on a value) leaves out nccltune's own tuner."""
    conf = conf_settings(env) if conf is None else conf
    if "NCCL_TUNER_PLUGIN" in env:
        value, source = env["NCCL_TUNER_PLUGIN"], "the environment"
    elif "NCCL_TUNER_PLUGIN" in conf:
        value, source = conf["NCCL_TUNER_PLUGIN"].value, str(conf["NCCL_TUNER_PLUGIN"].path)
    else:
        default = find_library(DEFAULT_TUNER_LIBRARY, env, cache)
        if default is not None and (symbols := tuner_symbols(default)):
            return SiteTuner(str(default), f"NCCL loads {DEFAULT_TUNER_LIBRARY} when NCCL_TUNER_PLUGIN is unset",
                             symbols)
        net = net_plugin_library(env, conf, cache)
        if net is not None and (symbols := tuner_symbols(net)):
            return SiteTuner(str(net), "the network plugin; NCCL takes its tuner when NCCL_TUNER_PLUGIN is unset",
                             symbols)
        return None
    if is_own is not None and is_own(value):
        return None
    return SiteTuner(value, source)
