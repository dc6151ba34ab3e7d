"""Publisher: the only module that writes the files job launchers read.

Outputs (DESIGN.md section 3), one *set* per publish, in the publish directory::

    <publish_dir>/generations/<N>/nccl.sh          export NAME='value' lines (``. nccl.sh``): every job
    <publish_dir>/generations/<N>/nccl.env         NAME=value lines (systemd EnvironmentFile=, docker --env-file):
                                                   every job
    <publish_dir>/generations/<N>/nccl-single-node.sh   the same two forms of the part measured for
    <publish_dir>/generations/<N>/nccl-single-node.env  single-node jobs only (may hold no variable)
    <publish_dir>/generations/<N>/nccl.json        both parts, labelled, with their provenance
    <publish_dir>/generations/<N>/ncclTopology.xml when a topology is published with the set
    <publish_dir>/generations/<N>/libnccl-tuner-nccltune.so, tuner-table.txt   when a tuner is published
    <publish_dir>/generations/last                 the last generation number handed out
    <publish_dir>/current -> generations/<N>       the one switch
    <publish_dir>/nccl.sh -> current/nccl.sh       (and the other four): the paths users know

The set has two scopes. The *every-job* part (nccl.sh, nccl.env, ``env`` in nccl.json, the
nccl.conf block) fits every job on the node whatever its shape: the topology file, the policy
variables, the operator's pins, the tuner plugin and its table (whose entries apply only to the
communicator shape they were measured for). The *single-node* part (nccl-single-node.sh/.env,
``single_node_env``) holds tuned global variables that were measured between this node's GPUs
only; launchers add it only for a job known to run on this one node (``job_env``), so a
multi-node job never receives a value measured on one node.

plus, optionally, a managed block in an NCCL conf file (``/etc/nccl.conf``), which NCCL reads itself.

The set is replaced as one unit. Under the publish lock (an flock on the publish directory
itself, so two publishers never interleave) a publish takes the next generation number and
records it in ``generations/last`` first (so a number is never handed out twice, even after a
crash), writes the whole set into a hidden ``generations/.<N>.tmp-*`` directory (each file
fsync'ed), renames it to ``generations/<N>``, and then switches ``current`` with one rename of a
symlink. A reader that resolves ``current`` once (``read_set``, ``nccltune env``/``exec``, the
doctor, the launchers) sees generation N or N+1, never a mix; a kill at any point leaves the old
set published and at most a hidden directory that the next publish removes. Every file carries its
generation (``# generation: N``, ``provenance.generation``) and readers refuse a set whose files
disagree. The newest ``KEEP_GENERATIONS`` generations stay on disk, so the NCCL_TOPO_FILE of a job
started on an older one stays valid while it runs.

Rules that keep a launcher from ever sourcing something wrong:

1. Values are restricted to a small safe character set, so the very same bytes mean the same
   thing unquoted in every consumer: a POSIX shell, systemd (which interprets quotes, backslashes
   and ``$``), docker (which does not strip quotes) and NCCL's conf parser (which takes the rest of
   the line verbatim). Anything outside the set is refused before a byte is written.
2. Variables that make NCCL load code or open files (``PATH_VARIABLES``: NCCL_NET_PLUGIN,
   NCCL_TUNER_PLUGIN, NCCL_PROFILER_PLUGIN, NCCL_TOPO_FILE, NCCL_GRAPH_FILE, NCCL_CONF_FILE,
   NCCL_DEBUG_FILE, NCCL_TOPO_DUMP_FILE, NCCL_GRAPH_DUMP_FILE, NCCLTUNE_TUNER_TABLE ...) are published
   only as what nccltune wrote itself: NCCL_TOPO_FILE as the generation's own topology file,
   NCCL_TUNER_PLUGIN and NCCLTUNE_TUNER_TABLE as the generation's own plugin and table. Any other value of
   them, from a sweep candidate, a pin or the environment, is refused (exit 78) before the first
   trial: a tuning file must never make every job on the node load a library or write a file
   that someone chose by editing a config.
3. Every file and directory is created through O_NOFOLLOW/O_EXCL opens in directories that pass
   the trust rule (``nccltune.trust``): owned by root or the user running nccltune, writable by
   nobody else.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import time
import unicodedata
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import trust
from .atomicfile import STALE_TEMP_AGE_S as STALE_TEMP_AGE_S  # re-exported for older callers
from .atomicfile import (
    TEMP_INFIX,
    FileError,
    clean_stale_temps,
    fail_without_temp,
    fsync_dir,
    remove_quietly,
    replace_file,
)
from .atomicfile import atomic_write as atomic_write  # re-exported for older callers
from .errors import BusyError, InputError, UsageError
from .names import DEMO_LABEL, PUBLISHED_NAME_RE
from .trust import CLOEXEC, NOFOLLOW

# Kept under their old names for code that imports them from here.
PublishError = FileError

log = logging.getLogger(__name__)

NAME_RE = PUBLISHED_NAME_RE

# NCCL's conf parser (setEnvFile in src/misc/param.cc) copies at most 1023 bytes of a name and of a
# value into 1024-byte buffers; longer values are cut silently, and NCCL releases before the
# std::min(1023, s) fix wrote the name's terminator past the buffer. Stay within both limits.
MAX_VALUE_CHARS = 1023
MAX_NAME_CHARS = 1023

# Letters, digits and "_./:,=+^@%-" cover what NCCL values need (Ring, allreduce:tree,ring,
# ^LL128, =eth0, mlx5_0:1, /path/ncclTopology.xml, %h.%p in NCCL_DEBUG_FILE) and mean the same
# unquoted to a shell, systemd, docker --env-file and NCCL's conf parser.
SAFE_VALUE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./:,=+^@%-")
_SAFE_VALUE_DESCRIPTION = "letters, digits and _ . / : , = + ^ @ % -"

SCHEMA_VERSION = 1

SH_NAME = "nccl.sh"
ENV_NAME = "nccl.env"
JSON_NAME = "nccl.json"
TOPOLOGY_NAME = "ncclTopology.xml"
SINGLE_SH_NAME = "nccl-single-node.sh"
SINGLE_ENV_NAME = "nccl-single-node.env"
TUNER_PLUGIN_NAME = "libnccl-tuner-nccltune.so"
TUNER_TABLE_NAME = "tuner-table.txt"
PUBLISHED_NAMES = (SH_NAME, ENV_NAME, JSON_NAME, SINGLE_SH_NAME, SINGLE_ENV_NAME)
# The labels of the two scopes in nccl.json, and which jobs get each.
EVERY_JOB = "every_job"
SINGLE_NODE = "single_node"
SCOPE_APPLIES_TO = {
    EVERY_JOB: "every job on this node, whatever its shape",
    SINGLE_NODE: "only jobs known to run on this one node (torchrun --standalone or --nnodes 1, a one-node "
                 "Slurm job, nccltune exec --nnodes 1, NCCLTUNE_JOB_NNODES=1)",
}
SCOPE_FILES = {EVERY_JOB: (SH_NAME, ENV_NAME), SINGLE_NODE: (SINGLE_SH_NAME, SINGLE_ENV_NAME)}
# Set by a job's launcher to say how many nodes the job spans; "1" adds the single-node part.
JOB_NNODES_VAR = "NCCLTUNE_JOB_NNODES"
TUNER_PLUGIN_VAR = "NCCL_TUNER_PLUGIN"
TUNER_TABLE_VAR = "NCCLTUNE_TUNER_TABLE"
TUNER_FINGERPRINT_VAR = "NCCLTUNE_TUNER_FINGERPRINT"
CURRENT_NAME = "current"
GENERATIONS_DIR = "generations"
COUNTER_NAME = "last"
# Generations kept on disk (the current one included): enough for jobs started on an older one.
KEEP_GENERATIONS = 4
# What nccltune writes is a few KiB; a published file beyond this is not one of ours.
MAX_PUBLISHED_BYTES = 1 << 20

CONF_BEGIN = "# BEGIN nccltune managed block (do not edit)"
CONF_END = "# END nccltune managed block"
# Markers are recognised by prefix so that an edited marker text is still seen as a marker (and a
# block with a mangled END is refused) rather than silently growing a second block.
_CONF_BEGIN_PREFIX = b"# BEGIN nccltune"
_CONF_END_PREFIX = b"# END nccltune"

DEMO_LINE = f"# {DEMO_LABEL} and must not be used on a GPU node."

_LOCK_TIMEOUT_S = 10.0
_LOCK_POLL_S = 0.05


@dataclass(frozen=True)
class Provenance:
    """Where a published environment comes from; rendered into every file's header.

    ``gains`` maps a message-size bucket label (for example ``"64MiB"``) to the tuned/default
    bus-bandwidth ratio measured for it. ``created_at`` is passed in (ISO 8601) so that the clock
    stays injectable.
    """

    nccltune_version: str
    created_at: str
    topology_fingerprint: str
    nccl_version: str | None
    backend: str
    demo: bool
    profile: str | None
    gains: Mapping[str, float] = field(default_factory=dict)
    note: str | None = None
    # Hash of everything a tuning depends on besides the topology (NCCL version, nccltune version,
    # sweep settings): the daemon re-tunes when it no longer matches.
    tuning_fingerprint: str | None = None
    # "tuned" after a sweep; "safe" when republished without tuned values (topology changed).
    state: str = "tuned"
    # The class profile the values come from (file, path, sha256, class_id, chosen, decided_at,
    # nodes), in nccl.json only; None for a node's own decision.
    class_profile: Mapping[str, str | int] | None = None


@dataclass(frozen=True)
class PublishedFiles:
    """What one publish wrote: the three well-known paths (links into ``current``), the generation,
    and the generation's own topology file when one was published."""

    sh_path: Path
    env_path: Path
    json_path: Path
    generation: int
    topology_path: Path | None = None
    single_sh_path: Path | None = None
    single_env_path: Path | None = None
    tuner_plugin_path: Path | None = None
    tuner_table_path: Path | None = None
    # The variables as written: the generation's own topology file and tuner copies named.
    env: dict[str, str] = field(default_factory=dict)
    single_node_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tuner:
    """The tuner plugin and its table, published as files of the generation (every job gets them:
    a table entry applies only to the communicator shape it was measured for)."""

    plugin: bytes | Path  # the built shared library, or its path
    table_text: str

    def plugin_bytes(self) -> bytes:
        """Raises: PublishError when the library cannot be read (exit 1)."""
        if isinstance(self.plugin, bytes):
            return self.plugin
        try:
            return Path(self.plugin).read_bytes()
        except OSError as exc:
            raise PublishError(Path(self.plugin), exc, action="cannot read") from exc


