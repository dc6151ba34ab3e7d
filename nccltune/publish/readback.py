"""Reading the published set back, for ``nccltune env``/``exec``, the doctor, verify, the daemon
and the launchers' rules: ``current`` resolved once, every file of that one generation read
under the trust rule and checked (content, generation, the tuner's own files), and which part a
job gets (``job_env``). A reader refuses a mixed, edited or oversized set rather than hand a job
something nccltune did not write.
"""

from __future__ import annotations

import errno
import os
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError, UsageError
from ..files import trust
from ..files.inputfile import parse_json
from .applied import APPLIED_VAR, set_digest
from .formats import (
    ENV_NAME,
    ENV_PLUGIN_NAME,
    ENV_TABLE_NAME,
    JSON_NAME,
    MAX_PUBLISHED_BYTES,
    NODE_COUNTS_LINE,
    SCHEMA_VERSION,
    SH_NAME,
    SINGLE_ENV_NAME,
    SINGLE_SH_NAME,
    TUNER_PLUGIN_NAME,
    TUNER_TABLE_NAME,
    markers,
    node_counts_line,
    nodes_files,
)
from .generations import CURRENT_NAME, GENERATIONS_DIR, current_generation
from .policy import (
    ENV_PLUGIN_VAR,
    ENV_TABLE_VAR,
    JOB_NNODES_VAR,
    TUNER_PLUGIN_VAR,
    TUNER_TABLE_VAR,
    check_node_counts,
    check_scopes,
    validate_env,
)
from .setting import PublishError
from .shapes import part_for_shape


@dataclass(frozen=True)
class PublishedSet:
    """One generation as read back and checked: every file of it, of the same generation."""

    directory: Path
    generation: int
    env: dict[str, str]  # the part for every job
    provenance: dict[str, Any]
    texts: dict[str, str]
    single_node_env: dict[str, str] = field(default_factory=dict)  # only for jobs known to be single-node
    digest: str = ""  # of its nccl.json (publish.applied.set_digest)
    # The parts by node count (2 or more): node count -> variables; none in a set without them.
    nodes_env: dict[int, dict[str, str]] = field(default_factory=dict)

    @property
    def parts(self) -> dict[int, dict[str, str]]:
        """Every part for a job shape, by node count (1: the single-node part): what
        shapes.part_for_shape takes beside the every-job part."""
        return {1: self.single_node_env, **self.nodes_env}

    @property
    def set_id(self) -> str:
        """``GENERATION:DIGEST``, how the marker of what a launch applied names this set."""
        return f"{self.generation}:{self.digest}"


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


@dataclass(frozen=True)
class _JsonDoc:
    """nccl.json as read: the every-job part, the provenance, the single-node part (None for a set
    written before the parts) and the parts by node count."""

    env: dict[str, str]
    provenance: dict[str, Any]
    single: dict[str, str] | None
    nodes: dict[int, dict[str, str]]


def _parse_json_doc(raw: bytes, where: str) -> _JsonDoc:
    doc = parse_json(raw, where)
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
        check_scopes(clean, single_clean)
    return _JsonDoc(clean, prov, single_clean, _parse_nodes(doc.get("nodes_env", {}), clean, where))


def _parse_nodes(nodes: object, every_job: Mapping[str, str], where: str) -> dict[int, dict[str, str]]:
    """nccl.json's ``nodes_env``: node count (a decimal key, 2 or more) -> its part.

    Raises:
        InputError: naming the count or variable (exit 78).
    """
    if not isinstance(nodes, dict):
        raise InputError(where, "'nodes_env' must be an object of node count: {NAME: value}")
    parts: dict[int, dict[str, str]] = {}
    for key, part in nodes.items():
        if not isinstance(key, str) or not re.fullmatch(r"[1-9][0-9]{0,8}", key):
            raise InputError(where, f"nodes_env: {key!r} is not a node count")
        if not isinstance(part, dict):
            raise InputError(where, f"nodes_env[{key}] must be an object of NAME: value")
        source = f"{where}: nodes_env[{key}]"
        parts[int(key)] = validate_env(part, source=source)
        check_scopes(every_job, parts[int(key)], source)
    check_node_counts(parts, f"{where}: nodes_env")
    return dict(sorted(parts.items()))


def node_counts(text: str) -> tuple[int, ...] | None:
    """The node counts an every-job file's header lists (``# node counts: 2 4``), or None when it
    lists none (a set without parts by node count, or written before them)."""
    for line in text.split("\n"):
        if line.startswith(NODE_COUNTS_LINE):
            words = line[len(NODE_COUNTS_LINE):].split(" ")
            return tuple(int(word) for word in words) if all(w.isdigit() for w in words) else ()
    return None


_SH_LINE = re.compile(r"export ([A-Z0-9_]+)='([^']*)'")
_ENV_LINE = re.compile(r"([A-Z0-9_]+)=(.*)")


