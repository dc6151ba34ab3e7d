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

The marker is no absolute path, so one that slipped through unresolved is refused wherever a path
is checked (policy.check_path_variables) rather than reaching NCCL as a file name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

TOPO_FILE_VAR = "NCCL_TOPO_FILE"
# In the safe value alphabet (policy.SAFE_VALUE_CHARS), so a candidate carrying it passes the
# control channel's value rules like any other.
OWN_TOPOLOGY = "@nccltune-topology-file"


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