# -- validation ------------------------------------------------------------------------------


def validate_env(env: Mapping[str, str], source: str = "environment") -> dict[str, str]:
    """Check every name and value; return a copy sorted by name.

    Raises:
        InputError: a name outside NAME_RE, or a value that is empty, longer than 1023 characters
            or holds a character outside the safe set; the message names the variable, the
            character and ``source``. Exit 78.
    """
    clean: dict[str, str] = {}
    for name in sorted(env, key=str):
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise InputError(
                source,
                f"invalid variable name {name!r}",
                hint="names must match NCCL_*, TORCH_NCCL_* or NCCLTUNE_* in upper case, digits and _",
            )
        if len(name) > MAX_NAME_CHARS:
            raise InputError(source, f"{name[:40]}...: name longer than {MAX_NAME_CHARS} characters")
        value = env[name]
        if not isinstance(value, str):
            raise InputError(source, f"{name}: value must be a string, not {type(value).__name__}")
        if not value:
            raise InputError(
                source, f"{name}: empty value", hint="leave the variable out to keep NCCL's default"
            )
        if len(value) > MAX_VALUE_CHARS:
            raise InputError(
                source,
                f"{name}: value is {len(value)} characters long; NCCL's conf-file limit is {MAX_VALUE_CHARS}",
            )
        for pos, ch in enumerate(value):
            if ch not in SAFE_VALUE_CHARS:
                raise InputError(
                    source,
                    f"{name}: value contains the forbidden character {ch!r} at position {pos}",
                    hint=f"allowed are {_SAFE_VALUE_DESCRIPTION}, so that the value means the same "
                    "unquoted in a shell, systemd, docker --env-file and /etc/nccl.conf",
                )
        clean[name] = value
    return clean


