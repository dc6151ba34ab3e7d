"""What a job runs with: the one precedence rule every form of handing out the published set follows.

The rule (docs/what-a-job-gets.md, "Which value wins" and its table of forms):

1. ``NCCLTUNE_DISABLE`` set to anything but empty or ``0`` in the job's environment: nothing
   published is applied, in any form that can see the job's environment.
2. Otherwise a variable the job sets itself is the job's decision: its own value is kept, even an
   empty one, and the published value of that name is left out.
3. Every other published variable of the part the job gets (``publish.job_env``, THE rule by the
   job's node count, publish/shapes.py: the every-job part, plus the single-node part for a job
   known to run on one node, or the part of the largest measured node count <= the job's) is added, and the marker
   ``NCCLTUNE_APPLIED`` names the set and what was added (publish.applied: ``merged``; nothing
   added, the job's marker stays as it is).

The other way round, ``from_published`` is what a sweep started from such a job makes of its
calling environment: the variables the marker names whose values are still the ones the state
directory's published set holds came from nccltune, not from the job, and are never its pins.

The failure policy (docs/launch-failures.md): a job is never blocked by nccltune. When nothing is
published, or the published set cannot be trusted, read or checked, the job runs untuned (NCCL's
defaults: nothing of the set applied), the launch says so once on stderr, and the marker says
``untuned:REASON`` (publish.applied) unless the job's own marker of an earlier launch stays.
``launch`` is that policy for `nccltune exec` and `nccltune env`; `NCCLTUNE_DISABLE` is looked at
first, so an opted-out job never reads the set at all.

`nccltune exec` and `nccltune env` call `launch` here. The shell launchers (launchers/nccltune-torchrun,
launchers/slurm-prolog.sh) cannot import Python and carry the same three steps in sh; the tests run
every form against the same jobs and compare the results with `decide`. Forms that never see the
job's environment (systemd EnvironmentFile=, docker --env-file, the nccl.conf block, a CDI device's
env) get the same result from their consumer's own order, or cannot, as that table says.

Standard library only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EXIT_CHECK_FAILED, EXIT_OK, NccltuneError
from ..logsetup import escaped
from ..nccl.site import ConfSetting, SiteTuner
from ..publish import PublishedSet, job_env, read_set
from ..publish.applied import APPLIED_VAR, NOTHING_PUBLISHED, REFUSED, Applied, merged, untuned_marker, untuned_reason

log = logging.getLogger(__name__)

DISABLE_VAR = "NCCLTUNE_DISABLE"

# A line of nccl.sh (export NAME='value') or nccl.env (NAME=value), as the publisher writes them.
_ASSIGNMENT_RE = re.compile(r"^(?:export )?(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")


def opted_out(environ: Mapping[str, str]) -> bool:
    """Whether the job said NCCLTUNE_DISABLE (any value but empty or 0)."""
    return environ.get(DISABLE_VAR, "") not in ("", "0")


@dataclass(frozen=True)
class JobDecision:
    """The result of the rule for one job.

    applied: the published variables the job gets. kept: name -> (the job's own value, the
    published value it keeps out), for every published name the job already sets. opted_out:
    NCCLTUNE_DISABLE said nothing applies (applied and kept are then empty)."""

    applied: dict[str, str] = field(default_factory=dict)
    kept: dict[str, tuple[str, str]] = field(default_factory=dict)
    opted_out: bool = False
    marker: str | None = None  # NCCLTUNE_APPLIED's new value; None: the job's own stays as it is

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The job's environment with the decision applied, the marker with it."""
        env = {**environ, **self.applied}
        if self.marker is not None:
            env[APPLIED_VAR] = self.marker
        return env

    def notes(self, prog: str) -> list[str]:
        """One line per kept value that differs from the published one (the same value is no override)."""
        return [f"{prog}: {name}={own} set by the job is kept (published: {published})"
                for name, (own, published) in sorted(self.kept.items()) if own != published]


def decide(offered: Mapping[str, str], environ: Mapping[str, str], set_id: str | None = None) -> JobDecision:
    """Apply the rule to `offered` (the part of the published set the job's shape gets, in the
    order the files set it) for a job whose own environment is `environ`; `set_id` names the set
    in the marker (``PublishedSet.set_id``; None: no marker)."""
    if opted_out(environ):
        return JobDecision(opted_out=True)
    applied = {name: value for name, value in offered.items() if name not in environ}
    kept = {name: (environ[name], value) for name, value in offered.items() if name in environ}
    marker = None if set_id is None else merged(environ.get(APPLIED_VAR), set_id, applied)
    return JobDecision(applied, kept, marker=marker)


