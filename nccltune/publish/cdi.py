"""The published set as a CDI spec, so that Kubernetes pods get it without a hostPath of their own.

CDI (the Container Device Interface, cncf-tags/container-device-interface) is how containerd and
CRI-O add a device's files and environment to a container that asks for it: they read JSON specs
from their spec directories (``/etc/cdi`` for static ones, ``/var/run/cdi`` for generated ones,
the later taking precedence) and apply a requested device's ``containerEdits`` to the container's
OCI spec. After every publish nccltune writes one spec, ``<dir>/nccltune.io-tuning.json``
(``publish.cdi_dir``), replaced atomically (the runtimes watch the directory and may read it at any
moment), with three devices of kind ``nccltune.io/tuning``:

``every-job``      the every-job part as env, and the generation directory mounted read-only at
                   its own host path (the files the env names: topology file, tuner plugin and table)
``single-node``    the every-job part and the single-node part: for a pod that is a whole
                   one-node job
``files``          the mount only, plus ``NCCLTUNE_ENV_FILE`` naming the generation's nccl.sh, for
                   an entrypoint that starts through ``nccltune-torchrun`` (which applies the
                   precedence rule: the pod's own values kept, ``NCCLTUNE_DISABLE`` honoured)

A pod does not know how many nodes its job spans, so no device carries a part by node count
(nccl-nodes-N, docs/job-shapes.md): ``every-job`` is the safe part a job of any size may get,
``single-node`` adds the part of a one-node job the pod spec says it is. A pod of a multi-node job
that wants its shape's part requests ``files`` and starts through ``nccltune-torchrun --nnodes N``:
the mounted generation directory holds every part's files, and the wrapper picks the part by the
rule.

Both carry the marker of what they apply (``NCCLTUNE_APPLIED``, publish.applied), naming the
set and every variable of the device's env, as the published files do, so that a sweep run in such
a pod sweeps them instead of taking them for the pod's pins.

A runtime applies a device's env over the container's own (the CDI library's
``AddMultipleProcessEnv`` replaces a variable of the same name), so the ``every-job`` and
``single-node`` devices cannot keep a value the pod spec sets itself: a pod that sets its own NCCL
values, or wants to opt out per run, requests ``files`` and starts through the wrapper
(docs/kubernetes.md). Mounts name the generation's own directory, so a pod started on generation N
keeps its files while the node publishes N+1 (the bind mount holds them even once pruned).

Standard library only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..files.atomicfile import atomic_write
from ..files.trust import ensure_dir
from .applied import APPLIED_VAR

# The least version whose features the spec uses (a mount's `type`, 0.4.0): a runtime built with an
# older CDI library refuses a version it does not know (Debian 12's library knows 0.3.0 to 0.5.0),
# and newer libraries accept every version from 0.3.0 whose features cover the spec. Hence also no
# annotations (0.6.0): the generation is in the mount's path.
CDI_VERSION = "0.4.0"
VENDOR = "nccltune.io"
CLASS = "tuning"
KIND = f"{VENDOR}/{CLASS}"
SPEC_NAME = f"{VENDOR}-{CLASS}.json"
EVERY_JOB_DEVICE = "every-job"
SINGLE_NODE_DEVICE = "single-node"
FILES_DEVICE = "files"
ENV_FILE_VAR = "NCCLTUNE_ENV_FILE"
# Read-only, and no device files or set-uid programs through it; not noexec: NCCL dlopens the
# tuner plugin from it.
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")

# The CDI spec's rules for a kind's name segment and a device name (SPEC.md, "Kind", "Devices").
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
_VENDOR_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


def _env_list(env: Mapping[str, str]) -> list[str]:
    return [f"{name}={value}" for name, value in sorted(env.items())]


def render_spec(generation_dir: Path, every_job: Mapping[str, str], single_node: Mapping[str, str],
                set_id: str | None = None) -> dict[str, Any]:
    """The CDI spec of one published generation (see the module docstring); `set_id` names the
    set in the devices' marker (None: no marker)."""
    directory = str(generation_dir)
    mount = {"hostPath": directory, "containerPath": directory, "type": "bind", "options": list(MOUNT_OPTIONS)}
    every = dict(sorted(every_job.items()))
    both = {**every, **dict(sorted(single_node.items()))}
    marks: tuple[dict[str, str], dict[str, str]] = ({}, {})
    if set_id is not None:
        marks = ({APPLIED_VAR: f"{set_id}:{','.join(every)}"}, {APPLIED_VAR: f"{set_id}:{','.join(both)}"})
    devices = [
        {"name": EVERY_JOB_DEVICE,
         "containerEdits": {"env": _env_list({**every, **marks[0]}), "mounts": [dict(mount)]}},
        {"name": SINGLE_NODE_DEVICE,
         "containerEdits": {"env": _env_list({**both, **marks[1]}), "mounts": [dict(mount)]}},
        {"name": FILES_DEVICE,
         "containerEdits": {"env": _env_list({ENV_FILE_VAR: str(generation_dir / "nccl.sh")}),
                            "mounts": [dict(mount)]}},
    ]
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices}


