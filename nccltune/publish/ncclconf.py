"""The managed block in an NCCL conf file (``publish.nccl_conf``, typically ``/etc/nccl.conf``),
which NCCL reads itself in every process: the every-job part only, between marker lines, every
other byte of the file kept, edited through a link only where the trust rule allows.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..errors import InputError
from ..files import trust
from ..files.atomicfile import remove_dead_temps, replace_file
from .formats import SINGLE_ENV_NAME, SINGLE_SH_NAME, header_lines
from .policy import validate_env
from .setting import Provenance, PublishError, check_provenance

log = logging.getLogger(__name__)

CONF_BEGIN = "# BEGIN nccltune managed block (do not edit)"
CONF_END = "# END nccltune managed block"
# Markers are recognised by prefix so that an edited marker text is still seen as a marker (and a
# block with a mangled END is refused) rather than silently growing a second block.
_CONF_BEGIN_PREFIX = b"# BEGIN nccltune"
_CONF_END_PREFIX = b"# END nccltune"



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
    lines = [CONF_BEGIN, *header_lines(prov, nccl_conf=True), CONF_SCOPE_LINE]
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
    remove_dead_temps(target.parent, {target.name})


def _conf_target(path: Path) -> Path:
    """The file to edit for ``path``, after the trust rule (``trust.trusted_target``).

    /etc/nccl.conf is often a symlink managed by configuration management: edit the file it points
    to and keep the link, rather than replacing the link with a regular file. But root appends its
    block, or creates the file, only where nobody else could have pointed it: every link on the
    way (its own owner), every directory and the file (when it exists) must pass the trust rule,
    walked from the path as configured, or nothing is written.

    Raises:
        InputError: a link, a directory or the file is owned or writable by another user (exit 78).
        PublishError: the file's directory does not exist or cannot be read (exit 1).
    """
    try:
        return trust.trusted_target(path, "NCCL conf file")
    except InputError:
        raise
    except OSError as exc:
        raise PublishError(path, exc, action="cannot reach its directory") from exc


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
    check_provenance(prov)
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


def check_nccl_conf(path: Path) -> None:
    """What update_nccl_conf would refuse, checked before a set is published: a target another
    user controls, or malformed markers. Nothing is written.

    Raises:
        InputError: naming the file and line (exit 78).
        PublishError: the file exists but cannot be read (exit 1).
    """
    data, _st = _read_conf(_conf_target(Path(path)))
    _find_block(_split_lines(data), str(path))