@dataclass(frozen=True)
class Launch:
    """What one launch hands a job (``launch``): the decision over the published set it read, or,
    with ``untuned`` set (a reason of publish.applied.UNTUNED_REASONS), nothing of the set, and
    ``message`` the one line that says why (for stderr) and ``exit_code`` the code of the failure
    (errors.py: 78 untrusted or malformed, 1 unreadable or nothing published), which `nccltune env`
    exits with after printing what the job gets; `nccltune exec` runs the command all the same."""

    decision: JobDecision
    published: PublishedSet | None = None
    untuned: str | None = None
    message: str = ""
    exit_code: int = EXIT_OK

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The job's environment as this launch leaves it."""
        return self.decision.environment(environ)


def launch(publish_dir: Path, environ: Mapping[str, str], nnodes: int | None) -> Launch:
    """THE failure policy and the precedence rule for a job whose own environment is `environ`,
    of `nnodes` nodes (None: it does not say), from the set published in `publish_dir`. Never
    raises for the set: nothing published, or a set ``read_set`` refuses (untrusted, unreadable,
    malformed, mixed, a generation that is gone), gives an untuned launch."""
    if opted_out(environ):
        return Launch(JobDecision(opted_out=True))
    try:
        got = read_set(publish_dir)
    except NccltuneError as exc:
        return _untuned(REFUSED, f"the published set in {publish_dir} cannot be used "
                        f"({escaped(exc.message, 600)})", environ, exc.exit_code)
    if got is None:
        return _untuned(NOTHING_PUBLISHED, f"nothing is published in {publish_dir}", environ, EXIT_CHECK_FAILED)
    return Launch(decide(job_env(got, nnodes), environ, got.set_id), got)


def _untuned(reason: str, why: str, environ: Mapping[str, str], exit_code: int) -> Launch:
    # The job's marker of an earlier launch stays: the values it names are still that launch's.
    marker = untuned_marker(reason) if APPLIED_VAR not in environ else None
    return Launch(JobDecision(marker=marker), untuned=reason,
                  message=f"{why}; the job runs untuned (NCCL's defaults)", exit_code=exit_code)


def untuned_text(got: Launch, fmt: str) -> str:
    """What `nccltune env` prints for an untuned launch (``fmt`` "sh" or "env"): a comment, and
    the marker where the launch sets one, so that the text can still be sourced or loaded."""
    lines = [f"# nccltune: nothing of the published set applied ({got.untuned}): the job runs untuned"]
    if got.decision.marker is not None:
        quote = "'" if fmt == "sh" else ""
        lines.append(f"{'export ' if fmt == 'sh' else ''}{APPLIED_VAR}={quote}{got.decision.marker}{quote}")
    return "\n".join(lines) + "\n"


def filter_text(text: str, decision: JobDecision) -> str:
    """A published nccl.sh/nccl.env text with the decision applied for printing: a variable the job
    keeps, or every variable when it opted out, becomes a comment that says why, so the output can
    still be sourced or used as an env file and gives exactly `decision.applied`, with the marker
    of what it applies in place of the file's (or a comment: nothing applied). Comments hold no
    '=' (NCCL's conf parser and some env-file readers take any such line as a variable)."""
    lines = []
    for line in text.splitlines():
        match = _ASSIGNMENT_RE.match(line)
        if match is None:
            lines.append(line)
        elif decision.opted_out:
            lines.append(f"# {match['name']}: not applied ({DISABLE_VAR} is set)")
        elif match["name"] == APPLIED_VAR:
            # The file's marker names all it sets; the job gets one that names what it applies.
            if decision.marker is None:
                lines.append(f"# {APPLIED_VAR}: nothing applied, the job's own marker stays")
            else:
                quote = "'" if line.startswith("export ") else ""
                lines.append(f"{line[:match.start('value')]}{quote}{decision.marker}{quote}")
        elif match["name"] in decision.kept:
            # The job's value is not echoed: it may hold anything, a newline included.
            lines.append(f"# {match['name']}: set by the job, its own value is kept")
        else:
            lines.append(line)
    return "\n".join(lines) + "\n" if lines else ""