def parse_lines(text: str, where: str, kind: str) -> tuple[dict[str, str], int | None, str | None]:
    """Check a published nccl.sh (``kind`` "sh") or nccl.env ("env") line by line, as nccltune
    writes them: comments without control characters, and one assignment per line with a
    publishable name and value, or the marker (publish.applied). Returns (variables, generation
    from the header, the marker's value or None).

    Raises:
        InputError: any other line, naming the file and line (exit 78): an appended command
            must never come out of ``nccltune env``.
    """
    pattern = _SH_LINE if kind == "sh" else _ENV_LINE
    found: dict[str, str] = {}
    generation: int | None = None
    marker: str | None = None
    for lineno, line in enumerate(text.split("\n"), 1):
        if line == "" and lineno == text.count("\n") + 1:
            break
        if line.startswith("#"):
            # isprintable() is false for every "C" character (and for separators other than the
            # space): a printable line, nccltune's own comments, needs no look at each character.
            if not line.isprintable() and any(unicodedata.category(ch).startswith("C") for ch in line):
                raise InputError(where, "a comment holds a control character", line=lineno)
            if line.startswith("# generation: ") and line[14:].isdigit():
                generation = int(line[14:])
            continue
        match = pattern.fullmatch(line)
        if match is None:
            raise InputError(where, "not a line nccltune writes (only comments and assignments)", line=lineno,
                             hint="the file was changed after it was published; re-run nccltune sweep")
        name, value = match.groups()
        if name == APPLIED_VAR and marker is None:
            marker = value  # checked against the set by read_set
            continue
        validate_env({name: value}, source=f"{where}:{lineno}")
        found[name] = value
    return found, generation, marker


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
        number = current_generation(out_dir)
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
    doc = _parse_json_doc(raw, str(json_path))
    env, prov, single = doc.env, doc.provenance, doc.single
    _check_own_files(env, directory, number, str(json_path))
    generation = prov.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int):
        generation = None
    if number is not None and generation != number:
        raise InputError(str(json_path), f"records generation {generation!r} but lies in generation {number}: "
                         "a mixed set", hint="re-run nccltune sweep")
    texts = {JSON_NAME: raw.decode("utf-8")}
    digest = set_digest(raw)
    every_marker, single_marker = markers(generation or 0, digest, env, single or {})
    parts = [(SH_NAME, "sh", env, every_marker), (ENV_NAME, "env", env, every_marker)]
    if single is not None:
        parts += [(SINGLE_SH_NAME, "sh", single, single_marker), (SINGLE_ENV_NAME, "env", single, single_marker)]
    for count, part in doc.nodes.items():
        part_marker = markers(generation or 0, digest, env, part)[1]
        sh_name, env_name = nodes_files(count)
        parts += [(sh_name, "sh", part, part_marker), (env_name, "env", part, part_marker)]
    for name, kind, expected, expected_marker in parts:
        path = directory / name
        if number is None and not expected and name in (SINGLE_SH_NAME, SINGLE_ENV_NAME) \
                and not os.path.lexists(path):
            continue  # copied as plain files without the (empty) single-node part
        try:
            text = _read_trusted(path, "published file").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(str(path), f"not UTF-8 (byte {exc.start})") from exc
        found, file_generation, marker = parse_lines(text, str(path), kind)
        if file_generation != generation:
            raise InputError(str(path), f"is of generation {file_generation} but {json_path.name} of generation "
                             f"{generation}: a mixed set", hint="re-run nccltune sweep")
        if found != expected:
            raise InputError(str(path), f"does not hold the variables of {json_path.name}: a mixed or edited set",
                             hint="re-run nccltune sweep")
        # A set written before the marker has none; one that is there names this very set and file.
        if marker is not None and marker != expected_marker.value:
            raise InputError(str(path), f"its {APPLIED_VAR} is not the marker of this set and file: a mixed or "
                             "edited set", hint="re-run nccltune sweep")
        if name in (SH_NAME, ENV_NAME) and node_counts(text) != (tuple(doc.nodes) or None):
            # The shell launchers take the parts a set holds from this line: it is nccl.json's.
            listed = node_counts_line(doc.nodes) if doc.nodes else "no such line"
            raise InputError(str(path), f"the parts by node count it lists are not {json_path.name}'s ({listed}): "
                             "a mixed or edited set", hint="re-run nccltune sweep")
        texts[name] = text
    return PublishedSet(directory=directory, generation=generation or 0, env=env, provenance=prov, texts=texts,
                        single_node_env=single or {}, digest=digest, nodes_env=doc.nodes)


def _check_own_files(env: Mapping[str, str], directory: Path, number: int | None, where: str) -> None:
    """The tuner's plugin and table, when published, are files of this very generation.

    Raises:
        InputError: naming the variable (exit 78).
    """
    for name, file_name in ((TUNER_PLUGIN_VAR, TUNER_PLUGIN_NAME), (TUNER_TABLE_VAR, TUNER_TABLE_NAME),
                            (ENV_PLUGIN_VAR, ENV_PLUGIN_NAME), (ENV_TABLE_VAR, ENV_TABLE_NAME)):
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


def job_env(published: PublishedSet, nnodes: int | None) -> dict[str, str]:
    """What a job of `nnodes` nodes (None: it does not say) gets from a published set:
    shapes.part_for_shape over the every-job part and every part by shape (the single-node part
    only for one node, else the part of the largest measured count <= the job's)."""
    return part_for_shape(published.env, published.parts, nnodes)


def part_files(count: int) -> tuple[str, str]:
    """The (sh, env) files of the part for jobs of `count` nodes (1: the single-node part)."""
    return (SINGLE_SH_NAME, SINGLE_ENV_NAME) if count == 1 else nodes_files(count)


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
