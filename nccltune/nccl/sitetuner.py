"""The tuner NCCL would load on this node without nccltune's: one rule for the plan, the class
profile's table, `nccltune env` and doctor. It sits above both readers it joins: what the site's conf
files and network plugin offer (nccl/site.py) and which plugin is nccltune's own (tuner/build.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..tuner.build import is_own_tuner
from .site import SiteTuner, conf_settings, site_tuner
from .site import conf_files as default_conf_files

__all__ = ["default_conf_files", "existing_tuner"]


def existing_tuner(env: Mapping[str, str], conf_files: list[Path]) -> SiteTuner | None:
    """The tuner NCCL would load without nccltune, when it is not nccltune's: named by
    NCCL_TUNER_PLUGIN in the environment or a conf file (the environment first, as NCCL reads it),
    else ``libnccl-tuner.so`` or the network plugin's own tuner (nccl.site.site_tuner)."""
    return site_tuner(env, conf_settings(env, conf_files), is_own=is_own_tuner)
