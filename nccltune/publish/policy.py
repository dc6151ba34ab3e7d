"""The value policy: which names and values may ever be published, and how much of them.

Rules that keep a launcher from ever sourcing something wrong:

1. Values are restricted to a small safe character set, so the very same bytes mean the same
   thing unquoted in every consumer: a POSIX shell, systemd (which interprets quotes, backslashes
   and ``$``), docker (which does not strip quotes) and NCCL's conf parser (which takes the rest of
   the line verbatim). Anything outside the set is refused before a byte is written.
2. Variables that make NCCL load code or open files (``PATH_VARIABLES``) are published only as
   what nccltune wrote itself: NCCL_TOPO_FILE as the generation's own topology file,
   NCCL_TUNER_PLUGIN and NCCLTUNE_TUNER_TABLE as the generation's own plugin and table,
   NCCL_ENV_PLUGIN and NCCLTUNE_ENV_TABLE as its own env plugin and file. Any other
   value of them, from a sweep candidate, a pin or the environment, is refused (exit 78) before
   the first trial: a tuning file must never make every job on the node load a library or write
   a file that someone chose by editing a config.
3. Names: one allow-list (names.unpublishable) says which variables may ever be published, for
   every decider and for what feeds one (a class profile, an import, a config's pins): NCCL's
   and torch's NCCL variables but NCCL's identity variables (NCCL_HOSTID, NCCL_COMM_ID, ...), and
   of nccltune's own only the tuner's table and fingerprint and the env plugin's file
   (``check_names``).
4. Bounds: a set holds at most ``MAX_VARIABLES`` variables per part, and its provenance texts,
   gains and tuner table stay within what every reader accepts, so nothing is published that
   ``nccltune env``, the launchers or the doctor would then refuse.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import InputError
from ..files import trust
from ..names import PUBLISHED_NAME_RE, unpublishable

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

# Set by a job's launcher to say how many nodes the job spans; "1" adds the single-node part.
JOB_NNODES_VAR = "NCCLTUNE_JOB_NNODES"
TUNER_PLUGIN_VAR = "NCCL_TUNER_PLUGIN"
TUNER_TABLE_VAR = "NCCLTUNE_TUNER_TABLE"
TUNER_FINGERPRINT_VAR = "NCCLTUNE_TUNER_FINGERPRINT"
ENV_PLUGIN_VAR = "NCCL_ENV_PLUGIN"  # nccltune's env plugin (NCCL 2.28.7 and newer), with its file:
ENV_TABLE_VAR = "NCCLTUNE_ENV_TABLE"

# Bounds of one published set. A tuned setting holds a few dozen variables and a provenance of a
# few hundred bytes; these leave ample room and keep every published file far below what readers
# accept (formats.MAX_PUBLISHED_BYTES).
MAX_VARIABLES = 256  # per part (every job, single node, each node count)
# Parts by node count beside the single-node part, and the largest node count one is for: far
# beyond any cluster nccltune tunes, small enough for a shell's arithmetic (the launchers compare
# counts with `[ -le ]`).
MAX_NODE_PARTS = 64
MAX_NODE_COUNT = 100000
MAX_PROVENANCE_TEXT = 8192  # characters of one provenance text (note, profile, class profile fields)
MAX_GAINS = 512  # size buckets with a measured gain
MAX_CLASS_PROFILE_FIELDS = 32
# The class profile kept in force with a set (the decided document, evidence included).
MAX_PROFILE_BYTES = 16 << 20


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


def check_names(env: Mapping[str, str], source: str,
                hint: str = "set it in the job's own environment if one job really needs it") -> None:
    """Every name on the allow-list of what may be published (names.unpublishable).

    Raises:
        InputError: naming the variable, why it is never published and ``source`` (exit 78).
    """
    for name in sorted(env, key=str):
        why = unpublishable(name) if isinstance(name, str) else "is not a string"
        if why is not None:
            raise InputError(source, f"{name}: {why}", hint=hint)


def check_count(env: Mapping[str, str], source: str) -> None:
    """At most MAX_VARIABLES variables in one part.

    Raises:
        InputError: naming ``source`` and the count (exit 78).
    """
    if len(env) > MAX_VARIABLES:
        raise InputError(source, f"{len(env)} variables; a published part holds at most {MAX_VARIABLES}")


def check_text(value: str, source: str, field: str, limit: int = MAX_PROVENANCE_TEXT) -> None:
    """A provenance text within ``limit`` characters, and valid Unicode text: one with a lone
    surrogate (a file name of undecodable bytes, an escape in a document) has no UTF-8 form, so
    nccl.json, the header and the log could not be written after the switch.

    Raises:
        InputError: naming ``source`` and ``field`` (exit 78).
    """
    if len(value) > limit:
        raise InputError(source, f"{field}: {len(value)} characters; at most {limit} are published",
                         hint="a published header and nccl.json stay small enough for every reader")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(source, f"{field}: not valid UTF-8 text (a lone surrogate at character {exc.start})",
                         hint="every published text is UTF-8") from None


def check_scopes(every_job: Mapping[str, str], single_node: Mapping[str, str],
                 part: str = "single-node environment") -> None:
    """A part for one job shape (the single-node part, or the part of a node count, named `part`)
    names no file and repeats no every-job variable (a launcher applies it after the every-job
    part, so a repeat would silently change what every job gets). A name in two shape parts is
    allowed: a job gets one of them at most (shapes.part_for_shape).

    Raises:
        InputError: naming the variable (exit 78).
    """
    if JOB_NNODES_VAR in every_job:
        raise InputError("environment", f"{JOB_NNODES_VAR}: says what shape a job has; only its launcher may set it")
    for name in sorted(single_node):
        if name in PATH_VARIABLES or name in (TUNER_FINGERPRINT_VAR, JOB_NNODES_VAR):
            raise InputError(part, f"{name}: files, plugins and the job's shape belong to the part for every job")
        if name in every_job:
            raise InputError(part, f"{name}: also in the part for every job",
                             hint="publish each variable in one part only")


def check_node_counts(counts: Iterable[object], source: str) -> None:
    """The node counts a set has parts for beside the single-node part: whole numbers from 2 to
    MAX_NODE_COUNT, at most MAX_NODE_PARTS of them.

    Raises:
        InputError: naming ``source`` and the count (exit 78).
    """
    counts = list(counts)
    if len(counts) > MAX_NODE_PARTS:
        raise InputError(source, f"{len(counts)} parts by node count; a set holds at most {MAX_NODE_PARTS}")
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= MAX_NODE_COUNT:
            raise InputError(source, f"node count {count!r}: a part by node count is for 2 to {MAX_NODE_COUNT} "
                             "nodes (one node's part is the single-node part)")


# -- before the first trial ------------------------------------------------------------------

# Variables that make NCCL (or nccltune's tuner plugin) load code or open a file by path.
# nccltune publishes none of them except as files it wrote into the generation itself:
# NCCL_TOPO_FILE (a Setting's topology_xml, or a pinned file root could trust), NCCL_TUNER_PLUGIN
# and NCCLTUNE_TUNER_TABLE (a Setting's tuner), NCCL_ENV_PLUGIN and NCCLTUNE_ENV_TABLE (its env plugin).
PATH_VARIABLES = frozenset({
    "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_ENV_PLUGIN", "NCCL_RAS_PLUGIN",
    "NCCL_TOPO_FILE", "NCCL_GRAPH_FILE", "NCCL_CONF_FILE", "NCCL_DEBUG_FILE", "NCCL_TOPO_DUMP_FILE",
    "NCCL_GRAPH_DUMP_FILE", "NCCL_NVLS_ENABLE_FILE", "NCCLTUNE_TUNER_TABLE", "NCCLTUNE_ENV_TABLE",
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
        InputError: an unpublishable name or value (one off the allow-list of names included), a
            variable that names code or files, or a
            publish directory that is not a directory, not trusted or not writable (exit 78).
    """
    for name in sorted(env_values):
        validate_env({name: env_values[name]}, source=where.get(name, "config"))
        check_names({name: env_values[name]}, where.get(name, "config"))
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