def _check_provenance(prov: Provenance) -> None:
    """Refuse provenance that cannot be rendered faithfully (non-finite gains would be invalid JSON).

    Raises:
        InputError: a field of the wrong type or a non-finite gain (exit 78).
    """
    for key in ("nccltune_version", "created_at", "topology_fingerprint", "backend"):
        if not isinstance(getattr(prov, key), str):
            raise InputError("provenance", f"{key}: {getattr(prov, key)!r} is not a string")
    for key in ("nccl_version", "profile", "note", "tuning_fingerprint"):
        value = getattr(prov, key)
        if value is not None and not isinstance(value, str):
            raise InputError("provenance", f"{key}: {value!r} is neither a string nor null")
    for label, ratio in prov.gains.items():
        if not isinstance(label, str):
            raise InputError("provenance", f"gains: bucket label {label!r} is not a string")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
            raise InputError("provenance", f"gains[{label!r}]: {ratio!r} is not a finite number")
    if not isinstance(prov.demo, bool):
        raise InputError("provenance", f"demo: {prov.demo!r} is not a boolean")
    for key, value in (prov.class_profile or {}).items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InputError("provenance", f"class_profile[{key!r}]: {value!r} is neither a string nor an integer")


# -- rendering -------------------------------------------------------------------------------


def _header_value(value: str, *, nccl_conf: bool = False) -> str:
    """One header value on one line: control and line-separator characters become '?'.

    For an NCCL conf file '=' also becomes ':': NCCL releases whose setEnvFile lacks the
    ``line[0] == '#'`` check (the 2.x param.h/param.cc before it was added) turn any line holding
    '=' into a variable, comments included.
    """
    out: list[str] = []
    for ch in value:
        category = unicodedata.category(ch)
        if category.startswith("C") or category in ("Zl", "Zp"):
            ch = "?"
        elif category == "Zs":
            ch = " "
        if nccl_conf and ch == "=":
            ch = ":"
        out.append(ch)
    return "".join(out)


def _format_gains(gains: Mapping[str, float]) -> str:
    # "64MiB x1.120" rather than "64MiB=1.12": see _header_value on '=' in NCCL conf comments.
    if not gains:
        return "none"
    return ", ".join(f"{label} x{float(ratio):.3f}" for label, ratio in gains.items())


def _header_lines(prov: Provenance, generation: int | None = None, *, nccl_conf: bool = False) -> list[str]:
    def hv(value: str) -> str:
        return _header_value(value, nccl_conf=nccl_conf)

    lines = [f"# Generated by nccltune {hv(prov.nccltune_version)}. Do not edit: re-run nccltune sweep."]
    if prov.demo:
        lines.append(DEMO_LINE)
    fields: list[tuple[str, str]] = [
        ("nccltune_version", prov.nccltune_version),
        ("created_at", prov.created_at),
        ("topology_fingerprint", prov.topology_fingerprint),
        ("nccl_version", prov.nccl_version if prov.nccl_version is not None else "unknown"),
        ("backend", prov.backend),
        ("demo", "true" if prov.demo else "false"),
        ("profile", prov.profile if prov.profile is not None else "default"),
        ("gains", _format_gains(prov.gains)),
    ]
    if prov.note is not None:
        fields.append(("note", prov.note))
    if prov.tuning_fingerprint is not None:
        fields.append(("tuning_fingerprint", prov.tuning_fingerprint))
    fields.append(("state", prov.state))
    if generation is not None:
        fields.append(("generation", str(generation)))
    lines.extend(f"# {key}: {hv(value)}" for key, value in fields)
    return lines


def _provenance_dict(prov: Provenance, generation: int | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "nccltune_version": prov.nccltune_version,
        "created_at": prov.created_at,
        "topology_fingerprint": prov.topology_fingerprint,
        "nccl_version": prov.nccl_version,
        "backend": prov.backend,
        "demo": prov.demo,
        "profile": prov.profile,
        "gains": {label: float(ratio) for label, ratio in prov.gains.items()},
        "note": prov.note,
        "tuning_fingerprint": prov.tuning_fingerprint,
        "state": prov.state,
    }
    if prov.class_profile is not None:
        doc["class_profile"] = dict(prov.class_profile)
    if generation is not None:
        doc["generation"] = generation
    return doc


def render_sh(env: Mapping[str, str], prov: Provenance, *, generation: int | None = None,
              scope: str | None = None) -> str:
    """POSIX shell form: header, then ``export NAME='value'`` sorted by name.

    Raises:
        InputError: see validate_env.
    """
    # Single quotes are belt and braces: the safe set needs no quoting at all.
    return _render_lines(env, prov, generation, "export {name}='{value}'", scope)


def render_env(env: Mapping[str, str], prov: Provenance, *, generation: int | None = None,
               scope: str | None = None) -> str:
    """``NAME=value`` form for systemd ``EnvironmentFile=`` and ``docker --env-file``.

    No quotes: docker keeps them as part of the value, systemd strips them.

    Raises:
        InputError: see validate_env.
    """
    return _render_lines(env, prov, generation, "{name}={value}", scope)


def _render_lines(env: Mapping[str, str], prov: Provenance, generation: int | None, line: str,
                  scope: str | None = None) -> str:
    """Header, then one line per variable (sorted), after validating names, values and provenance."""
    clean = validate_env(env)
    _check_provenance(prov)
    body = [line.format(name=name, value=value) for name, value in clean.items()]
    scope_lines = [_scope_line(scope)] if scope is not None else []
    return "\n".join([*_header_lines(prov, generation), *scope_lines, *body]) + "\n"


def render_json(env: Mapping[str, str], prov: Provenance, *, generation: int | None = None,
                single_node_env: Mapping[str, str] | None = None) -> str:
    """One JSON document: ``{"schema_version": 1, "provenance": {...}, "env": {...},
    "single_node_env": {...}, "scopes": {"every_job": ..., "single_node": ...}}``.

    ``env`` is the part for every job (what readers of older sets know), ``single_node_env`` the
    part for single-node jobs only; ``scopes`` labels both with the jobs that get them and the
    files that carry them. ``generation``, when given, is recorded inside ``provenance``.

    Raises:
        InputError: see validate_env.
    """
    clean = validate_env(env)
    single = validate_env(single_node_env or {}, source="single-node environment")
    _check_provenance(prov)
    parts = {EVERY_JOB: clean, SINGLE_NODE: single}
    scopes = {label: {"applies_to": SCOPE_APPLIES_TO[label], "files": list(SCOPE_FILES[label]), "env": part}
              for label, part in parts.items()}
    doc = {"schema_version": SCHEMA_VERSION, "provenance": _provenance_dict(prov, generation), "env": clean,
           "single_node_env": single, "scopes": scopes}
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _scope_line(label: str) -> str:
    """The header line of nccl.sh/.env and their single-node twins: which jobs get the file."""
    return f"# scope: {label}: {SCOPE_APPLIES_TO[label]}"


