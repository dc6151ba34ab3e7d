"""What NCCL actually ran with, read from its own log of a check: the one rule `verify` applies.

Three questions, each answered from NCCL's lines, never from what nccltune meant to publish:

- **Did each published variable reach NCCL?** NCCL logs "NAME set by environment to VALUE" when a
  code path reads a variable. A logged value other than the published one (a site's conf file, a
  wrapper that rewrote it) is a failure. NCCL reads some variables only on some nodes
  (NCCL_IB_HCA without InfiniBand is never read), so a variable it did not log is reported as
  unconfirmed, not as a failure.
- **Was the tuner plugin loaded, and which table did it use?** A published plugin must be the one
  NCCL bound ("TUNER/Plugin: Using nccltune (v5)"); the plugin's own line at each init says which
  table it applied or why none (unreadable, malformed, stale, missing).
- **Did NCCL follow the table?** For the communicator shape the check formed, wherever the table
  has an entry for a size NCCL logged a choice for, NCCL's algorithm and protocol must be the
  entry's. A shape the table holds no entries for keeps NCCL's own choices, as intended.

Every failure carries a stable code (CODES); the same facts go to `verify --json` and the metrics.
A check of several communicator shapes (a one-GPU node forms each N x 1 its table holds) is one
verdict over all of them (`combined`), each finding named by its shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..collectives import TUNED
from ..errors import InputError
from ..tuner.table import TunerTable, read_table
from .debuglog import NcclLog

Code = Literal["variable_differs", "plugin_not_loaded", "table_unreadable", "table_malformed", "table_stale",
               "table_missing", "table_other", "table_not_applied"]
CODES: tuple[Code, ...] = ("variable_differs", "plugin_not_loaded", "table_unreadable", "table_malformed",
                           "table_stale", "table_missing", "table_other", "table_not_applied")

PLUGIN_NAME = "nccltune"
TABLE_VAR = "NCCLTUNE_TUNER_TABLE"

# The plugin's notes at init (nccltune_tuner.c), most specific first.
# A plugin before NCCL version sections said "(N entries, ..." without the section: still read.
_USING_RE = re.compile(r"^using table (.+?) \((?:NCCL [0-9.]+ section, )?\d+ entries, fingerprint [0-9a-f]+\)"
                       r"(?: for a communicator of (\d+) ranks on (\d+) nodes?, (\d+) per node)?", re.ASCII)
_NOTE_CODES: tuple[tuple[re.Pattern[str], Code], ...] = (
    (re.compile(r"^table .+ is stale \(", re.ASCII), "table_stale"),
    # Measured with other NCCL versions only: NCCL changed since, as a stale fingerprint says of the node.
    (re.compile(r"^table .+ has no section for NCCL ", re.ASCII), "table_stale"),
    (re.compile(r"^table .+ is valid, but the running NCCL's version is unknown ", re.ASCII), "table_unreadable"),
    (re.compile(r"^table .+ is (?:malformed|of another format version) \(", re.ASCII), "table_malformed"),
    (re.compile(r"^table .+ is unreadable \(", re.ASCII), "table_unreadable"),
    (re.compile(r"^no table\b", re.ASCII), "table_missing"),
)


@dataclass(frozen=True)
class Finding:
    code: Code
    message: str


@dataclass(frozen=True)
class WhatRan:
    """The verdict on one check's NCCL log."""

    variables: dict[str, str | None]  # published NCCL_* variable -> the value NCCL logged (None: not logged)
    tuner: str | None  # the plugin NCCL bound ("nccltune (v5)"), None for none
    table: str | None  # the table the plugin applied, as it named it
    shape: tuple[int, int, int] | None  # (nnodes, nranks, ranks per node) the plugin saw, when it said
    cells_checked: int  # (collective, size) choices compared with the table's entries
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return not self.findings

    @property
    def unconfirmed(self) -> list[str]:
        """Published variables NCCL never logged reading."""
        return sorted(name for name, value in self.variables.items() if value is None)

    def doc(self) -> dict[str, Any]:
        return {"passed": self.passed, "variables": dict(sorted(self.variables.items())),
                "unconfirmed": self.unconfirmed, "tuner": self.tuner, "table": self.table,
                "shape": list(self.shape) if self.shape else None, "cells_checked": self.cells_checked,
                "findings": [{"code": f.code, "message": f.message} for f in self.findings]}


def _variables(log: NcclLog, env: Mapping[str, str]) -> tuple[dict[str, str | None], list[Finding]]:
    seen: dict[str, str | None] = {}
    findings = []
    for name in sorted(env):
        if not name.startswith("NCCL_"):
            continue  # TORCH_NCCL_* is torch's, NCCLTUNE_* the plugin's: NCCL logs neither
        logged = log.env.get(name)
        seen[name] = logged
        if logged is not None and logged != env[name]:
            findings.append(Finding("variable_differs", f"{name}: published {env[name]!r}, NCCL ran with {logged!r}"))
    return seen, findings


