"""Results store: every run, trial and measurement, in one SQLite file (`history.db`).

    rows.py      what the store hands back (RunRecord, TrialRecord, PublishedEnv) and how its
                 columns are written and read
    schema.py    the tables, versioned with `PRAGMA user_version` and grown by migrations
    database.py  the file: trust, WAL and busy timeout, a corrupt file moved aside, one write
                 transaction at a time, disk errors as nccltune's errors
    summaries.py a run's summary as typed records (SweepSummary, VerifySummary with its
                 VerifyRow, ImportSummary): what every writer builds and every reader gets
    history.py   Store: runs, trials, measurements and report rows, written and read
"""

from __future__ import annotations

from .history import Store
from .rows import Phase, PublishedEnv, PublishedRun, RunBackend, RunKind, RunRecord, RunStatus, TrialRecord
from .summaries import ImportSummary, RunSummary, SummaryError, SweepSummary, VerifyRow, VerifySummary

__all__ = [
    "ImportSummary",
    "Phase",
    "PublishedEnv",
    "PublishedRun",
    "RunBackend",
    "RunKind",
    "RunRecord",
    "RunStatus",
    "RunSummary",
    "Store",
    "SummaryError",
    "SweepSummary",
    "TrialRecord",
    "VerifyRow",
    "VerifySummary",
]