def job_env(published: PublishedSet, nnodes: int | None) -> dict[str, str]:
    """What a job gets from a published set: the every-job part, plus the single-node part only
    when the job is known to span exactly one node (``nnodes == 1``). A job that does not say
    (None) or spans more nodes never receives values measured between one node's GPUs."""
    env = dict(published.env)
    if nnodes == 1:
        env.update(published.single_node_env)
    return env


def job_nnodes(environ: Mapping[str, str]) -> int | None:
    """The job's node count from NCCLTUNE_JOB_NNODES, or None when it is unset.

    Raises:
        UsageError: a value that is not a positive whole number (exit 2).
    """
    text = environ.get(JOB_NNODES_VAR)
    if text is None or text == "":
        return None
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{JOB_NNODES_VAR}={text!r}: not a positive whole number of nodes")
    return int(text)


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """Serialise publishers into one directory (see the module docstring: the publish lock).

    The lock is an flock on the directory itself, so no lock file is added to the state dir.

    Raises:
        BusyError: another publisher held the lock for longer than the timeout (exit 75).
        PublishError: the directory cannot be opened.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC)
    except OSError as exc:
        raise PublishError(directory, exc, action="cannot open directory") from exc
    try:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BusyError(f"{directory}: another nccltune process is publishing there") from None
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        # Closing the descriptor releases the flock.
        os.close(fd)


# -- publish and read back -------------------------------------------------------------------


def _legacy_generation(json_path: Path) -> int:
    """The generation recorded in a pre-generation-directory nccl.json (a regular file); 0 when
    there is none or it is unreadable (a corrupt file is what the publish replaces)."""
    try:
        if json_path.is_symlink() or not json_path.is_file():
            return 0
        doc = json.loads(json_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        log.warning("%s: unreadable (%s); the generation count restarts at 1", json_path, exc)
        return 0
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    generation = prov.get("generation") if isinstance(prov, dict) else None
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        return 0
    return generation


def _generation_numbers(gen_dir: Path) -> list[int]:
    """Numbers of the complete generation directories, ascending."""
    try:
        names = os.listdir(gen_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise PublishError(gen_dir, exc, action="cannot list") from exc
    return sorted(int(n) for n in names if n.isdigit() and not n.startswith("0"))


def _read_counter(path: Path) -> int:
    try:
        fd = trust.open_file(path, os.O_RDONLY, "generation counter")
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise PublishError(path, exc, action="cannot read") from exc
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else 0


def _current_generation(out_dir: Path) -> int | None:
    """The generation ``current`` points at, or None when there is no valid link."""
    try:
        target = os.readlink(out_dir / CURRENT_NAME)
    except OSError:
        return None
    head, _, number = target.rpartition("/")
    if head != GENERATIONS_DIR or not number.isdigit():
        return None
    return int(number)


# Link temps are named apart from file temps: only publishers (under the lock) make them.
_LINK_TEMP_PREFIX = ".link."


def _switch_link(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` atomically: a symlink under a temp name, renamed over ``link``."""
    if os.path.islink(link) and os.readlink(link) == target:
        return
    for _ in range(16):
        tmp = link.with_name(f"{_LINK_TEMP_PREFIX}{link.name}{TEMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.symlink(target, tmp)
        except FileExistsError:
            continue
        except OSError as exc:
            raise PublishError(link, exc, action="cannot create link") from exc
        break
    else:
        raise PublishError(link, FileExistsError(errno.EEXIST, "no free temporary link name"))
    try:
        os.replace(tmp, link)
    except BaseException as exc:
        fail_without_temp(tmp, link, exc)


def _write_generation(directory: Path, files: list[tuple[str, bytes]]) -> None:
    """Fill a fresh generation directory; every file fsync'ed, then the directory."""
    for name, data in files:
        path = directory / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
        except OSError as exc:
            raise PublishError(path, exc) from exc
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, 0o644)
            os.fsync(fd)
        except OSError as exc:
            raise PublishError(path, exc) from exc
        finally:
            os.close(fd)
    fsync_dir(directory)


def _prune(out_dir: Path, keep: int, current: int) -> None:
    """Remove generations older than the newest ``keep`` (never ``current``) and what dead
    publishers left: half-built generation directories, counter temps, link temps.

    Runs under the publish lock, so every temp of a publisher is a dead one's, whatever its age.
    """
    gen_dir = out_dir / GENERATIONS_DIR
    numbers = [n for n in _generation_numbers(gen_dir) if n <= current]
    doomed = [gen_dir / str(n) for n in numbers[:-keep]] if keep > 0 else []
    doomed += [gen_dir / e for e in os.listdir(gen_dir) if TEMP_INFIX in e]
    doomed += [out_dir / e for e in os.listdir(out_dir) if e.startswith(_LINK_TEMP_PREFIX) and TEMP_INFIX in e]
    for path in doomed:
        remove_quietly(path)


def _prepare_out_dir(out_dir: Path) -> None:
    """Create (0755) and check the publish directory and its generations/ directory."""
    try:
        trust.ensure_dir(out_dir, "publish directory")
        trust.ensure_dir(out_dir / GENERATIONS_DIR, "generations directory")
    except OSError as exc:
        raise PublishError(out_dir, exc, action="cannot create directory") from exc


def _own_files(final: Path, topology_xml: str | None, tuner: Tuner | None,
               prov: Provenance) -> tuple[dict[str, str], list[tuple[str, bytes]]]:
    """The variables that name the generation's own files, and those files."""
    own: dict[str, str] = {}
    files: list[tuple[str, bytes]] = []
    if topology_xml is not None:
        own["NCCL_TOPO_FILE"] = str(final / TOPOLOGY_NAME)
        files.append((TOPOLOGY_NAME, topology_xml.encode("utf-8")))
    if tuner is not None:
        own[TUNER_PLUGIN_VAR] = str(final / TUNER_PLUGIN_NAME)
        own[TUNER_TABLE_VAR] = str(final / TUNER_TABLE_NAME)
        if prov.tuning_fingerprint is not None:
            own[TUNER_FINGERPRINT_VAR] = prov.tuning_fingerprint
        files.append((TUNER_PLUGIN_NAME, tuner.plugin_bytes()))
        files.append((TUNER_TABLE_NAME, tuner.table_text.encode("utf-8")))
    return own, files


