"""nccltune's own topology file as a trial's or a Setting's environment names it: a marker.

A sweep decides *whether* NCCL_TOPO_FILE names nccltune's own topology file once (the plan: not
where the site pins one) and carries that decision as the value ``OWN_TOPOLOGY`` from the plan to
the rank processes and to the published set. Only the code that knows where the file lies turns
the marker into a path:

- the runner (trials/trialenv.py): the run's copy, ``runs/NNNNN/ncclTopology.xml``;
- a joining node (trials/launch/torchrun.py): the copy it writes in its trial directory from the
  text that came over the control channel;
- the publisher (formats.render_set): the generation's own copy;
- the run's record (pipeline/choice.py): the stable copy, ``publish.topology_file``.

Whose topology file a published set names is one rule (``topology_pin``, ``topology_env``), the
same for the sweep, the one-GPU publish, ``apply`` and the daemon's safe republish: a topology file
someone else names wins everywhere. A config pin (``sweep.pin NCCL_TOPO_FILE``) is published as its
path for every job; the site's (NCCL's conf files, nccl.site) is left to NCCL, which reads it
there, and nothing is published over it; only where nothing pins it (or ``sweep.unpin`` frees the
pin) is nccltune's own the published one. The job's environment never pins it (the sweep manages
the variable: a value there may be an earlier publish's).

The marker is no absolute path, so one that slipped through unresolved is refused wherever a path
is checked (policy.check_path_variables) rather than reaching NCCL as a file name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..nccl.site import conf_settings

TOPO_FILE_VAR = "NCCL_TOPO_FILE"
# In the safe value alphabet (policy.SAFE_VALUE_CHARS), so a candidate carrying it passes the
# control channel's value rules like any other.
OWN_TOPOLOGY = "@nccltune-topology-file"


# The source of a pin the config makes (sweep.plan.Pinned.source spells it the same way).
CONFIG_SOURCE = "config"


@dataclass(frozen=True)
class TopologyPin:
    """A topology file that is not nccltune's: ``value`` its path, ``source`` "config" (sweep.pin)
    or "conf file PATH" (the site's, as sweep.plan.Pinned names it)."""

    value: str
    source: str

    @property
    def published(self) -> bool:
        """Whether the set names it: a config pin is published for every job; the site's is read
        by NCCL from its conf file, where a published value would beat it."""
        return self.source == CONFIG_SOURCE


def topology_pin(config_pins: Mapping[str, str], unpin: Collection[str],
                 site_pins: Mapping[str, tuple[str, str]]) -> TopologyPin | None:
    """THE rule for whose topology file is published (see the module docstring): the config's pin,
    else the site's (``site_pins``: name -> (value, the conf file that sets it), as
    sweep.plan.build_plan takes them), unless ``unpin`` frees the variable; None: nothing pins it,
    and nccltune's own is published. The sweep's plan finds the same pin from the same inputs
    (tests/test_topology_pin.py holds them to one answer)."""
    if TOPO_FILE_VAR in unpin:
        return None
    if TOPO_FILE_VAR in config_pins:
        return TopologyPin(config_pins[TOPO_FILE_VAR], CONFIG_SOURCE)
    if TOPO_FILE_VAR in site_pins:
        value, where = site_pins[TOPO_FILE_VAR]
        return TopologyPin(value, f"conf file {where}")
    return None


def node_topology_pin(config_pins: Mapping[str, str], unpin: Collection[str],
                      env: Mapping[str, str]) -> TopologyPin | None:
    """``topology_pin`` for a process with environment ``env``, the site's conf files read as NCCL
    reads them (nccl.site.conf_settings, as the sweep's plan reads them): what ``apply`` and the
    daemon's republish ask."""
    site = {name: (found.value, str(found.path)) for name, found in conf_settings(env).items()
            if name == TOPO_FILE_VAR}
    return topology_pin(config_pins, unpin, site)


def topology_env(pin: TopologyPin | None, *, own: bool = True) -> dict[str, str]:
    """What a Setting's every-job part says of NCCL_TOPO_FILE under ``pin`` (topology_pin): the
    config's path; nothing for the site's; nccltune's own (the marker, named by the publisher as
    the generation's copy) where nothing pins it and ``own`` (the sweep: its chosen candidate used
    it)."""
    if pin is not None:
        return {TOPO_FILE_VAR: pin.value} if pin.published else {}
    return {TOPO_FILE_VAR: OWN_TOPOLOGY} if own else {}


def names_own_topology(env: Mapping[str, str]) -> bool:
    """Whether ``env`` asks for nccltune's own topology file."""
    return env.get(TOPO_FILE_VAR) == OWN_TOPOLOGY


def resolve_topology(env: Mapping[str, str], path: Path | str | None) -> dict[str, str]:
    """``env`` with the marker replaced by ``path``; every other value as it is.

    Raises:
        ValueError: ``env`` carries the marker and no path is known for it (a caller's mistake:
            NCCL would be handed the marker as a file name).
    """
    out = dict(env)
    if names_own_topology(out):
        if path is None:
            raise ValueError(f"{TOPO_FILE_VAR} names nccltune's own topology file, and none is known here")
        out[TOPO_FILE_VAR] = str(path)
    return out
