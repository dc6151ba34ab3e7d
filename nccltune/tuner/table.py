"""The per-size table that nccltune's NCCL tuner plugin reads: data types, rendering and a strict parser.

The format is defined in nccltune_tuner.c's header comment and README.md next to it; this parser
applies the same rules as the plugin's (the tests feed both the same good and bad tables), so a table
nccltune renders is one the plugin accepts, and a table the plugin would refuse is refused here with
its file and line first.
"""

from __future__ import annotations

import bisect
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..collectives import TUNER_NAMES
from ..errors import InputError

log = logging.getLogger(__name__)

MAGIC = "nccltune-tuner-table"
FORMAT_VERSION = 2
MAX_SECTIONS = 64
MAX_TABLE_BYTES = 1024 * 1024
MAX_ENTRIES = 4096
MAX_LINE_BYTES = 512
MAX_FIELDS = 10
MAX_CHANNELS = 256
MAX_SHAPE = 2**31 - 1
MAX_BYTES_VALUE = 2**64 - 1

# Index order is NCCL's (ncclFunc_t, NCCL_ALGO_*, NCCL_PROTO_*): the tests use it to address cost-table cells.
# A table names a collective as NCCL does (Collective.tuner_name: allreduce), and so does TableEntry,
# one line of the file; sweep.pertable and fleet convert from and to nccltune's names.
COLLECTIVES = TUNER_NAMES
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("ll", "ll128", "simple")

_FINGERPRINT = re.compile(r"[0-9a-f]{8,128}")
_DIGITS = re.compile(r"[0-9]+")
_BAD_CHAR = re.compile(r"[^\t\x20-\x7e]")
_NCCL_VERSION = re.compile(r"([0-9]{1,2})\.([0-9]{1,2})\.([0-9]{1,2})")


def nccl_version_code(text: str) -> int | None:
    """"2.28.9" -> 22809, NCCL's own code (ncclGetVersion); None for anything else. The plugins'
    rule (nccltune_version.h): major 1..99, minor and patch 0..99, decimal."""
    m = _NCCL_VERSION.fullmatch(text)
    if m is None or int(m[1]) < 1:
        return None
    return int(m[1]) * 10000 + int(m[2]) * 100 + int(m[3])


def nccl_version_text(code: int) -> str:
    """22809 -> "2.28.9": the spelling a section line carries (leading zeros dropped)."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


@dataclass(frozen=True)
class TableEntry:
    """One choice: for this collective, sizes min_bytes..max_bytes (both inclusive), and a communicator
    of exactly this shape, use algo/proto and, when channels > 0, that many channels; measured with
    NCCL `nccl` ("2.28.9"), the only version it applies to (its section of the table)."""

    collective: str
    min_bytes: int
    max_bytes: int
    nnodes: int
    nranks: int
    ranks_per_node: int
    algo: str
    proto: str
    channels: int = 0
    nccl: str = ""
    line: int | None = field(default=None, compare=False)  # where a parsed entry came from; not rendered

    def shape(self) -> tuple[str, int, int, int]:
        return (self.collective, self.nnodes, self.nranks, self.ranks_per_node)

    def key(self) -> tuple[str, str, int, int, int]:
        """Entries of one key may not overlap in size: the section, the collective and the shape."""
        return (self.nccl, *self.shape())


@dataclass(frozen=True)
class TunerTable:
    """A whole table: the tuning fingerprint it was measured under, and its entries in file order."""

    fingerprint: str
    entries: tuple[TableEntry, ...] = ()

    def versions(self) -> tuple[str, ...]:
        """The sections' NCCL versions, in the order the table renders them."""
        return tuple(dict.fromkeys(e.nccl for e in self.entries))

    def choice(self, collective: str, n_bytes: int, nnodes: int, nranks: int,
               ranks_per_node: int, nccl: str) -> TableEntry | None:
        """The entry the plugin applies to this call under NCCL `nccl` (the section of exactly that
        version; first in file order, sizes inclusive), or None.

        Whether NCCL then takes it depends on the cost-table cell being available, which only NCCL knows."""
        code = nccl_version_code(nccl)
        for e in self.entries:
            if (nccl_version_code(e.nccl) == code and e.collective == collective
                    and e.min_bytes <= n_bytes <= e.max_bytes
                    and (e.nnodes, e.nranks, e.ranks_per_node) == (nnodes, nranks, ranks_per_node)):
                return e
        return None