def _check_scopes(every_job: Mapping[str, str], single_node: Mapping[str, str]) -> None:
    """The single-node part names no file and repeats no every-job variable (a launcher applies
    it after the every-job part, so a repeat would silently change what every job gets).

    Raises:
        InputError: naming the variable (exit 78).
    """
    if JOB_NNODES_VAR in every_job:
        raise InputError("environment", f"{JOB_NNODES_VAR}: says what shape a job has; only its launcher may set it")
    for name in sorted(single_node):
        if name in PATH_VARIABLES or name in (TUNER_FINGERPRINT_VAR, JOB_NNODES_VAR):
            raise InputError("single-node environment", f"{name}: files, plugins and the job's shape belong to "
                             "the part for every job")
        if name in every_job:
            raise InputError("single-node environment", f"{name}: also in the part for every job",
                             hint="publish each variable in one part only")


def publish(out_dir: Path, env: Mapping[str, str], prov: Provenance, *,
            topology_xml: str | None = None, single_node_env: Mapping[str, str] | None = None,
            tuner: Tuner | None = None) -> PublishedFiles:
    """Validate, render and publish one generation into ``out_dir`` as one unit: nccl.sh,
    nccl.env (``env``: what fits every job on the node), nccl-single-node.sh/.env
    (``single_node_env``: tuned values measured for single-node jobs only), nccl.json (both,
    labelled) and, when given, ncclTopology.xml and the tuner's plugin and table.

    With ``topology_xml``, NCCL_TOPO_FILE in the every-job part is the generation's own copy, so a
    job keeps the file it started with while later generations are published; with ``tuner``,
    NCCL_TUNER_PLUGIN and NCCLTUNE_TUNER_TABLE likewise name the generation's own plugin and table
    and NCCLTUNE_TUNER_FINGERPRINT is ``prov.tuning_fingerprint``. Any other value of these
    variables is refused. See the module docstring for the layout, the lock and what a crash leaves.

    Raises:
        InputError: a name or value is not publishable, or the directory may not be trusted
            (exit 78); nothing was written.
        PublishError: the OS refused a write (exit 1); the published set is the previous one.
        BusyError: another publisher kept the directory locked (exit 75).
    """
    out_dir = Path(out_dir)
    env = dict(env)
    clean = validate_env(env)
    single = validate_env(single_node_env or {}, source="single-node environment")
    _check_provenance(prov)
    owned = {"NCCL_TOPO_FILE"} if topology_xml is not None else set()
    if tuner is not None:
        owned |= {TUNER_PLUGIN_VAR, TUNER_TABLE_VAR, TUNER_FINGERPRINT_VAR}
    # What the generation's own files replace is not checked; every other path variable is.
    check_path_variables({n: v for n, v in clean.items() if n not in owned})
    _check_scopes(clean, single)
    _prepare_out_dir(out_dir)
    gen_dir = out_dir / GENERATIONS_DIR
    with _directory_lock(out_dir):
        clean_stale_temps(out_dir)
        counter = gen_dir / COUNTER_NAME
        numbers = _generation_numbers(gen_dir)
        generation = max([_read_counter(counter), _legacy_generation(out_dir / JSON_NAME), *numbers, 0]) + 1
        # The number is taken before anything else is written: a crash from here on never lets
        # a later publish reuse it.
        replace_file(counter, f"{generation}\n".encode(), 0o644)
        final = gen_dir / str(generation)
        own, files = _own_files(final, topology_xml, tuner, prov)
        clean = validate_env({**{n: v for n, v in clean.items() if n not in owned}, **own})
        files += [
            (SH_NAME, render_sh(clean, prov, generation=generation, scope=EVERY_JOB).encode("utf-8")),
            (ENV_NAME, render_env(clean, prov, generation=generation, scope=EVERY_JOB).encode("utf-8")),
            (SINGLE_SH_NAME, render_sh(single, prov, generation=generation, scope=SINGLE_NODE).encode("utf-8")),
            (SINGLE_ENV_NAME, render_env(single, prov, generation=generation, scope=SINGLE_NODE).encode("utf-8")),
            (JSON_NAME, render_json(clean, prov, generation=generation, single_node_env=single).encode("utf-8")),
        ]
        building = gen_dir / f".{generation}{TEMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(building, 0o700)
            _write_generation(building, files)
            os.chmod(building, 0o755)
            os.rename(building, final)
            fsync_dir(gen_dir)
        except BaseException as exc:
            shutil.rmtree(building, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, PublishError):
                raise PublishError(final, exc) from exc
            raise
        # The one switch: readers resolve `current` once and see generation N or N+1, whole.
        _switch_link(out_dir / CURRENT_NAME, f"{GENERATIONS_DIR}/{generation}")
        for name in PUBLISHED_NAMES:
            _switch_link(out_dir / name, f"{CURRENT_NAME}/{name}")
        fsync_dir(out_dir)
        _prune(out_dir, KEEP_GENERATIONS, generation)

    log.info("published generation %d (%d variables for every job, %d for single-node jobs) into %s",
             generation, len(clean), len(single), out_dir)
    return PublishedFiles(sh_path=out_dir / SH_NAME, env_path=out_dir / ENV_NAME, json_path=out_dir / JSON_NAME,
                          generation=generation,
                          topology_path=final / TOPOLOGY_NAME if topology_xml is not None else None,
                          single_sh_path=out_dir / SINGLE_SH_NAME, single_env_path=out_dir / SINGLE_ENV_NAME,
                          tuner_plugin_path=final / TUNER_PLUGIN_NAME if tuner is not None else None,
                          tuner_table_path=final / TUNER_TABLE_NAME if tuner is not None else None,
                          env=dict(clean), single_node_env=dict(single))


