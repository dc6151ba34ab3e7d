"""Publishing in tests as every decider publishes: one Setting through publish.publish_setting.

``publish_set`` stands for a node whose state directory (and so its publish directory) is
``state``, unless a ``cfg`` is given: the set as one generation, the stable topology copy where the
Setting carries topology XML, and the nccl.conf block and CDI spec where the config names them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from nccltune.config import Config
from nccltune.publish import Provenance, PublishedFiles, Setting, Tuner, publish_setting


def publish_set(state: Path, env: Mapping[str, str], prov: Provenance, *, topology_xml: str | None = None,
                single_node_env: Mapping[str, str] | None = None, tuner: Tuner | None = None,
                cfg: Config | None = None, nodes_env: Mapping[int, Mapping[str, str]] | None = None) -> PublishedFiles:
    """Publish ``env`` (every job), ``single_node_env`` and the parts by node count ``nodes_env``
    with ``prov`` on the node of ``cfg`` (default: a node whose state directory is ``state``);
    what publish_setting wrote."""
    node = cfg if cfg is not None else Config(state_dir=str(state))
    return publish_setting(node, Setting(env, prov, single_node_env or {}, topology_xml, tuner,
                                         nodes_env=nodes_env or {}))
