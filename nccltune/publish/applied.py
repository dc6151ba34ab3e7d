"""The marker of what a launch applied of the published set: ``NCCLTUNE_APPLIED``.

Every form that hands the published set to a job also leaves this one variable in the job's
environment, so that a sweep started from such a job can tell the values nccltune published from
the job's own (a published value is never a pin: delivery.jobenv.from_published). Its value:

    GENERATION:DIGEST:NAME,NAME,...

``GENERATION`` and ``DIGEST`` name the published set (its generation number and the first 16 hex
digits of the SHA-256 of its nccl.json, ``set_digest``: the document that holds both parts and
the provenance); the names are the variables that form set in the job's environment, in the order
it set them (the every-job part, then the single-node part, each sorted as the files are).

- The published files carry the marker as their last assignment, naming every variable of the
  file (the single-node files: both parts, as they are loaded after the every-job file), for the
  forms that apply the whole file: systemd ``EnvironmentFile=``, ``docker --env-file``, a script
  that sources nccl.sh. The CDI spec's ``every-job`` and ``single-node`` devices carry it the same
  way.
- The forms that follow the precedence rule (``nccltune exec``/``env``, launchers/nccltune-torchrun,
  launchers/slurm-prolog.sh) never apply the file's marker line; they take the set's
  ``GENERATION:DIGEST`` from it and name only what they applied themselves (``merged``): a value
  the job kept is not named. A launch that applied nothing leaves the job's marker as it is; one
  inside another launch of the same set adds its names to those the job's marker already gives
  (a marker of another set, or one that is not of this form, is replaced).

A launch that could not use the published set (nothing published, or a set that cannot be
trusted, read or checked: docs/launch-failures.md) runs the job untuned and leaves
``untuned:REASON`` instead (``untuned_marker``; REASON one of ``UNTUNED_REASONS``), unless the job
already has a marker of an earlier launch, which then stays as it is (the values it names are still
that launch's). It names no set and no variable, so a sweep takes it as "nothing came from nccltune".

The marker is never trusted for anything but leaving a pin out: a sweep drops a named variable
from its pins only while the job's value equals the value the state directory's own published set
holds (delivery.jobenv.from_published), so a forged marker can at most get a job's own value that
equals the published one swept.

Standard library only; the shell launchers carry the same rule in sh (tests compare them).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

APPLIED_VAR = "NCCLTUNE_APPLIED"
DIGEST_CHARS = 16
# A name as the published files spell one (names.PUBLISHED_NAME_RE without its anchors).
_NAME = r"(?:NCCL|TORCH_NCCL|NCCLTUNE)_[A-Z0-9_]+"
_MARKER_RE = re.compile(rf"(?P<generation>0|[1-9][0-9]{{0,17}}):(?P<digest>[0-9a-f]{{{DIGEST_CHARS}}}):"
                        rf"(?P<names>{_NAME}(?:,{_NAME})*)?")
# Far beyond what a set can name (two parts of at most 256 variables); a longer value is no marker.
MAX_MARKER_CHARS = 1 << 20
# What a launch that used nothing of the published set leaves, and why: nothing is published, or
# what is there is refused (untrusted, unreadable, malformed, a mixed or stale generation).
UNTUNED_PREFIX = "untuned:"
NOTHING_PUBLISHED = "nothing-published"
REFUSED = "refused"
UNTUNED_REASONS = (NOTHING_PUBLISHED, REFUSED)


def untuned_marker(reason: str) -> str:
    """The marker's value for a launch that ran the job untuned for `reason` (UNTUNED_REASONS)."""
    if reason not in UNTUNED_REASONS:
        raise ValueError(f"not an untuned reason: {reason!r}")
    return UNTUNED_PREFIX + reason


def untuned_reason(text: str) -> str | None:
    """The reason an untuned marker gives, or None when `text` is not one."""
    reason = text.removeprefix(UNTUNED_PREFIX)
    return reason if text.startswith(UNTUNED_PREFIX) and reason in UNTUNED_REASONS else None


def set_digest(json_bytes: bytes) -> str:
    """The digest that names a published set in the marker: of its nccl.json, as written."""
    return hashlib.sha256(json_bytes).hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True)
class Applied:
    """One marker: the set it names (``generation``, ``digest``) and the variables it names."""

    generation: int
    digest: str
    names: tuple[str, ...] = ()

    @property
    def set_id(self) -> str:
        """``GENERATION:DIGEST``: which published set."""
        return f"{self.generation}:{self.digest}"

    @property
    def value(self) -> str:
        return f"{self.set_id}:{','.join(self.names)}"

    @classmethod
    def parse(cls, text: str) -> Applied | None:
        """The marker ``text`` spells, or None for any other text."""
        if len(text) > MAX_MARKER_CHARS:
            return None
        match = _MARKER_RE.fullmatch(text)
        if match is None:
            return None
        names = tuple(match["names"].split(",")) if match["names"] else ()
        return cls(int(match["generation"]), match["digest"], names)


def merged(existing: str | None, set_id: str, applied: Iterable[str]) -> str | None:
    """The marker a launch of the set ``set_id`` leaves after setting the variables ``applied`` in
    a job whose own marker is ``existing`` (None: it has none): None when it applied nothing (the
    job's marker, if any, stays); else ``set_id`` with the names of the job's marker of that same
    set, then the applied ones not among them."""
    new = list(applied)
    if not new:
        return None
    prior = Applied.parse(existing) if existing is not None else None
    names = list(prior.names) if prior is not None and prior.set_id == set_id else []
    for name in new:
        if name not in names:
            names.append(name)
    return f"{set_id}:{','.join(names)}"