@dataclass(frozen=True)
class PublishedSet:
    """One generation as read back and checked: every file of it, of the same generation."""

    directory: Path
    generation: int
    env: dict[str, str]  # the part for every job
    provenance: dict[str, Any]
    texts: dict[str, str]
    single_node_env: dict[str, str] = field(default_factory=dict)  # only for jobs known to be single-node


def _read_trusted(path: Path, what: str) -> bytes:
    """Read a published file: no symlink, regular, trusted owner and mode, at most 1 MiB.

    Raises:
        InputError: refused by the trust rule or too large (exit 78).
        PublishError: it cannot be read (exit 1).
    """
    try:
        fd = trust.open_file(path, os.O_RDONLY, what)
    except OSError as exc:
        raise PublishError(path, exc, action="cannot read") from exc
    try:
        data = os.read(fd, MAX_PUBLISHED_BYTES + 1)
    except OSError as exc:
        raise PublishError(path, exc, action="cannot read") from exc
    finally:
        os.close(fd)
    if len(data) > MAX_PUBLISHED_BYTES:
        raise InputError(str(path), f"larger than {MAX_PUBLISHED_BYTES} bytes; not a file nccltune wrote")
    return data


def _parse_json_doc(raw: bytes, where: str) -> tuple[dict[str, str], dict[str, Any], dict[str, str] | None]:
    """(every-job env, provenance, single-node env or None for a set written before the parts)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(where, f"not UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise InputError(where, f"not valid JSON: {exc.msg}", line=exc.lineno) from exc
    except RecursionError as exc:
        raise InputError(where, "JSON nested too deeply") from exc
    if not isinstance(doc, dict):
        raise InputError(where, "expected a JSON object")
    version = doc.get("schema_version")
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise InputError(
            where,
            f"unknown schema_version {version!r} (this nccltune reads {SCHEMA_VERSION})",
            hint="written by another nccltune version; re-run nccltune sweep",
        )
    env = doc.get("env")
    prov = doc.get("provenance")
    if not isinstance(env, dict):
        raise InputError(where, "'env' must be an object of NAME: value")
    if not isinstance(prov, dict):
        raise InputError(where, "'provenance' must be an object")
    single = doc.get("single_node_env")
    if single is not None and not isinstance(single, dict):
        raise InputError(where, "'single_node_env' must be an object of NAME: value")
    clean = validate_env(env, source=where)
    single_clean = None if single is None else validate_env(single, source=f"{where}: single_node_env")
    if single_clean is not None:
        _check_scopes(clean, single_clean)
    return clean, prov, single_clean


_SH_LINE = re.compile(r"export ([A-Z0-9_]+)='([^']*)'")
_ENV_LINE = re.compile(r"([A-Z0-9_]+)=(.*)")


def parse_lines(text: str, where: str, kind: str) -> tuple[dict[str, str], int | None]:
    """Check a published nccl.sh (``kind`` "sh") or nccl.env ("env") line by line, as nccltune
    writes them: comments without control characters, and one assignment per line with a
    publishable name and value. Returns (variables, generation from the header).

    Raises:
        InputError: any other line, naming the file and line (exit 78): an appended command
            must never come out of ``nccltune env``.
    """
    pattern = _SH_LINE if kind == "sh" else _ENV_LINE
    found: dict[str, str] = {}
    generation: int | None = None
    for lineno, line in enumerate(text.split("\n"), 1):
        if line == "" and lineno == text.count("\n") + 1:
            break
        if line.startswith("#"):
            if any(unicodedata.category(ch).startswith("C") for ch in line):
                raise InputError(where, "a comment holds a control character", line=lineno)
            if line.startswith("# generation: ") and line[14:].isdigit():
                generation = int(line[14:])
            continue
        match = pattern.fullmatch(line)
        if match is None:
            raise InputError(where, "not a line nccltune writes (only comments and assignments)", line=lineno,
                             hint="the file was changed after it was published; re-run nccltune sweep")
        name, value = match.groups()
        validate_env({name: value}, source=f"{where}:{lineno}")
        found[name] = value
    return found, generation


def read_set(out_dir: Path) -> PublishedSet | None:
    """Read the published set as one unit: resolve ``current`` once, read every file from that
    generation directory, and check each one (trust rule, content, generation). None when
    nothing is published.

    A directory in the older layout (regular nccl.* files, no ``current``) is read the same way
    from ``out_dir`` itself.

    Raises:
        InputError: a file may not be trusted, is malformed, or belongs to another generation
            than the rest of the set (a mixed set), naming the file (exit 78).
        PublishError: a file cannot be read (exit 1).
    """
    out_dir = Path(out_dir)
    current = out_dir / CURRENT_NAME
    if os.path.lexists(current):
        number = _current_generation(out_dir)
        if number is None:
            raise InputError(str(current), f"not a link to {GENERATIONS_DIR}/<number>",
                             hint="re-run nccltune sweep")
        directory = out_dir / GENERATIONS_DIR / str(number)
        for path, what in ((out_dir, "publish directory"), (out_dir / GENERATIONS_DIR, "generations directory"),
                           (directory, "generation directory")):
            try:
                trust.check_dir(path, what)
            except FileNotFoundError as exc:
                raise InputError(str(current), f"points at the missing {directory}",
                                 hint="re-run nccltune sweep") from exc
    else:
        number = None
        directory = out_dir
        if not os.path.lexists(out_dir / JSON_NAME):
            return None
        try:
            trust.check_dir(out_dir, "publish directory")
        except FileNotFoundError:
            return None
    json_path = directory / JSON_NAME
    try:
        raw = _read_trusted(json_path, "published file")
    except PublishError as exc:
        if number is None and exc.errno == errno.ENOENT:
            return None
        raise
    env, prov, single = _parse_json_doc(raw, str(json_path))
    _check_own_files(env, directory, number, str(json_path))
    generation = prov.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int):
        generation = None
    if number is not None and generation != number:
        raise InputError(str(json_path), f"records generation {generation!r} but lies in generation {number}: "
                         "a mixed set", hint="re-run nccltune sweep")
    texts = {JSON_NAME: raw.decode("utf-8")}
    parts = [(SH_NAME, "sh", env), (ENV_NAME, "env", env)]
    if single is not None:
        parts += [(SINGLE_SH_NAME, "sh", single), (SINGLE_ENV_NAME, "env", single)]
    for name, kind, expected in parts:
        path = directory / name
        if number is None and not expected and name in (SINGLE_SH_NAME, SINGLE_ENV_NAME) \
                and not os.path.lexists(path):
            continue  # copied as plain files without the (empty) single-node part
        try:
            text = _read_trusted(path, "published file").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(str(path), f"not UTF-8 (byte {exc.start})") from exc
        found, file_generation = parse_lines(text, str(path), kind)
        if file_generation != generation:
            raise InputError(str(path), f"is of generation {file_generation} but {json_path.name} of generation "
                             f"{generation}: a mixed set", hint="re-run nccltune sweep")
        if found != expected:
            raise InputError(str(path), f"does not hold the variables of {json_path.name}: a mixed or edited set",
                             hint="re-run nccltune sweep")
        texts[name] = text
    return PublishedSet(directory=directory, generation=generation or 0, env=env, provenance=prov, texts=texts,
                        single_node_env=single or {})


def _check_own_files(env: Mapping[str, str], directory: Path, number: int | None, where: str) -> None:
    """The tuner's plugin and table, when published, are files of this very generation.

    Raises:
        InputError: naming the variable (exit 78).
    """
    for name, file_name in ((TUNER_PLUGIN_VAR, TUNER_PLUGIN_NAME), (TUNER_TABLE_VAR, TUNER_TABLE_NAME)):
        if name in env and (number is None or os.path.realpath(env[name]) != os.path.realpath(directory / file_name)):
            raise InputError(where, f"{name}: {env[name]} is not the published generation's own {file_name}",
                             hint="re-run nccltune sweep")


def read_published(out_dir: Path) -> tuple[dict[str, str], dict[str, Any]] | None:
    """Read back nccl.json of the published set: (env, provenance), or None when nothing is published.

    Raises:
        InputError: nccl.json is corrupt, of an unknown schema, or holds an unpublishable
            variable, or the set is mixed or untrusted (exit 78).
        PublishError: nccl.json exists but cannot be read (exit 1).
    """
    got = read_set(out_dir)
    return None if got is None else (got.env, got.provenance)


# -- NCCL conf file --------------------------------------------------------------------------


def _split_lines(data: bytes) -> list[bytes]:
    """Split on '\\n' only, as NCCL's getline does, keeping each line's ending; joining gives back
    ``data`` byte for byte."""
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _find_block(lines: list[bytes], where: str) -> tuple[int, int] | None:
    """Index of the BEGIN and END lines of the managed block, or None when there is none.

    Raises:
        InputError: BEGIN without END, END without BEGIN, or a second block; names the line.
    """
    begin: int | None = None
    found: tuple[int, int] | None = None
    for index, line in enumerate(lines):
        text = line.strip()
        if text.startswith(_CONF_BEGIN_PREFIX):
            if begin is not None:
                raise InputError(
                    where, "second BEGIN marker before the END of the first block", line=index + 1
                )
            if found is not None:
                raise InputError(
                    where,
                    "a second nccltune managed block",
                    line=index + 1,
                    hint="remove all but one block by hand",
                )
            begin = index
        elif text.startswith(_CONF_END_PREFIX):
            if begin is None:
                raise InputError(where, "END marker without a BEGIN marker", line=index + 1)
            found = (begin, index)
            begin = None
    if begin is not None:
        raise InputError(
            where,
            "BEGIN marker without an END marker",
            line=begin + 1,
            hint="restore the END line or delete the block by hand",
        )
    return found


def _conf_keys(lines: list[bytes]) -> Iterator[tuple[int, str]]:
    """(line number, name) of every assignment NCCL would read, as its setEnvFile parses them."""
    for index, line in enumerate(lines):
        if line.startswith(b"#") or b"=" not in line:
            continue
        yield index + 1, line.split(b"=", 1)[0].decode("utf-8", "replace")


CONF_SCOPE_LINE = ("# scope: every_job: NCCL reads this file for every job and cannot know a job's shape, "
                   "so only the part that fits every job is here; values measured for single-node jobs "
                   f"are in {SINGLE_SH_NAME} and {SINGLE_ENV_NAME}")


def _render_conf_block(env: dict[str, str], prov: Provenance) -> bytes:
    nccl = {name: value for name, value in env.items() if name.startswith("NCCL_")}
    skipped = [name for name in env if name not in nccl]
    lines = [CONF_BEGIN, *_header_lines(prov, nccl_conf=True), CONF_SCOPE_LINE]
    if skipped:
        # NCCL reads only NCCL_* through its conf file (ncclGetEnv); TORCH_NCCL_* is read by
        # PyTorch and NCCLTUNE_* by nccltune, both straight from the process environment.
        lines.append(
            "# Read from the process environment, not from this file, so left out here "
            "(use nccl.sh or nccl.env): " + ", ".join(skipped)
        )
    lines.extend(f"{name}={value}" for name, value in nccl.items())
    lines.append(CONF_END)
    return ("\n".join(lines) + "\n").encode("utf-8")


def _read_conf(path: Path) -> tuple[bytes, os.stat_result | None]:
    try:
        with open(path, "rb") as fh:
            return fh.read(), os.fstat(fh.fileno())
    except FileNotFoundError:
        return b"", None
    except OSError as exc:
        raise PublishError(path, exc, action="cannot read") from exc


def _write_conf(target: Path, data: bytes, st: os.stat_result | None) -> None:
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o644
    owner = (st.st_uid, st.st_gid) if st is not None else None
    replace_file(target, data, mode, owner)
    clean_stale_temps(target.parent, f".{target.name}{TEMP_INFIX}*")


def _conf_target(path: Path) -> Path:
    """The file to edit for ``path``, after the trust rule.

    /etc/nccl.conf is often a symlink managed by configuration management: edit the file it points
    to and keep the link, rather than replacing the link with a regular file. But root appends its
    block only where nobody else could have pointed it: the real file (when it exists) and its
    directory must pass the trust rule, or nothing is written.

    Raises:
        InputError: the target or its directory is owned or writable by another user (exit 78).
    """
    target = Path(os.path.realpath(path))
    try:
        trust.check_dir(target.parent, "NCCL conf file's directory")
        if os.path.lexists(target):
            trust.check_file(target, "NCCL conf file")
    except FileNotFoundError:
        pass  # reading or writing it names what is missing
    except InputError as exc:
        if target != Path(path):
            raise InputError(str(path), f"is a link to {exc.message}") from exc
        raise
    return target


def update_nccl_conf(path: Path, env: Mapping[str, str], prov: Provenance) -> None:
    """Write ``env``'s NCCL_* variables into the managed block of an NCCL conf file.

    ``env`` is the part of a published set that fits every job (never the single-node part):
    NCCL reads the conf file in every process and cannot know the job's shape. The block's header
    says so.

    The block sits between ``CONF_BEGIN`` and ``CONF_END``; every byte outside it is kept. Without
    a block one is appended; a missing file is created (0644). The file keeps its mode (and owner,
    when running as root) and is replaced atomically; an unchanged file is not rewritten.

    NCCL sets conf-file variables without overwriting (setenv(..., 0)), so the process
    environment wins over the file and, within the file, the first assignment wins: an assignment
    above the block shadows the block's, which is logged as a warning.

    Raises:
        InputError: a bad name or value, or malformed markers (BEGIN without END, two blocks);
            names the file and line; nothing is written (exit 78).
        PublishError: the OS refused (exit 1).
    """
    clean = validate_env(env)
    _check_provenance(prov)
    target = _conf_target(Path(path))
    data, st = _read_conf(target)
    lines = _split_lines(data)
    block = _find_block(lines, str(path))
    new_block = _render_conf_block(clean, prov)
    if block is not None:
        begin, end = block
        before, after = lines[:begin], lines[end + 1 :]
        new_data = b"".join(before) + new_block + b"".join(after)
    else:
        before = lines
        # The last foreign line needs its newline, or BEGIN would be glued onto it.
        separator = b"\n" if data and not data.endswith(b"\n") else b""
        new_data = data + separator + new_block

    managed = {name for name in clean if name.startswith("NCCL_")}
    for lineno, name in _conf_keys(before):
        if name in managed:
            log.warning(
                "%s:%d sets %s above the nccltune block; NCCL keeps the first value it reads, "
                "so the tuned value is ignored",
                path,
                lineno,
                name,
            )

    if new_data == data and st is not None:
        log.debug("%s: managed block already up to date", path)
        return
    _write_conf(target, new_data, st)
    log.info("updated the nccltune block in %s (%d NCCL variables)", path, len(managed))


def remove_nccl_conf_block(path: Path) -> bool:
    """Remove the managed block, keeping every other byte; True when a block was removed.

    A missing file or one without a block is left alone.

    Raises:
        InputError: malformed markers (names the file and line); nothing is written (exit 78).
        PublishError: the OS refused (exit 1).
    """
    target = _conf_target(Path(path))
    data, st = _read_conf(target)
    if st is None:
        return False
    lines = _split_lines(data)
    block = _find_block(lines, str(path))
    if block is None:
        return False
    begin, end = block
    _write_conf(target, b"".join(lines[:begin] + lines[end + 1 :]), st)
    log.info("removed the nccltune block from %s", path)
    return True


# -- before the first trial ------------------------------------------------------------------

# Variables that make NCCL (or nccltune's tuner plugin) load code or open a file by path.
# nccltune publishes none of them except as files it wrote into the generation itself:
# NCCL_TOPO_FILE (publish(..., topology_xml=...), or a file root could trust, see the module
# docstring), NCCL_TUNER_PLUGIN and NCCLTUNE_TUNER_TABLE (publish(..., tuner=...)).
PATH_VARIABLES = frozenset({
    "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_ENV_PLUGIN", "NCCL_RAS_PLUGIN",
    "NCCL_TOPO_FILE", "NCCL_GRAPH_FILE", "NCCL_CONF_FILE", "NCCL_DEBUG_FILE", "NCCL_TOPO_DUMP_FILE",
    "NCCL_GRAPH_DUMP_FILE", "NCCL_NVLS_ENABLE_FILE", "NCCLTUNE_TUNER_TABLE",
})


def check_path_variables(env: Mapping[str, str], where: Mapping[str, str] | None = None,
                         *, default_where: str = "environment", existing: bool = False) -> None:
    """Refuse a variable that would make every job load a library or open a file someone chose:
    any of PATH_VARIABLES but NCCL_TOPO_FILE, and NCCL_TOPO_FILE unless it is an absolute path
    (with ``existing``, as a config pin is checked: of an existing regular file that passes the
    trust rule; what nccltune publishes itself is its own file, written just before).

    Raises:
        InputError: naming the variable and where it was set (exit 78).
    """
    for name in sorted(env):
        if name not in PATH_VARIABLES:
            continue
        source = (where or {}).get(name, default_where)
        if name != "NCCL_TOPO_FILE":
            raise InputError(source, f"{name}: nccltune does not publish variables that load code or name "
                             "files", hint="set it in the job's own environment if it is really wanted")
        value = env[name]
        if not os.path.isabs(value):
            raise InputError(source, f"{name}: {value!r} is not an absolute path")
        if not existing:
            continue
        try:
            trust.check_file(value, "topology file")
            trust.check_dir(os.path.dirname(value), "topology file's directory")
        except OSError as exc:
            raise InputError(source, f"{name}: {value}: {exc.strerror}") from exc
        except InputError as exc:
            raise InputError(source, f"{name}: {exc.message}") from exc


def preflight(out_dir: Path, env_values: Mapping[str, str], where: Mapping[str, str]) -> None:
    """Check before the first trial everything that would stop the publish after the last one:
    each value that will be published as it is (config pins, policy), and the publish directory.

    ``where`` maps a variable to where it was set ("config.yaml:12"), for the message.

    Raises:
        InputError: an unpublishable name or value, a variable that names code or files, or a
            publish directory that is not a directory, not trusted or not writable (exit 78).
    """
    for name in sorted(env_values):
        validate_env({name: env_values[name]}, source=where.get(name, "config"))
    check_path_variables(env_values, where, default_where="config", existing=True)
    out_dir = Path(out_dir)
    probe = out_dir
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    what = "it" if probe == out_dir else str(probe)
    if not probe.is_dir():
        raise InputError(str(out_dir), f"cannot be the publish directory: {what} is not a directory",
                         hint="set publish.dir (or --state-dir) to a directory")
    if probe == out_dir:
        trust.check_dir(out_dir, "publish directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(str(out_dir), f"cannot be the publish directory: {what} is not writable by this user "
                         "(or read-only)", hint="choose another publish.dir or --state-dir, or fix its permissions")