def check_spec(spec: Mapping[str, Any]) -> None:
    """The rules of the CDI spec that its JSON schema does not carry: the kind's vendor and class,
    device names, unique devices, NAME=value env entries, absolute mount paths.

    Raises:
        InputError: naming the field (exit 78).
    """
    vendor, slash, cls = str(spec.get("kind", "")).partition("/")
    if not slash or not _VENDOR_RE.match(vendor) or len(vendor) > 253 or not _NAME_RE.match(cls):
        raise InputError("CDI spec", f"kind {spec.get('kind')!r} is not vendor/class")
    seen: set[str] = set()
    for device in spec.get("devices", []):
        name = device.get("name", "")
        if not _NAME_RE.match(name) or name in seen:
            raise InputError("CDI spec", f"device name {name!r} is not valid or not unique")
        seen.add(name)
        edits = device.get("containerEdits", {})
        for entry in edits.get("env", []):
            if "=" not in entry or not entry.partition("=")[0]:
                raise InputError("CDI spec", f"device {name}: env entry {entry!r} is not NAME=value")
        for mount in edits.get("mounts", []):
            if not str(mount.get("hostPath", "")).startswith("/") or not str(mount.get("containerPath", "")) \
                    .startswith("/"):
                raise InputError("CDI spec", f"device {name}: mount paths must be absolute")


def prepare_dir(cdi_dir: Path) -> None:
    """Create the spec directory where missing and check it may be trusted, before anything is
    published, so that a directory that is refused stops the publish instead of following it.

    Raises:
        InputError: it cannot be created or may not be trusted (exit 78).
    """
    try:
        # The runtimes run what a spec says (its hooks) as root: the directory must be root's.
        ensure_dir(cdi_dir, "CDI spec directory")
    except OSError as exc:
        raise InputError(str(cdi_dir), f"cannot create the CDI spec directory: {exc.strerror}") from exc


def write_spec(cdi_dir: Path, generation_dir: Path, every_job: Mapping[str, str],
               single_node: Mapping[str, str], set_id: str | None = None) -> Path:
    """Write (atomically replace) ``<cdi_dir>/nccltune.io-tuning.json`` for a generation, the set
    named `set_id` in the marker.

    Raises:
        InputError: the spec breaks a CDI rule (exit 78).
        PublishError: the OS refused the write (exit 1).
    """
    spec = render_spec(generation_dir, every_job, single_node, set_id)
    check_spec(spec)
    target = Path(cdi_dir) / SPEC_NAME
    prepare_dir(cdi_dir)
    atomic_write(target, json.dumps(spec, indent=2, sort_keys=True) + "\n")
    return target
