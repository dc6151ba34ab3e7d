"""Publishing: the only code that writes the files job launchers read.

One Setting (setting.py) is what every decider returns, and one function, ``publish_setting``
(publisher.py), writes it on the node. The set has two scopes: the *every-job* part (nccl.sh,
nccl.env, ``env`` in nccl.json, the nccl.conf block) fits every job on the node whatever its
shape (the topology file, the policy variables, the operator's pins, the tuner plugin and its
table, whose entries apply only to the communicator shape they were measured for); the
*single-node* part (nccl-single-node.sh/.env, ``single_node_env``) holds tuned global variables
measured between this node's GPUs only, which launchers add only for a job known to run on this
one node; a class profile adds a part per measured node count of 2 or more
(nccl-nodes-N.sh/.env, ``nodes_env``), which a job of M nodes gets for the largest N <= M
(``job_env``, the rule of ``shapes``).

What each module owns:

- ``setting``: the frozen Setting, its Provenance and Tuner, and ``Setting.check``;
- ``provenance``: the one builder of a Setting's Provenance, for every decider;
- ``topofile``: the marker that stands for nccltune's own topology file until the runner, a
  joining node or the publisher names the copy it means (``resolve_topology``), and the one rule
  for whose topology file is published (``topology_pin``, ``topology_env``: a pin wins);
- ``policy``: the value policy (name pattern, safe alphabet, variables never published as given,
  the scopes' rule, bounds) and ``preflight``, checked before a sweep's first trial;
- ``formats``: nccl.sh, nccl.env, nccl.json and their header, and a generation's files as bytes;
- ``generations``: the generation sets, the ``current`` link, the publish lock, retention
  (publisher.py's writer: no other module calls it);
- ``ncclconf``: the managed block in ``/etc/nccl.conf``;
- ``readback``: reading the published set for env/exec, verify, the doctor and the daemon;
- ``publisher``: ``publish_setting``, the one publish function, and the profile in force.
"""

from __future__ import annotations

from ..files.atomicfile import STALE_TEMP_AGE_S as STALE_TEMP_AGE_S  # re-exported for older callers
from ..files.atomicfile import atomic_write as atomic_write  # re-exported for older callers
from .formats import (
    DEMO_LINE,
    ENV_NAME,
    EVERY_JOB,
    JSON_NAME,
    MAX_PUBLISHED_BYTES,
    PUBLISHED_NAMES,
    SCHEMA_VERSION,
    SCOPE_APPLIES_TO,
    SCOPE_FILES,
    SH_NAME,
    SINGLE_ENV_NAME,
    SINGLE_NODE,
    SINGLE_SH_NAME,
    TOPOLOGY_NAME,
    TUNER_PLUGIN_NAME,
    TUNER_TABLE_NAME,
    render_env,
    render_json,
    render_sh,
)
from .generations import (
    CURRENT_NAME,
    GENERATIONS_DIR,
    KEEP_GENERATIONS,
    PublishedFiles,
)
from .ncclconf import CONF_BEGIN, CONF_END, CONF_SCOPE_LINE, remove_nccl_conf_block, update_nccl_conf
from .policy import (
    JOB_NNODES_VAR,
    MAX_VALUE_CHARS,
    MAX_VARIABLES,
    NAME_RE,
    PATH_VARIABLES,
    SAFE_VALUE_CHARS,
    TUNER_FINGERPRINT_VAR,
    TUNER_PLUGIN_VAR,
    TUNER_TABLE_VAR,
    check_names,
    check_path_variables,
    preflight,
    validate_env,
)
from .provenance import build_provenance
from .publisher import PROFILE_IN_FORCE, publish_setting
from .readback import PublishedSet, job_env, job_nnodes, parse_lines, read_published, read_set
from .setting import Provenance, PublishError, Setting, Tuner
from .topofile import (
    OWN_TOPOLOGY,
    TOPO_FILE_VAR,
    TopologyPin,
    names_own_topology,
    node_topology_pin,
    resolve_topology,
    topology_env,
    topology_pin,
)

__all__ = [
    "CONF_BEGIN",
    "CONF_END",
    "CONF_SCOPE_LINE",
    "CURRENT_NAME",
    "DEMO_LINE",
    "ENV_NAME",
    "EVERY_JOB",
    "GENERATIONS_DIR",
    "JOB_NNODES_VAR",
    "JSON_NAME",
    "KEEP_GENERATIONS",
    "MAX_PUBLISHED_BYTES",
    "MAX_VALUE_CHARS",
    "MAX_VARIABLES",
    "NAME_RE",
    "OWN_TOPOLOGY",
    "PATH_VARIABLES",
    "PROFILE_IN_FORCE",
    "PUBLISHED_NAMES",
    "SAFE_VALUE_CHARS",
    "SCHEMA_VERSION",
    "SCOPE_APPLIES_TO",
    "SCOPE_FILES",
    "SH_NAME",
    "SINGLE_ENV_NAME",
    "SINGLE_NODE",
    "SINGLE_SH_NAME",
    "STALE_TEMP_AGE_S",
    "TOPOLOGY_NAME",
    "TOPO_FILE_VAR",
    "TUNER_FINGERPRINT_VAR",
    "TUNER_PLUGIN_NAME",
    "TUNER_PLUGIN_VAR",
    "TUNER_TABLE_NAME",
    "TUNER_TABLE_VAR",
    "Provenance",
    "PublishError",
    "PublishedFiles",
    "PublishedSet",
    "Setting",
    "TopologyPin",
    "Tuner",
    "atomic_write",
    "build_provenance",
    "check_names",
    "check_path_variables",
    "job_env",
    "job_nnodes",
    "names_own_topology",
    "node_topology_pin",
    "parse_lines",
    "preflight",
    "publish_setting",
    "read_published",
    "read_set",
    "remove_nccl_conf_block",
    "render_env",
    "render_json",
    "render_sh",
    "resolve_topology",
    "topology_env",
    "topology_pin",
    "update_nccl_conf",
    "validate_env",
]
