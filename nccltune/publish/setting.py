"""The one Setting: what a decider decided for this node, whole, before it is published.

Every decider returns a Setting and hands it to ``publish_setting`` (publisher.py): the sweep, the
one-GPU node, a class profile (``nccltune apply``, the daemon's ``profile.path``) and the daemon's
safe republish. A Setting holds the every-job part, the single-node part, the parts by node count
(a class profile's parts measured on 2, 4, ... nodes; shapes.py says which a job gets), the topology XML (the
generation's own copy is what NCCL_TOPO_FILE names), the tuner plugin and table, the provenance,
and, for a class profile, the profile document that is in force once the Setting is published.
``Setting.check`` applies the whole value policy (policy.py) and the bounds, so a Setting that
passes it is one every reader of the published set accepts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..errors import InputError
from ..files.atomicfile import FileError
from .policy import (
    MAX_CLASS_PROFILE_FIELDS,
    MAX_GAINS,
    MAX_PROFILE_BYTES,
    TUNER_FINGERPRINT_VAR,
    TUNER_PLUGIN_VAR,
    TUNER_TABLE_VAR,
    check_count,
    check_names,
    check_node_counts,
    check_path_variables,
    check_scopes,
    check_text,
    validate_env,
)
from .topofile import TOPO_FILE_VAR as TOPO_FILE_VAR  # kept importable from here
from .topofile import names_own_topology

# Kept under their old names for code that imports them from here.
PublishError = FileError

# What a published set holds (Provenance.state: every file's header, nccl.json, the metric
# nccltune_published_info{state}): "tuned", a measured choice that beat NCCL's defaults (a sweep's
# winner, a class profile's choice); "defaults", a decision that kept NCCL's defaults, so nothing
# beyond what fits every job unmeasured (the topology file, the policy values, the pins); "safe",
# that part republished while a tuning is pending (the topology changed). "tuned" and "defaults"
# are decisions the daemon keeps; "safe" asks for a sweep.
PUBLISHED_STATES = ("tuned", "defaults", "safe")
DECIDED_STATES = ("tuned", "defaults")

# The tuner table the plugin reads (tuner/table.py MAX_TABLE_BYTES) and a generous bound for the
# plugin library itself.
MAX_TABLE_BYTES = 1 << 20
MAX_ENV_TABLE_BYTES = 64 << 10  # the env plugin's file (tuner/envfile.py MAX_BYTES)
MAX_PLUGIN_BYTES = 64 << 20


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
    # What was published, one of PUBLISHED_STATES: "tuned", "defaults" or "safe".
    state: str = "tuned"
    # The class profile the values come from (file, path, sha256, class_id, chosen, decided_at,
    # nodes), in nccl.json only; None for a node's own decision.
    class_profile: Mapping[str, str | int] | None = None
    # The sweep run that published it, and that run's history.db (an absolute path), in nccl.json
    # only: a sweep that dies between its publish and closing its run is then recorded as having
    # published this generation (trials/session.py's close_dead_runs). None for other deciders.
    run_id: int | None = None
    history: str | None = None
    # The job's image the values were measured in (bench.image; trials.container.provenance), in
    # nccl.json only; None: measured with bench.python on the host.
    image: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Tuner:
    """The tuner plugin and its table, published as files of the generation (every job gets them:
    a table entry applies only to the communicator shape it was measured for)."""

    plugin: bytes | Path  # the built shared library, or its path
    table_text: str
    # nccltune's env plugin and its file (tuner/envfile.py): published, and NCCL_ENV_PLUGIN set, only
    # with both; NCCL before 2.28.7 ignores them and the env files carry the values as ever.
    env_plugin: bytes | Path | None = None
    env_text: str | None = None

    def plugin_bytes(self) -> bytes:
        """Raises: PublishError when the library cannot be read (exit 1)."""
        return _library_bytes(self.plugin)

    def env_plugin_bytes(self) -> bytes | None:
        """The env plugin when it is published with its file, else None. Raises: see plugin_bytes."""
        if self.env_plugin is None or self.env_text is None:
            return None
        return _library_bytes(self.env_plugin)


def _library_bytes(library: bytes | Path) -> bytes:
    if isinstance(library, bytes):
        return library
    try:
        return Path(library).read_bytes()
    except OSError as exc:
        raise PublishError(Path(library), exc, action="cannot read") from exc


@dataclass(frozen=True)
class Setting:
    """One decision for this node, as it will be published (see the module docstring).

    The variables that name the generation's own files (NCCL_TOPO_FILE with ``topology_xml``,
    the tuner's plugin, table and fingerprint with ``tuner``) are the publisher's to set: a value
    of them in ``every_job_env`` (the marker topofile.OWN_TOPOLOGY, the run's plugin and table) is
    dropped here, and formats.render_set names the generation's own copies, so every decider
    publishes the same path rule.
    """

    every_job_env: Mapping[str, str]
    provenance: Provenance
    single_node_env: Mapping[str, str] = field(default_factory=dict)
    topology_xml: str | None = None
    tuner: Tuner | None = None
    # The class profile document (its bytes) in force once published; None for a node's own decision.
    class_profile: bytes | None = None
    # What a refusal names: the profile file, "sweep", "safe republish".
    where: str = "published setting"
    # The parts by node count (2 or more) beside the single-node part: node count -> variables.
    nodes_env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        owned = self.owned_variables()
        every_job = {name: value for name, value in dict(self.every_job_env).items() if name not in owned}
        object.__setattr__(self, "every_job_env", MappingProxyType(every_job))
        object.__setattr__(self, "single_node_env", MappingProxyType(dict(self.single_node_env)))
        object.__setattr__(self, "nodes_env", MappingProxyType({count: MappingProxyType(dict(part))
                                                                for count, part in dict(self.nodes_env).items()}))

    def owned_variables(self) -> frozenset[str]:
        """The variables the publisher sets to the generation's own files."""
        owned = {TOPO_FILE_VAR} if self.topology_xml is not None else set()
        if self.tuner is not None:
            owned |= {TUNER_PLUGIN_VAR, TUNER_TABLE_VAR, TUNER_FINGERPRINT_VAR}
        return frozenset(owned)

    def check(self) -> None:
        """Everything that would stop the publish or a reader, before a byte is written: names,
        values, counts, scopes, variables that name files, the provenance and its bounds, the
        tuner's and the class profile's sizes.

        Raises:
            InputError: naming ``where`` and the variable or field (exit 78).
        """
        if names_own_topology(self.every_job_env):
            raise InputError(self.where, f"{TOPO_FILE_VAR}: names nccltune's own topology file, and the setting "
                             "carries no topology XML to publish as it")
        every_job = validate_env(self.every_job_env, source=f"{self.where}: every-job environment")
        single = validate_env(self.single_node_env, source=f"{self.where}: single-node environment")
        check_names(every_job, f"{self.where}: every-job environment")
        check_names(single, f"{self.where}: single-node environment")
        check_count(every_job, f"{self.where}: every-job environment")
        check_count(single, f"{self.where}: single-node environment")
        check_path_variables(every_job, default_where=f"{self.where}: every-job environment")
        check_scopes(every_job, single)
        check_node_counts(self.nodes_env, f"{self.where}: parts by node count")
        for count, part in sorted(self.nodes_env.items()):
            source = f"{self.where}: {count}-node environment"
            clean = validate_env(part, source=source)
            check_names(clean, source)
            check_count(clean, source)
            check_scopes(every_job, clean, source)
        check_provenance(self.provenance, self.where)
        if self.tuner is not None:
            size = len(self.tuner.table_text.encode("utf-8"))
            if size > MAX_TABLE_BYTES:
                raise InputError(self.where, f"tuner table: {size} bytes; the plugin reads at most {MAX_TABLE_BYTES}")
            env_size = len((self.tuner.env_text or "").encode("utf-8"))
            if env_size > MAX_ENV_TABLE_BYTES:
                raise InputError(self.where, f"env plugin file: {env_size} bytes; the plugin reads at most "
                                 f"{MAX_ENV_TABLE_BYTES}")
            if isinstance(self.tuner.plugin, bytes) and len(self.tuner.plugin) > MAX_PLUGIN_BYTES:
                raise InputError(self.where, f"tuner plugin: {len(self.tuner.plugin)} bytes; at most "
                                 f"{MAX_PLUGIN_BYTES} are published")
        if self.class_profile is not None and len(self.class_profile) > MAX_PROFILE_BYTES:
            raise InputError(self.where, f"class profile: {len(self.class_profile)} bytes; at most "
                             f"{MAX_PROFILE_BYTES} are kept in force")


def check_provenance(prov: Provenance, where: str = "provenance") -> None:
    """Refuse provenance that cannot be rendered faithfully (non-finite gains would be invalid JSON)
    or that is larger than what is published (policy.py's bounds).

    Raises:
        InputError: a field of the wrong type, a non-finite gain or a field over its bound, named
            as ``provenance.<field>`` (exit 78).
    """
    for key in ("nccltune_version", "created_at", "topology_fingerprint", "backend"):
        if not isinstance(getattr(prov, key), str):
            raise InputError(where, f"provenance.{key}: {getattr(prov, key)!r} is not a string")
    for key in ("nccl_version", "profile", "note", "tuning_fingerprint", "history"):
        value = getattr(prov, key)
        if value is not None and not isinstance(value, str):
            raise InputError(where, f"provenance.{key}: {value!r} is neither a string nor null")
    for key in ("nccltune_version", "created_at", "topology_fingerprint", "backend", "nccl_version", "profile",
                "note", "tuning_fingerprint", "state", "history"):
        value = getattr(prov, key)
        if isinstance(value, str):
            check_text(value, where, f"provenance.{key}")
    if len(prov.gains) > MAX_GAINS:
        raise InputError(where, f"provenance.gains: {len(prov.gains)} buckets; at most {MAX_GAINS} are published")
    for label, ratio in prov.gains.items():
        if not isinstance(label, str):
            raise InputError(where, f"provenance.gains: bucket label {label!r} is not a string")
        check_text(label, where, "provenance.gains label", 64)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
            raise InputError(where, f"provenance.gains[{label!r}]: {ratio!r} is not a finite number")
    if prov.run_id is not None and (isinstance(prov.run_id, bool) or not isinstance(prov.run_id, int)
                                    or prov.run_id < 1):
        raise InputError(where, f"provenance.run_id: {prov.run_id!r} is neither a positive integer nor null")
    if (prov.run_id is None) != (prov.history is None):
        raise InputError(where, "provenance.run_id and provenance.history go together: the run and its history")
    if prov.state not in PUBLISHED_STATES:
        raise InputError(where, f"provenance.state: {prov.state!r} is not one of {', '.join(PUBLISHED_STATES)}")
    if not isinstance(prov.demo, bool):
        raise InputError(where, f"provenance.demo: {prov.demo!r} is not a boolean")
    profile = prov.class_profile or {}
    if len(profile) > MAX_CLASS_PROFILE_FIELDS:
        raise InputError(where, f"provenance.class_profile: {len(profile)} fields; at most "
                         f"{MAX_CLASS_PROFILE_FIELDS} are published")
    for key, value in profile.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InputError(where, f"provenance.class_profile[{key!r}]: {value!r} is neither a string nor an "
                             "integer")
        check_text(key, where, "provenance.class_profile key", 64)
        if isinstance(value, str):
            check_text(value, where, f"provenance.class_profile.{key}")
