"""The one publish function: a Setting onto this node.

Every decider (the sweep, the one-GPU node, a class profile, the daemon's safe republish) calls
``publish_setting``, so they all write the same files the same way: the state directory created
under the trust rule where missing, the set as one generation (generations.py; NCCL_TOPO_FILE
names the generation's own topology file; a class profile's document is a file of it), the
stable copy of the topology file (``publish.topology_file``, for site scripts that name one
path; its directory under the trust rule), the state directory's copy of the class profile in
force (``<state_dir>/class-profile.json``) and the managed nccl.conf block when one is configured.
The generation writer (generations.publish_generation) is this module's alone: no decider and no
test of a published set calls it past ``publish_setting``.

The one write outside a publish is ``refresh_topology_copy``: the daemon keeps the stable copy equal
to the node's XML while the published set is for this topology, through the same write.

Everything that could be refused is checked before the first byte is written; the state
directory's copies follow the switch to the new generation, so a refusal or a failure leaves the
previous set, the previous profile in force and the previous copies as they were.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..errors import InputError, NccltuneError
from ..files.atomicfile import atomic_write
from ..files.trust import ensure_dir, trusted_target
from .cdi import prepare_dir, write_spec
from .formats import CLASS_PROFILE_NAME, render_set
from .generations import GENERATIONS_DIR, PublishedFiles, publish_generation
from .ncclconf import check_nccl_conf, update_nccl_conf
from .policy import ENV_PLUGIN_VAR, ENV_TABLE_VAR, TUNER_FINGERPRINT_VAR, TUNER_PLUGIN_VAR, TUNER_TABLE_VAR
from .readback import read_published
from .setting import PublishError, Setting

# The class profile in force: in the generation it was published with (the copy that switches
# with the set) and, once that generation is current, in the state directory.
PROFILE_IN_FORCE = CLASS_PROFILE_NAME
# NCCL hands only NCCL_* from its conf file to the process, so the plugin could never find its
# table there: the tuner is for jobs that take nccl.sh or nccl.env.
_NOT_IN_NCCL_CONF = frozenset({TUNER_PLUGIN_VAR, TUNER_TABLE_VAR, TUNER_FINGERPRINT_VAR, ENV_PLUGIN_VAR, ENV_TABLE_VAR})


def publish_setting(cfg: Config, setting: Setting) -> PublishedFiles:
    """Publish ``setting`` on this node (see the module docstring) and return what was written.

    Raises:
        InputError: a value, bound, path or directory that is refused; nothing was written (exit 78).
        PublishError: the OS refused a write (exit 1); the published set is the previous one
            unless the failure came after the switch (the nccl.conf block, the state copies).
        BusyError: another publisher kept the directory locked (exit 75).
    """
    setting.check()
    render_set(setting, Path(cfg.publish_dir) / GENERATIONS_DIR / "0", 0)
    if cfg.nccl_conf is not None:
        check_nccl_conf(cfg.nccl_conf)
    if cfg.cdi_dir is not None:
        prepare_dir(cfg.cdi_dir)
    state = Path(cfg.state_dir)
    try:
        ensure_dir(state, "state directory")
    except OSError as exc:
        raise InputError(str(state), f"cannot create the state directory: {exc.strerror}") from exc
    topology_copy = _topology_copy(cfg) if setting.topology_xml is not None else None
    published = publish_generation(cfg.publish_dir, setting)
    if topology_copy is not None and setting.topology_xml is not None:
        atomic_write(topology_copy, setting.topology_xml)
    if setting.class_profile is not None:
        atomic_write(state / PROFILE_IN_FORCE, setting.class_profile)
    if cfg.nccl_conf is not None:
        conf_env = {name: value for name, value in published.env.items() if name not in _NOT_IN_NCCL_CONF}
        update_nccl_conf(cfg.nccl_conf, conf_env, setting.provenance)
    if cfg.cdi_dir is not None:
        # The same generation for Kubernetes pods (nccltune.publish.cdi), after the switch like the copies above.
        write_spec(cfg.cdi_dir, Path(cfg.publish_dir) / GENERATIONS_DIR / str(published.generation),
                   published.env, published.single_node_env, published.set_id)
    return published


def _topology_copy(cfg: Config) -> Path:
    """The stable copy's path, its directory's chain under the trust rule (it is replaced by a
    rename: a link at the name is replaced, never followed).

    Raises:
        InputError: a directory on the way is not to be trusted (exit 78).
        PublishError: the directory cannot be reached (exit 1).
    """
    try:
        return trusted_target(cfg.topology_file, "topology file copy", follow_last=False)
    except InputError:
        raise
    except OSError as exc:
        raise PublishError(cfg.topology_file, exc, action="cannot reach its directory") from exc


def refresh_topology_copy(cfg: Config, topology_xml: str, topology_fingerprint: str) -> bool:
    """Rewrite the stable copy (``publish.topology_file``) with ``topology_xml`` where it differs and
    the published set is for this topology (``topology_fingerprint``): a tuned environment always
    comes with the file it was measured with. Nothing is written while nothing is published, the
    set cannot be read (the caller's start-up check reports it) or it is for another topology.

    Returns whether the copy was written.

    Raises:
        InputError, PublishError: as publish_setting's copy (exit 78, exit 1).
    """
    path = Path(cfg.topology_file)
    try:
        if path.exists() and path.read_text() == topology_xml:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    try:
        published = read_published(cfg.publish_dir)
    except NccltuneError:
        return False
    if published is None or published[1].get("topology_fingerprint") != topology_fingerprint:
        return False
    atomic_write(_topology_copy(cfg), topology_xml)
    return True
