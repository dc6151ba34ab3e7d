"""A run's summary as typed records: what a sweep, a verify and an import say about their run
beside its trials (the runs table's summary_json), and verify's rows.

Every writer builds one of these and the store writes its `to_doc()`; every reader gets one from
`RunRecord` (`from_doc` of the stored document). `to_doc` is the document the history has always
kept, key for key, so that files written before these records read as they did: `from_doc`
fills what an older run left out with its default and names the field that is of the wrong type.
Keys a reader does not know (a newer nccltune's) are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..records import ALL_REDUCE


class SummaryError(ValueError):
    """A stored summary whose field `name` is not of its type."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def _typed(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """doc[key], None when missing or null; a bool is no number."""
    value = doc.get(key)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))) \
            or not isinstance(value, kind):
        raise SummaryError(key, f"must be {what} or null; got {value!r}")
    return value


def _text(doc: Mapping[str, Any], key: str) -> str | None:
    got: str | None = _typed(doc, key, str, "text")
    return got


def _int(doc: Mapping[str, Any], key: str) -> int | None:
    got: int | None = _typed(doc, key, int, "an integer")
    return got


def _number(doc: Mapping[str, Any], key: str) -> float | None:
    got = _typed(doc, key, (int, float), "a number")
    return None if got is None else float(got)


def _flag(doc: Mapping[str, Any], key: str) -> bool | None:
    got: bool | None = _typed(doc, key, bool, "true or false")
    return got


def _object(doc: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    got = _typed(doc, key, dict, "an object")
    return None if got is None else dict(got)


def _texts(doc: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    got = _typed(doc, key, list, "a list of text")
    if got is not None and not all(isinstance(v, str) for v in got):
        raise SummaryError(key, f"must be a list of text; got {got!r}")
    return None if got is None else tuple(got)


def _text_map(doc: Mapping[str, Any], key: str) -> dict[str, str] | None:
    got = _object(doc, key)
    if got is not None and not all(isinstance(v, str) for v in got.values()):
        raise SummaryError(key, f"must map names to text; got {got!r}")
    return got


def _pairs(doc: Mapping[str, Any], key: str) -> tuple[tuple[str, str], ...] | None:
    got = _typed(doc, key, list, "a list of [label, reason]")
    if got is None:
        return None
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p) for p in got):
        raise SummaryError(key, f"must be a list of [label, reason]; got {got!r}")
    return tuple((p[0], p[1]) for p in got)


def _present(pairs: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in pairs.items() if value is not None}


@dataclass(frozen=True, slots=True)
class SweepSummary:
    """What a sweep recorded: its choice and summary line, what it measured with, which trials
    failed; or, for a sweep that ended early, the error and how many trials it had run.

    A measured sweep (`collectives` set) names its versions and method, null where unknown; the
    other fields are written only where set, as each kind of sweep always wrote them."""

    chosen: str | None = None
    line: str | None = None  # the summary line ("summary" in the document)
    trials: int | None = None
    failed: tuple[tuple[str, str], ...] | None = None  # (label, reason) of each failed trial
    plan_pruned: int | None = None
    nccl_version: str | None = None
    torch_version: str | None = None
    method: str | None = None
    collectives: tuple[str, ...] | None = None
    not_measured: dict[str, str] | None = None  # collective -> why it has no numbers
    tuner_table: dict[str, Any] | None = None  # the table stage's own record (TableOutcome.as_dict)
    not_published: str | None = None
    job: dict[str, Any] | None = None  # the job shape of a sweep over several nodes (Launch.record)
    image: dict[str, str] | None = None  # the job's image the ranks ran in (bench.image: trials.container.provenance)
    error: str | None = None
    ended_after_publish: int | None = None  # the generation it published before it ended

    @classmethod
    def ended(cls, error: str, trials: int, ended_after_publish: int | None = None) -> SweepSummary:
        """A sweep that stopped on `error` after `trials` trials."""
        return cls(error=error, trials=trials, ended_after_publish=ended_after_publish)

    def to_doc(self) -> dict[str, Any]:
        doc = _present({
            "chosen": self.chosen, "summary": self.line, "trials": self.trials,
            "failed": None if self.failed is None else [list(p) for p in self.failed],
            "plan_pruned": self.plan_pruned, "nccl_version": self.nccl_version,
            "torch_version": self.torch_version, "method": self.method,
            "collectives": None if self.collectives is None else list(self.collectives),
            "not_measured": self.not_measured, "tuner_table": self.tuner_table,
            "not_published": self.not_published, "job": self.job, "image": self.image, "error": self.error,
            "ended_after_publish": self.ended_after_publish})
        if self.collectives is not None:
            for key in ("nccl_version", "torch_version", "method"):
                doc.setdefault(key, None)
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> SweepSummary:
        """Raises: SummaryError: a field of the wrong type."""
        return cls(
            chosen=_text(doc, "chosen"), line=_text(doc, "summary"), trials=_int(doc, "trials"),
            failed=_pairs(doc, "failed"), plan_pruned=_int(doc, "plan_pruned"),
            nccl_version=_text(doc, "nccl_version"), torch_version=_text(doc, "torch_version"),
            method=_text(doc, "method"), collectives=_texts(doc, "collectives"),
            not_measured=_text_map(doc, "not_measured"), tuner_table=_object(doc, "tuner_table"),
            not_published=_text(doc, "not_published"), job=_object(doc, "job"), image=_text_map(doc, "image"),
            error=_text(doc, "error"), ended_after_publish=_int(doc, "ended_after_publish"))

    @property
    def job_nnodes(self) -> int:
        """The nodes of its job: the job shape's, else one."""
        got = (self.job or {}).get("nnodes")
        return got if isinstance(got, int) and not isinstance(got, bool) else 1