def entry_problem(e: TableEntry) -> str | None:
    """What is wrong with one entry's values, or None. The same checks as the plugin's."""
    if nccl_version_code(e.nccl) is None:
        return f"NCCL version {e.nccl!r} is not major.minor.patch (the section it belongs to)"
    if e.collective not in COLLECTIVES:
        return f"unknown collective {e.collective!r}"
    for name, value, lo, hi in (("min_bytes", e.min_bytes, 0, MAX_BYTES_VALUE),
                                ("max_bytes", e.max_bytes, 0, MAX_BYTES_VALUE),
                                ("nnodes", e.nnodes, 1, MAX_SHAPE), ("nranks", e.nranks, 1, MAX_SHAPE),
                                ("ranks_per_node", e.ranks_per_node, 1, MAX_SHAPE),
                                ("channels", e.channels, 0, MAX_CHANNELS)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            return f"{name} {value!r} is not a count from {lo} to {hi}"
    if e.min_bytes > e.max_bytes:
        return "min_bytes is larger than max_bytes"
    if e.nnodes * e.ranks_per_node != e.nranks:
        return "nnodes x ranks_per_node is not nranks"
    if e.algo not in ALGORITHMS:
        return f"unknown algorithm {e.algo!r}"
    if e.proto not in PROTOCOLS:
        return f"unknown protocol {e.proto!r}"
    return None


class OverlapIndex:
    """Entries added so far, per collective and shape, sorted by size, to find an overlapping size range.

    The plugin takes the first match in file order, but an overlap means the producer made two choices
    for one size; both the plugin and this parser refuse such a table, naming the earliest entry (in
    file order) that the new one overlaps, as the plugin does."""

    def __init__(self) -> None:
        self._by_shape: dict[tuple[str, str, int, int, int], list[tuple[int, int, int]]] = {}

    def add(self, e: TableEntry, order: int) -> int | None:
        """Add e (order: its position in the file); return the order of the earliest entry it overlaps, if any."""
        ranges = self._by_shape.setdefault(e.key(), [])
        # Ranges held are disjoint, so sorted by min they are sorted by max too: the ones that overlap
        # e are the run just left of the first range starting above e.max_bytes.
        i = bisect.bisect_right(ranges, (e.max_bytes, MAX_BYTES_VALUE + 1, 0))
        hits = []
        j = i - 1
        while j >= 0 and ranges[j][1] >= e.min_bytes:
            hits.append(ranges[j][2])
            j -= 1
        if hits:
            return min(hits)
        ranges.insert(i, (e.min_bytes, e.max_bytes, order))
        return None


def check_table(table: TunerTable) -> None:
    """Raise ValueError naming the entry when the table could not be rendered into one the plugin accepts."""
    if not _FINGERPRINT.fullmatch(table.fingerprint):
        raise ValueError(f"fingerprint {table.fingerprint!r} is not 8 to 128 lowercase hex digits")
    if len(table.entries) > MAX_ENTRIES:
        raise ValueError(f"{len(table.entries)} entries, the plugin reads at most {MAX_ENTRIES}")
    index = OverlapIndex()
    for i, e in enumerate(table.entries):
        problem = entry_problem(e)
        if problem is not None:
            raise ValueError(f"entry {i}: {problem}")
        old = index.add(e, i)
        if old is not None:
            raise ValueError(f"entry {i}: size range overlaps entry {old} "
                             f"(NCCL {e.nccl}, {e.collective}, {e.nnodes} nodes, {e.nranks} ranks)")
    codes = [nccl_version_code(v) for v in table.versions()]
    if len(set(codes)) != len(codes):
        raise ValueError(f"NCCL versions {', '.join(table.versions())} name one version twice")
    if len(codes) > MAX_SECTIONS:
        raise ValueError(f"{len(codes)} NCCL versions, the plugin reads at most {MAX_SECTIONS} sections")


def render_table(table: TunerTable) -> str:
    """The table as the plugin reads it: one section per NCCL version, in first-seen order, each
    with its entries in table order. Raises ValueError for a table the plugin would refuse."""
    check_table(table)
    lines = [f"{MAGIC} {FORMAT_VERSION}", f"fingerprint {table.fingerprint}"]
    for version in table.versions():
        lines += [f"nccl {nccl_version_text(nccl_version_code(version) or 0)}",
                  "# collective min_bytes max_bytes nnodes nranks ranks_per_node algo proto channels (0: NCCL decides)"]
        for e in table.entries:
            if e.nccl == version:
                lines.append(f"{e.collective} {e.min_bytes} {e.max_bytes} {e.nnodes} {e.nranks} {e.ranks_per_node} "
                             f"{e.algo} {e.proto} {e.channels}")
    lines.append(f"end {len(table.entries)}")
    text = "\n".join(lines) + "\n"
    if len(text.encode("ascii")) > MAX_TABLE_BYTES:
        raise ValueError(f"rendered table is larger than {MAX_TABLE_BYTES} bytes")
    return text


def _count(token: str, lo: int, hi: int) -> int | None:
    if not _DIGITS.fullmatch(token):
        return None
    value = int(token)
    return value if lo <= value <= hi else None


def _parse_entry(fields: list[str], where: str, lineno: int, nccl: str) -> TableEntry:
    def bad(message: str) -> InputError:
        return InputError(where, message, line=lineno)

    if len(fields) != 9:
        raise bad("expected 9 fields (collective min_bytes max_bytes nnodes nranks ranks_per_node algo proto "
                  f"channels), got {len(fields)}")
    coll, smin, smax, snodes, sranks, srpn, algo, proto, schannels = fields
    if coll not in COLLECTIVES:
        raise bad(f"unknown collective {coll!r}")
    min_bytes = _count(smin, 0, MAX_BYTES_VALUE)
    if min_bytes is None:
        raise bad(f"min_bytes {smin!r} is not a byte count")
    max_bytes = _count(smax, 0, MAX_BYTES_VALUE)
    if max_bytes is None:
        raise bad(f"max_bytes {smax!r} is not a byte count")
    if min_bytes > max_bytes:
        raise bad("min_bytes is larger than max_bytes")
    shape: list[int] = []
    for name, token in (("nnodes", snodes), ("nranks", sranks), ("ranks_per_node", srpn)):
        value = _count(token, 1, MAX_SHAPE)
        if value is None:
            raise bad(f"{name} {token!r} is not a count from 1 to {MAX_SHAPE}")
        shape.append(value)
    nnodes, nranks, rpn = shape
    if nnodes * rpn != nranks:
        raise bad("nnodes x ranks_per_node is not nranks")
    if algo not in ALGORITHMS:
        raise bad(f"unknown algorithm {algo!r}")
    if proto not in PROTOCOLS:
        raise bad(f"unknown protocol {proto!r}")
    channels = _count(schannels, 0, MAX_CHANNELS)
    if channels is None:
        raise bad(f"channels {schannels!r} is not a count from 0 to {MAX_CHANNELS}")
    return TableEntry(coll, min_bytes, max_bytes, nnodes, nranks, rpn, algo, proto, channels, nccl, line=lineno)


def parse_table(text: str, where: str) -> TunerTable:
    """Parse a whole table; any problem raises InputError with where:line (or where alone for the file size).

    text must hold the file's characters unchanged (no newline translation); read_table does that."""
    # Lengths count characters: read_table decodes one character per byte, as the plugin counts bytes.
    if len(text) > MAX_TABLE_BYTES:
        raise InputError(where, f"malformed (larger than {MAX_TABLE_BYTES} bytes)")
    if not text.endswith("\n"):
        raise InputError(where, "truncated: the file does not end with a newline", line=text.count("\n") + 1)
    fingerprint: str | None = None
    entries: list[TableEntry] = []
    sections: list[int] = []  # the NCCL version codes, in file order
    index = OverlapIndex()
    state = "header"
    lineno = 0
    for lineno, raw in enumerate(text[:-1].split("\n"), start=1):
        if len(raw) > MAX_LINE_BYTES:
            raise InputError(where, f"line longer than {MAX_LINE_BYTES} bytes", line=lineno)
        bad_char = _BAD_CHAR.search(raw)
        if bad_char:
            raise InputError(where, f"character {bad_char.group()!r} is not printable ASCII", line=lineno)
        fields = raw.split("#", 1)[0].split()
        if len(fields) > MAX_FIELDS:
            raise InputError(where, f"more than {MAX_FIELDS} fields", line=lineno)
        if state == "header":
            if len(fields) != 2 or fields[0] != MAGIC or not _DIGITS.fullmatch(fields[1]):
                raise InputError(where, f"not a nccltune tuner table (the first line must be "
                                 f"'{MAGIC} {FORMAT_VERSION}')", line=lineno)
            if fields[1] != str(FORMAT_VERSION):
                raise InputError(where, f"format version {fields[1]}, this nccltune reads version "
                                 f"{FORMAT_VERSION}", line=lineno)
            state = "fingerprint"
            continue
        if not fields:
            continue
        if state == "end":
            raise InputError(where, "content after the 'end' line", line=lineno)
        if state == "fingerprint":
            if len(fields) != 2 or fields[0] != "fingerprint" or not _FINGERPRINT.fullmatch(fields[1]):
                raise InputError(where, "expected 'fingerprint <8 to 128 lowercase hex digits>'", line=lineno)
            fingerprint = fields[1]
            state = "entries"
            continue
        if fields[0] == "nccl":
            code = nccl_version_code(fields[1]) if len(fields) == 2 else None
            if code is None:
                raise InputError(where, "expected 'nccl <major.minor.patch>' (a section's NCCL version)", line=lineno)
            if code in sections:
                raise InputError(where, f"a second section for NCCL {fields[1]}", line=lineno)
            if len(sections) == MAX_SECTIONS:
                raise InputError(where, f"more than {MAX_SECTIONS} sections", line=lineno)
            sections.append(code)
            continue
        if fields[0] == "end":
            if len(fields) != 2 or _count(fields[1], 0, MAX_BYTES_VALUE) is None:
                raise InputError(where, "expected 'end <number of entries>'", line=lineno)
            if int(fields[1]) != len(entries):
                raise InputError(where, f"the 'end' line counts {int(fields[1])} entries, the table has "
                                 f"{len(entries)}", line=lineno)
            state = "end"
            continue
        if not sections:
            raise InputError(where, "entry before the first 'nccl <version>' section line", line=lineno)
        if len(entries) == MAX_ENTRIES:
            raise InputError(where, f"more than {MAX_ENTRIES} entries", line=lineno)
        entry = _parse_entry(fields, where, lineno, nccl_version_text(sections[-1]))
        old = index.add(entry, lineno)
        if old is not None:
            raise InputError(where, f"size range overlaps the entry on line {old} (same section, collective and "
                             "shape)", line=lineno)
        entries.append(entry)
    if state != "end" or fingerprint is None:
        raise InputError(where, "truncated: no 'end' line", line=lineno)
    return TunerTable(fingerprint, tuple(entries))


def read_table(path: Path) -> TunerTable:
    """Read and parse a table file byte for byte (each byte one character, so line numbers match the plugin's)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_TABLE_BYTES + 1)
    except OSError as e:
        raise InputError(str(path), f"cannot read the tuner table: {e.strerror or e}") from e
    return parse_table(data.decode("latin-1"), str(path))
