"""What a job runs with: the one precedence rule every form of handing out the published set follows.

The rule (README "What a job gets", the precedence table):

1. ``NCCLTUNE_DISABLE`` set to anything but empty or ``0`` in the job's environment: nothing
   published is applied, in any form that can see the job's environment.
2. Otherwise a variable the job sets itself is the job's decision: its own value is kept, even an
   empty one, and the published value of that name is left out.
3. Every other published variable of the part the job gets (``publish.job_env``: the every-job
   part, plus the single-node part for a job known to run on one node) is added, and the marker
   ``NCCLTUNE_APPLIED`` names the set and what was added (delivery.applied: ``merged``; nothing
   added, the job's marker stays as it is).

The other way round, ``from_published`` is what a sweep started from such a job makes of its
calling environment: the variables the marker names whose values are still the ones the state
directory's published set holds came from nccltune, not from the job, and are never its pins.

`nccltune exec` and `nccltune env` call `decide` here. The shell launchers (launchers/nccltune-torchrun,
launchers/slurm-prolog.sh) cannot import Python and carry the same three steps in sh; the tests run
every form against the same jobs and compare the results with `decide`. Forms that never see the
job's environment (systemd EnvironmentFile=, docker --env-file, the nccl.conf block, a CDI device's
env) get the same result from their consumer's own order, or cannot, as the README table says.

Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..nccl.site import ConfSetting, SiteTuner
from .applied import APPLIED_VAR, merged

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