def site_comment(site: Mapping[str, ConfSetting], tuner: SiteTuner | None) -> str:
    """What the site already gives the job besides nccltune (its NCCL conf files, its tuner), as
    comments for `nccltune env`: names and files only, no values (a value may hold anything)."""
    lines = [f"# kept from the site: {name} ({setting.path})" for name, setting in sorted(site.items())
             if name.startswith(("NCCL_", "TORCH_NCCL_"))]
    if tuner is not None:
        lines.append(f"# kept from the site: the tuner {tuner.value} ({tuner.source})")
    return "".join(line.replace("\n", " ") + "\n" for line in lines)


# What a sweep says when it takes none of a marker.
_ALL_OWN = "every NCCL variable of the environment is the job's own (a pin)"


@dataclass(frozen=True)
class FromPublished:
    """What of a calling environment came from nccltune's published set (``from_published``).

    values: name -> value of the variables a launch set from the set, still as published: never
    a pin, swept as if the job had not set them. generation: the set they came from (None: no
    marker was taken). notes: why a marker, or a name it gives, was not taken (also logged)."""

    values: dict[str, str] = field(default_factory=dict)
    generation: int | None = None
    notes: tuple[str, ...] = ()

    def own(self, environ: Mapping[str, str]) -> dict[str, str]:
        """`environ` as the job itself set it: without the published values and the marker."""
        return {name: value for name, value in environ.items() if name not in self.values and name != APPLIED_VAR}


def from_published(environ: Mapping[str, str], publish_dir: Path) -> FromPublished:
    """Which variables of `environ` (a sweep's calling environment) a launch form set from the set
    published in `publish_dir`: those the marker NCCLTUNE_APPLIED names (publish.applied) whose
    value is still the one that set holds. The marker only ever removes pins: it is taken only
    when it names the set read back from `publish_dir` now (``read_set``: generation and digest),
    a name it gives counts only with the published value (a job that set its own value after the
    launch keeps it as a pin), and a name the set does not hold is ignored; whatever is not taken
    is said in a log line and in ``notes``. Never raises: an unreadable set takes nothing."""
    text = environ.get(APPLIED_VAR)
    if text is None:
        return FromPublished()
    reason = untuned_reason(text)
    if reason is not None:
        note = f"{APPLIED_VAR}={text}: the launch applied nothing of the published set: {_ALL_OWN}"
        log.info("%s", note)
        return FromPublished(notes=(note,))
    marker = Applied.parse(text)
    if marker is None:
        return _ignored(f"{APPLIED_VAR}={escaped(text, 120)} is not a marker nccltune writes: ignored, {_ALL_OWN}")
    named = f"{APPLIED_VAR} names the published set of generation {marker.generation} ({marker.digest})"
    try:
        got = read_set(publish_dir)
    except NccltuneError as exc:
        return _ignored(f"{named}, but the set in {publish_dir} cannot be read ({escaped(exc, 300)}): ignored, "
                        f"{_ALL_OWN}")
    if got is None:
        return _ignored(f"{named}, but nothing is published in {publish_dir}: ignored, {_ALL_OWN}")
    if got.set_id != marker.set_id:
        return _ignored(f"{named}, but the set published in {publish_dir} is generation {got.generation} "
                        f"({got.digest}): ignored, {_ALL_OWN}")
    # A name may be in several parts by job shape, with a value each: a launch applied one of them.
    published: dict[str, set[str]] = {}
    for part in (got.env, *got.parts.values()):
        for name, value in part.items():
            published.setdefault(name, set()).add(value)
    values: dict[str, str] = {}
    foreign: list[str] = []
    changed: list[str] = []
    for name in dict.fromkeys(marker.names):
        if name not in published:
            foreign.append(name)
        elif name in environ and environ[name] in published[name]:
            values[name] = environ[name]
        elif name in environ:
            changed.append(name)
    notes = []
    if foreign:
        notes.append(f"{APPLIED_VAR} names {', '.join(foreign)}, which the published set of generation "
                     f"{got.generation} does not hold: ignored")
    if changed:
        notes.append(f"{', '.join(changed)}: set by the job to another value than published after the launch "
                     "that applied it: the job's own (a pin)")
    for note in notes:
        log.info("%s", note)
    return FromPublished(values, got.generation, tuple(notes))


def _ignored(note: str) -> FromPublished:
    log.warning("%s", note)
    return FromPublished(notes=(note,))
