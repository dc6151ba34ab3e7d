"""The one builder of a published set's Provenance: what made it, in the same spelling whoever decided.

Every decider builds the provenance of its Setting here (``build_provenance``): the sweep and the one-GPU
publish (pipeline/stages.py), a class profile (fleet/apply.py: ``nccltune apply``, ``fleet
apply``, the daemon's ``profile.path``) and the daemon's safe republish (daemon/actions.py). The
builder sets what is the same for all of them: the nccltune version that published, the time in
UTC to the second, the run and its history (an absolute path, read back by
trials/session.py's close_dead_runs). What differs (the node's facts, the NCCL version, the state,
the gains, the class profile) is the decider's to pass.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from pathlib import Path

from .. import __version__
from .setting import Provenance


def timestamp(when: _dt.datetime | None = None) -> str:
    """``when`` (now when None) in UTC, ISO 8601 to the second: every published set's ``created_at``."""
    moment = when if when is not None else _dt.datetime.now(_dt.timezone.utc)
    return moment.astimezone(_dt.timezone.utc).isoformat(timespec="seconds")


def build_provenance(*, topology_fingerprint: str, nccl_version: str | None, backend: str, demo: bool, state: str,
               created_at: _dt.datetime | None = None, profile: str | None = None,
               gains: Mapping[str, float] | None = None, note: str | None = None,
               tuning_fingerprint: str | None = None, class_profile: Mapping[str, str | int] | None = None,
               run: tuple[int, Path | str] | None = None, image: Mapping[str, str] | None = None) -> Provenance:
    """The provenance of one Setting (see the module docstring). ``run``: the sweep's run id and its
    history.db, recorded together or not at all; ``state``: one of setting.PUBLISHED_STATES
    (Setting.check refuses any other)."""
    return Provenance(
        nccltune_version=__version__, created_at=timestamp(created_at),
        topology_fingerprint=topology_fingerprint, nccl_version=nccl_version, backend=backend, demo=demo,
        profile=profile, gains=dict(gains or {}), note=note, tuning_fingerprint=tuning_fingerprint, state=state,
        class_profile=class_profile, run_id=run[0] if run is not None else None,
        history=str(Path(run[1]).resolve()) if run is not None else None, image=image)