@dataclass(frozen=True, slots=True)
class VerifyRow:
    """One collective and size of a verify: measured against expected bus bandwidth, the drop
    allowed there and the drift; `verifiable` False where the noise allows a drop no measurement
    can show (not judged)."""

    size_bytes: int
    measured_gbps: float | None
    expected_gbps: float | None
    allowed_pct: float | None  # None only in a document that left it out
    drift_pct: float | None
    ok: bool
    collective: str = ALL_REDUCE
    verifiable: bool = True

    def to_doc(self) -> dict[str, Any]:
        return {"size_bytes": self.size_bytes, "measured_gbps": self.measured_gbps,
                "expected_gbps": self.expected_gbps, "allowed_pct": self.allowed_pct, "drift_pct": self.drift_pct,
                "ok": self.ok, "collective": self.collective, "verifiable": self.verifiable}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> VerifyRow:
        """A row as verify stored it; older rows name no collective (all-reduce) and no
        verifiability (judged). Raises: SummaryError: no size, or a field of the wrong type."""
        size = _int(doc, "size_bytes")
        if size is None:
            raise SummaryError("size_bytes", "missing from a verify row")
        ok, verifiable = _flag(doc, "ok"), _flag(doc, "verifiable")
        return cls(size_bytes=size, measured_gbps=_number(doc, "measured_gbps"),
                   expected_gbps=_number(doc, "expected_gbps"), allowed_pct=_number(doc, "allowed_pct"),
                   drift_pct=_number(doc, "drift_pct"), ok=True if ok is None else ok,
                   collective=_text(doc, "collective") or ALL_REDUCE,
                   verifiable=True if verifiable is None else verifiable)