def _tuner(log: NcclLog, env: Mapping[str, str]) -> tuple[str | None, tuple[int, int, int] | None, list[Finding]]:
    """The table the plugin applied and the shape it saw, or why it applied none."""
    if "NCCL_TUNER_PLUGIN" not in env:
        return None, None, []
    if log.tuner is None or not log.tuner.startswith(PLUGIN_NAME + " "):
        bound = f"NCCL bound {log.tuner}" if log.tuner else "NCCL loaded no tuner plugin"
        return None, None, [Finding("plugin_not_loaded", f"{bound}, not nccltune's ({env['NCCL_TUNER_PLUGIN']})")]
    findings: list[Finding] = []
    table: str | None = None
    shape: tuple[int, int, int] | None = None
    for note in dict.fromkeys(log.tuner_notes):  # one line per communicator: each distinct one once
        m = _USING_RE.match(note)
        if m is not None:
            table = m.group(1)
            if m.group(2):
                shape = (int(m.group(3)), int(m.group(2)), int(m.group(4)))
            continue
        for pattern, code in _NOTE_CODES:
            if pattern.match(note):
                findings.append(Finding(code, f"the tuner plugin said: {note}"))
                break
    published = env.get(TABLE_VAR)
    if table is not None and published and table != published:
        findings.append(Finding("table_other", f"the plugin applied {table}, the published table is {published}"))
    return table, shape, findings


def _cells(log: NcclLog, table: TunerTable, shape: tuple[int, int, int]) -> tuple[int, list[Finding]]:
    nnodes, nranks, rpn = shape
    # The plugin applied the section of the running version: the one NCCL's log names (its suffix,
    # "2.28.9a", dropped as ncclGetVersion drops it).
    nccl = re.sub(r"^(\d+\.\d+\.\d+).*", r"\1", log.version or "")
    checked: set[tuple[str, int]] = set()
    wrong: dict[tuple[str, int], str] = {}
    for t in log.tuning:
        tuned = next((c for c in TUNED if c.log_func == t.func), None)
        if tuned is None or tuned.tuner_name is None:
            continue  # a collective no tuner steers
        collective = tuned.tuner_name  # the table's spelling: NCCL's AllGather is allgather
        entry = table.choice(collective, t.size_bytes, nnodes, nranks, rpn, nccl)
        if entry is None:
            continue
        checked.add((collective, t.size_bytes))
        if (t.algo.lower(), t.proto.lower()) != (entry.algo, entry.proto):
            wrong[(collective, t.size_bytes)] = (f"{collective} {t.size_bytes} B: NCCL ran {t.algo}/{t.proto}, "
                                                 f"the table says {entry.algo}/{entry.proto}")
    if not wrong:
        return len(checked), []
    shown = [wrong[key] for key in sorted(wrong)][:8]
    more = f" (+{len(wrong) - len(shown)} more)" if len(wrong) > len(shown) else ""
    return len(checked), [Finding("table_not_applied", "table not applied at " + "; ".join(shown) + more)]


def what_ran(log: NcclLog, env: Mapping[str, str], table: TunerTable | None) -> WhatRan:
    """Judge one check's NCCL log (rank 0's) against the published environment `env` and the
    published tuner table (None when none is published or it could not be read)."""
    variables, findings = _variables(log, env)
    used, shape, tuner_findings = _tuner(log, env)
    findings += tuner_findings
    checked = 0
    if table is not None and used is not None and shape is not None:
        checked, cell_findings = _cells(log, table, shape)
        findings += cell_findings
    return WhatRan(variables, log.tuner, used, shape, checked, tuple(findings))


def published_table(env: Mapping[str, str]) -> tuple[TunerTable | None, str | None]:
    """The tuner table `env` names (NCCLTUNE_TUNER_TABLE) and, when it names one that cannot be
    read, why (the plugin's own line in NCCL's log then says what it made of the file)."""
    path = env.get(TABLE_VAR)
    if not path:
        return None, None
    try:
        return read_table(Path(path)), None
    except InputError as exc:
        return None, exc.message


def combined(verdicts: Mapping[str, WhatRan]) -> WhatRan:
    """One verdict over the checks of several communicator shapes (shape label -> verdict): every
    finding, named by its shape when there are several; a variable as the first check that logged
    it read it; the shape only when one was checked; the cells compared, summed."""
    if len(verdicts) == 1:
        return next(iter(verdicts.values()))
    variables: dict[str, str | None] = {}
    findings: list[Finding] = []
    for label, ran in verdicts.items():
        for name, value in ran.variables.items():
            if variables.get(name) is None:
                variables[name] = value
        findings += [Finding(f.code, f"{label}: {f.message}") for f in ran.findings]
    values = list(verdicts.values())
    return WhatRan(variables, next((r.tuner for r in values if r.tuner), None),
                   next((r.table for r in values if r.table), None), None,
                   sum(r.cells_checked for r in values), tuple(findings))
