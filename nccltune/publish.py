"""Publisher: the only module that writes the files job launchers read.

Outputs, all in one state directory (DESIGN.md section 3):

- ``nccl.sh``: ``export NAME='value'`` lines, for ``. /var/lib/nccltune/nccl.sh`` in job scripts;
- ``nccl.env``: ``NAME=value`` lines, for systemd ``EnvironmentFile=`` and ``docker --env-file``;
- ``nccl.json``: the same environment with its provenance, for ``nccltune env`` and tooling;
- optionally a managed block in an NCCL conf file (``/etc/nccl.conf``), which NCCL reads itself.

Two rules keep a launcher from ever sourcing something wrong:

1. Values are restricted to a small safe character set, so the very same bytes mean the same
   thing unquoted in every consumer: a POSIX shell, systemd (which interprets quotes, backslashes
   and ``$``), docker (which does not strip quotes) and NCCL's conf parser (which takes the rest of
   the line verbatim). Anything outside the set is refused before a byte is written.
2. Every file is replaced atomically (temp file in the same directory, fsync, rename, fsync of the
   directory), so a reader sees the old file or the new one, never a torn one, and a failed or
   interrupted publish leaves the last published files as they were.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import logging
import math
import os
import secrets
import stat
import time
import unicodedata
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .errors import EXIT_CHECK_FAILED, BusyError, InputError, NccltuneError
from .names import DEMO_LABEL, PUBLISHED_NAME_RE

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

CONF_BEGIN = "# BEGIN nccltune managed block (do not edit)"
CONF_END = "# END nccltune managed block"
# Markers are recognised by prefix so that an edited marker text is still seen as a marker (and a
# block with a mangled END is refused) rather than silently growing a second block.
_CONF_BEGIN_PREFIX = b"# BEGIN nccltune"
_CONF_END_PREFIX = b"# END nccltune"

DEMO_LINE = f"# {DEMO_LABEL} and must not be used on a GPU node."

# A temp file is named ".<target>.tmp-<pid>-<random>" so that a crashed writer's leftover is
# recognisable, never matches what a launcher reads, and can be cleaned up by the next publish.
_TEMP_INFIX = ".tmp-"
_STALE_TEMP_GLOB = ".nccl*" + _TEMP_INFIX + "*"
# A live writer holds its temp file for milliseconds; an hour-old one belongs to a dead writer.
STALE_TEMP_AGE_S = 3600.0
_TEMP_NAME_ATTEMPTS = 16
_LOCK_TIMEOUT_S = 10.0
_LOCK_POLL_S = 0.05


class PublishError(NccltuneError):
    """Writing (or reading back) a published file failed at the OS level: disk full, permission
    denied, read-only filesystem.

    Exit code 1 ("check failed"): the contract (DESIGN.md section 3) has no separate code for I/O
    failure, it is not bad input (78) and not a missing GPU (69); 1 is the documented generic
    failure. The message names the path and the OS error; ``errno`` keeps the number for callers
    that want to react to, say, ENOSPC.
    """

    exit_code = EXIT_CHECK_FAILED

    def __init__(
        self, path: Path | str, exc: OSError, *, action: str = "cannot write", extra: str | None = None
    ) -> None:
        code = exc.errno
        reason = exc.strerror or str(exc)
        name = errno.errorcode.get(code, "") if code is not None else ""
        detail = f"{reason} ({name})" if name else reason
        if extra:
            detail = f"{detail}; {extra}"
        hints = {
            errno.EACCES: "run as a user allowed to write there, or choose another path (--state-dir)",
            errno.EPERM: "run as a user allowed to write there, or choose another path (--state-dir)",
            errno.EROFS: "the filesystem is mounted read-only; choose another path (--state-dir)",
            errno.ENOSPC: "free space on that filesystem and re-run",
            errno.EDQUOT: "the disk quota is exhausted; free space and re-run",
        }
        super().__init__(f"{path}: {action}: {detail}", hint=hints.get(code) if code is not None else None)
        self.path = str(path)
        self.errno = code


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


@dataclass(frozen=True)
class PublishedFiles:
    """What one publish wrote: the three paths and the generation recorded in nccl.json."""

    sh_path: Path
    env_path: Path
    json_path: Path
    generation: int


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
    if generation is not None:
        doc["generation"] = generation
    return doc


def render_sh(env: Mapping[str, str], prov: Provenance, *, generation: int | None = None) -> str:
    """POSIX shell form: header, then ``export NAME='value'`` sorted by name.

    Raises:
        InputError: see validate_env.
    """
    # Single quotes are belt and braces: the safe set needs no quoting at all.
    return _render_lines(env, prov, generation, "export {name}='{value}'")


def render_env(env: Mapping[str, str], prov: Provenance, *, generation: int | None = None) -> str:
    """``NAME=value`` form for systemd ``EnvironmentFile=`` and ``docker --env-file``.

    No quotes: docker keeps them as part of the value, systemd strips them.

    Raises:
        InputError: see validate_env.
    """
    return _render_lines(env, prov, generation, "{name}={value}")


def _render_lines(env: Mapping[str, str], prov: Provenance, generation: int | None, line: str) -> str:
    """Header, then one line per variable (sorted), after validating names, values and provenance."""
    clean = validate_env(env)
    _check_provenance(prov)
    body = [line.format(name=name, value=value) for name, value in clean.items()]
    return "\n".join([*_header_lines(prov, generation), *body]) + "\n"


def render_json(env: Mapping[str, str], prov: Provenance, *, generation: int | None = None) -> str:
    """One JSON document: ``{"schema_version": 1, "provenance": {...}, "env": {...}}``.

    ``generation``, when given, is recorded inside ``provenance``.

    Raises:
        InputError: see validate_env.
    """
    clean = validate_env(env)
    _check_provenance(prov)
    doc = {"schema_version": SCHEMA_VERSION, "provenance": _provenance_dict(prov, generation), "env": clean}
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"


# -- atomic files ----------------------------------------------------------------------------


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TEMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}")


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove temporary file %s: %s", path, exc)


def _fail_without_temp(tmp: Path, path: Path, exc: BaseException) -> NoReturn:
    """Remove the temp file, then re-raise: an OSError as PublishError naming the target, anything
    else (KeyboardInterrupt mid-write) as it is. The target itself is never touched."""
    _unlink_quietly(tmp)
    if isinstance(exc, OSError):
        raise PublishError(path, exc) from exc
    raise exc


def _write_temp(path: Path, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> Path:
    """Write ``data`` to a new temp file next to ``path``, durably, with ``mode``; return its path.

    On any failure the temp file is removed and ``path`` is not touched.

    Raises:
        PublishError: the OS refused (ENOSPC, EACCES, EROFS, ...).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(_TEMP_NAME_ATTEMPTS):
        tmp = _temp_path(path)
        try:
            # 0o600 until the content is complete: nobody should read a half-written file.
            fd = os.open(tmp, flags, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise PublishError(path, exc, action="cannot create a temporary file next to it") from exc
        break
    else:
        raise PublishError(path, FileExistsError(errno.EEXIST, "no free temporary file name"))
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if owner is not None:
                _chown_if_possible(fd, owner)
            # fchmod ignores the umask, so the mode is exactly `mode`; done before fsync so that the
            # mode is durable together with the data.
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        _fail_without_temp(tmp, path, exc)
    return tmp


def _chown_if_possible(fd: int, owner: tuple[int, int]) -> None:
    """Keep a replaced file's owner and group; only root may give a file away, others keep theirs."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == owner:
        return
    try:
        os.fchown(fd, *owner)
    except PermissionError:
        log.debug("cannot keep owner %d:%d; the replaced file belongs to the writer", *owner)


def _fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable.

    Raises:
        PublishError: the directory cannot be synced (the new files are in place but may not
            survive a crash).
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise PublishError(directory, exc, action="cannot open directory to sync it") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems cannot fsync a directory at all; that is no failure of ours.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise PublishError(directory, exc, action="cannot sync directory") from exc
    finally:
        os.close(fd)


def atomic_write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new one.

    Temp file ``.<name>.tmp-<pid>-<random>`` in the same directory; write, fchmod to ``mode``,
    fsync, rename over ``path``, fsync the directory. A replaced symlink is replaced, not followed.

    Raises:
        PublishError: the OS refused; the temp file is removed and ``path`` is untouched (unless
            only the final directory sync failed, which the message says).
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    _atomic_write(path, payload, mode)


def _atomic_write(path: Path, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    tmp = _write_temp(path, data, mode, owner)
    try:
        os.replace(tmp, path)
    except BaseException as exc:
        _fail_without_temp(tmp, path, exc)
    _fsync_dir(path.parent)


def clean_stale_temps(
    directory: Path, pattern: str = _STALE_TEMP_GLOB, *, now: float | None = None
) -> list[Path]:
    """Remove temp files left by dead writers: names matching ``pattern``, older than an hour.

    Younger ones may belong to a writer that is still running, so they stay. Returns what was
    removed; failures to remove are logged, never raised (cleanup must not block a publish).
    """
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        log.warning("cannot list %s for stale temporary files: %s", directory, exc)
        return removed
    for entry in entries:
        if not fnmatch.fnmatchcase(entry.name, pattern):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_TEMP_AGE_S:
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove stale temporary file %s: %s", entry.path, exc)
            continue
        log.info("removed stale temporary file %s left by an interrupted writer", entry.path)
        removed.append(Path(entry.path))
    return removed


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """Serialise publishers into one directory, so that two of them never interleave their renames
    (which would leave nccl.sh from one and nccl.env from the other).

    The lock is an flock on the directory itself, so no lock file is added to the state dir.

    Raises:
        BusyError: another publisher held the lock for longer than the timeout (exit 75).
        PublishError: the directory cannot be opened.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
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


def _previous_generation(json_path: Path) -> int:
    """The generation recorded in the current nccl.json; 0 when there is none or it is unreadable
    (a corrupt file is what the publish is about to replace, so it must not block it)."""
    try:
        doc = json.loads(json_path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("%s: unreadable (%s); the generation count restarts at 1", json_path, exc)
        return 0
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    generation = prov.get("generation") if isinstance(prov, dict) else None
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        log.warning("%s: no valid generation recorded; the generation count restarts at 1", json_path)
        return 0
    return generation


def publish(out_dir: Path, env: Mapping[str, str], prov: Provenance) -> PublishedFiles:
    """Validate, render and atomically publish nccl.sh, nccl.env and nccl.json into ``out_dir``.

    All three are written to temp files first and renamed only when all three are ready, so a
    failure while preparing (bad value, full disk, permission) leaves every old file as it was.
    nccl.json is renamed last: its generation marks a complete set. Stale temp files of crashed
    writers (older than an hour) are removed.

    Raises:
        InputError: a name or value is not publishable (exit 78); nothing was written.
        PublishError: the OS refused a write (exit 1).
        BusyError: another publisher kept the directory locked (exit 75).
    """
    out_dir = Path(out_dir)
    clean = validate_env(env)
    _check_provenance(prov)
    try:
        out_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:
        raise PublishError(out_dir, exc, action="cannot create directory") from exc

    sh_path, env_path, json_path = out_dir / SH_NAME, out_dir / ENV_NAME, out_dir / JSON_NAME
    with _directory_lock(out_dir):
        clean_stale_temps(out_dir)
        generation = _previous_generation(json_path) + 1
        # Order matters: nccl.json goes last (see docstring).
        rendered = [
            (sh_path, render_sh(clean, prov, generation=generation)),
            (env_path, render_env(clean, prov, generation=generation)),
            (json_path, render_json(clean, prov, generation=generation)),
        ]
        temps: list[tuple[Path, Path]] = []
        try:
            for target, text in rendered:
                temps.append((_write_temp(target, text.encode("utf-8"), 0o644), target))
        except BaseException:
            for tmp, _ in temps:
                _unlink_quietly(tmp)
            raise

        replaced: list[Path] = []
        for index, (tmp, target) in enumerate(temps):
            try:
                os.replace(tmp, target)
            except OSError as exc:
                for left_tmp, _ in temps[index:]:
                    _unlink_quietly(left_tmp)
                already = ", ".join(p.name for p in replaced) or "none"
                raise PublishError(
                    target, exc, extra=f"already replaced: {already}; re-run to make the set consistent"
                ) from exc
            replaced.append(target)
        _fsync_dir(out_dir)

    log.info("published generation %d (%d variables) into %s", generation, len(clean), out_dir)
    return PublishedFiles(sh_path=sh_path, env_path=env_path, json_path=json_path, generation=generation)


def read_published(out_dir: Path) -> tuple[dict[str, str], dict[str, Any]] | None:
    """Read back nccl.json: (env, provenance), or None when nothing is published.

    Raises:
        InputError: nccl.json is corrupt, of an unknown schema, or holds an unpublishable
            variable (exit 78).
        PublishError: nccl.json exists but cannot be read (exit 1).
    """
    path = Path(out_dir) / JSON_NAME
    where = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PublishError(path, exc, action="cannot read") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(where, f"not UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise InputError(where, f"not valid JSON: {exc.msg}", line=exc.lineno) from exc
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
    return validate_env(env, source=where), prov


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


def _render_conf_block(env: dict[str, str], prov: Provenance) -> bytes:
    nccl = {name: value for name, value in env.items() if name.startswith("NCCL_")}
    skipped = [name for name in env if name not in nccl]
    lines = [CONF_BEGIN, *_header_lines(prov, nccl_conf=True)]
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
    _atomic_write(target, data, mode, owner)
    clean_stale_temps(target.parent, f".{target.name}{_TEMP_INFIX}*")


def _conf_target(path: Path) -> Path:
    # /etc/nccl.conf is often a symlink managed by configuration management: edit the file it points
    # to and keep the link, rather than replacing the link with a regular file.
    return Path(os.path.realpath(path))


def update_nccl_conf(path: Path, env: Mapping[str, str], prov: Provenance) -> None:
    """Write ``env``'s NCCL_* variables into the managed block of an NCCL conf file.

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