@dataclass(frozen=True, slots=True)
class VerifySummary:
    """What a verify recorded: its verdict (passed, code, reason), what it was judged against and
    how, its rows (none on a node with one GPU, which keeps `one_gpu` instead); or the error of a
    verify that ended early.

    A verdict names what NCCL ran, null where unknown; a verdict with rows names its method and
    class profile the same way."""

    passed: bool | None = None
    code: str | None = None
    reason: str | None = None
    expectation: str | None = None
    env_source: str | None = None
    reference: str | None = None  # checks.verify.Reference
    checked: str | None = None
    nccl_ran: dict[str, Any] | None = None  # nccl.ran.WhatRan.doc()
    rows: tuple[VerifyRow, ...] | None = None
    method: str | None = None
    class_profile: dict[str, Any] | None = None
    one_gpu: dict[str, Any] | None = None  # checks.onegpu.OneGpuReport.doc()
    error: str | None = None

    def to_doc(self) -> dict[str, Any]:
        doc = _present({
            "passed": self.passed, "code": self.code, "reason": self.reason, "expectation": self.expectation,
            "env_source": self.env_source, "reference": self.reference, "checked": self.checked,
            "nccl_ran": self.nccl_ran, "rows": None if self.rows is None else [r.to_doc() for r in self.rows],
            "method": self.method, "class_profile": self.class_profile, "one_gpu": self.one_gpu,
            "error": self.error})
        if self.passed is not None:
            doc.setdefault("nccl_ran", None)
        if self.rows is not None:
            doc.setdefault("method", None)
            doc.setdefault("class_profile", None)
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> VerifySummary:
        """Raises: SummaryError: a field (or a row's) of the wrong type."""
        raw_rows = _typed(doc, "rows", list, "a list of rows")
        rows = None
        if raw_rows is not None:
            if not all(isinstance(r, dict) for r in raw_rows):
                raise SummaryError("rows", f"must be a list of objects; got {raw_rows!r}")
            try:
                rows = tuple(VerifyRow.from_doc(r) for r in raw_rows)
            except SummaryError as exc:
                raise SummaryError(f"rows.{exc.name}", str(exc).split(": ", 1)[1]) from None
        return cls(
            passed=_flag(doc, "passed"), code=_text(doc, "code"), reason=_text(doc, "reason"),
            expectation=_text(doc, "expectation"), env_source=_text(doc, "env_source"),
            reference=_text(doc, "reference"), checked=_text(doc, "checked"), nccl_ran=_object(doc, "nccl_ran"),
            rows=rows, method=_text(doc, "method"), class_profile=_object(doc, "class_profile"),
            one_gpu=_object(doc, "one_gpu"), error=_text(doc, "error"))


@dataclass(frozen=True, slots=True)
class ImportSummary:
    """What an import of an nccl-tests document recorded: where it came from and what it held
    (binary, ranks, placements, datatype, counts, the document's own fields); or the error of an
    import that stopped before its last trial. A finished import names every field."""

    chosen: str | None = None
    line: str | None = None  # the summary line ("summary" in the document)
    source_file: str | None = None
    collective: str | None = None
    binary: str | None = None
    nranks: int | None = None
    placement: str | None = None  # the placement the import compares with
    method: str | None = None
    datatype: str | None = None
    redop: str | None = None
    root: int | None = None
    counts: dict[str, int] | None = None  # size (text) -> element count
    cycles: int | None = None
    nccl_version: str | None = None
    trials: int | None = None
    notes: tuple[str, ...] | None = None
    not_measured: dict[str, str] | None = None
    document: dict[str, Any] | None = None  # the nccl-tests document's own top-level fields
    error: str | None = None

    def to_doc(self) -> dict[str, Any]:
        if self.error is not None:
            return _present({"error": self.error, "trials": self.trials})
        return {
            "chosen": self.chosen, "summary": self.line, "source_file": self.source_file,
            "collective": self.collective, "binary": self.binary, "nranks": self.nranks,
            "placement": self.placement, "method": self.method, "datatype": self.datatype, "redop": self.redop,
            "root": self.root, "counts": self.counts, "cycles": self.cycles, "nccl_version": self.nccl_version,
            "trials": self.trials, "notes": None if self.notes is None else list(self.notes),
            "not_measured": self.not_measured, "document": self.document}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> ImportSummary:
        """Raises: SummaryError: a field of the wrong type."""
        counts = _object(doc, "counts")
        if counts is not None and not all(isinstance(c, int) and not isinstance(c, bool) for c in counts.values()):
            raise SummaryError("counts", f"must map sizes to element counts; got {counts!r}")
        return cls(
            chosen=_text(doc, "chosen"), line=_text(doc, "summary"), source_file=_text(doc, "source_file"),
            collective=_text(doc, "collective"), binary=_text(doc, "binary"), nranks=_int(doc, "nranks"),
            placement=_text(doc, "placement"), method=_text(doc, "method"), datatype=_text(doc, "datatype"),
            redop=_text(doc, "redop"), root=_int(doc, "root"), counts=counts, cycles=_int(doc, "cycles"),
            nccl_version=_text(doc, "nccl_version"), trials=_int(doc, "trials"), notes=_texts(doc, "notes"),
            not_measured=_text_map(doc, "not_measured"), document=_object(doc, "document"),
            error=_text(doc, "error"))


RunSummary = SweepSummary | VerifySummary | ImportSummary
