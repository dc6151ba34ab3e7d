"""The tuner table's types, renderer and parser, and agreement of this parser with the plugin's C parser."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest
from tuner_harness import LIB_ENV, LOG_INFO, LOG_WARN, TunerV5, init, load, table_env

from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.tuner.build import build_plugin
from nccltune.tuner.table import (
    ALGORITHMS,
    MAX_TABLE_BYTES,
    PROTOCOLS,
    TableEntry,
    TunerTable,
    check_table,
    parse_table,
    read_table,
    render_table,
)

FP = "0123456789abcdef"
NO_SECTION = f"nccltune-tuner-table 2\nfingerprint {FP}\n"
HEAD = NO_SECTION + "nccl 2.28.9\n"
ROW = "allreduce 0 1024 1 2 2 ring ll128 16\n"
BASE = HEAD + ROW + "end 1\n"
TOO_BIG = HEAD + "end 0\n" + "# padding to exceed the limit\n" * (MAX_TABLE_BYTES // 30 + 1)

def _entry(*fields: object, nccl: str = "2.28.9") -> TableEntry:
    """A TableEntry of the 2.28.9 section unless told otherwise."""
    return TableEntry(*fields, nccl=nccl)  # type: ignore[arg-type]


# (id, text, line the error is on (None: the whole file), part of the message)
BAD: list[tuple[str, str, int | None, str]] = [
    ("empty", "", 1, "does not end with a newline"),
    ("no-final-newline", BASE[:-1], 5, "does not end with a newline"),
    ("cut-mid-line", BASE[: len(HEAD) + 12], 4, "does not end with a newline"),
    ("no-end", HEAD + ROW, 4, "no 'end' line"),
    ("header-only", "nccltune-tuner-table 2\n", 1, "no 'end' line"),
    ("no-fingerprint-no-end", HEAD, 3, "no 'end' line"),
    ("bad-magic", BASE.replace("nccltune-tuner-table", "nccl-table"), 1, "not a nccltune tuner table"),
    ("comment-before-header", "# x\n" + BASE, 1, "not a nccltune tuner table"),
    ("blank-before-header", "\n" + BASE, 1, "not a nccltune tuner table"),
    ("version-1", BASE.replace("table 2", "table 1"), 1, "format version 1"),
    ("version-word", BASE.replace("table 2", "table one"), 1, "not a nccltune tuner table"),
    ("version-extra", BASE.replace("table 2", "table 2 x"), 1, "not a nccltune tuner table"),
    ("entry-before-fingerprint", "nccltune-tuner-table 2\n" + ROW + "end 1\n", 2, "expected 'fingerprint"),
    ("fingerprint-upper", BASE.replace(FP, FP.upper()), 2, "expected 'fingerprint"),
    ("fingerprint-short", BASE.replace(FP, "abc"), 2, "expected 'fingerprint"),
    ("fingerprint-129", BASE.replace(FP, "a" * 129), 2, "expected 'fingerprint"),
    ("second-fingerprint", HEAD + f"fingerprint {FP}\n" + ROW + "end 1\n", 4, "expected 9 fields"),
    ("eight-fields", BASE.replace(" 16\n", "\n"), 4, "expected 9 fields"),
    ("eleven-fields", BASE.replace(" 16\n", " 16 1 2\n"), 4, "more than 10 fields"),
    ("unknown-collective", BASE.replace("allreduce", "alltoall"), 4, "unknown collective 'alltoall'"),
    ("collective-case", BASE.replace("allreduce", "AllReduce"), 4, "unknown collective"),
    ("min-above-max", BASE.replace(" 0 1024 ", " 2048 1024 "), 4, "min_bytes is larger than max_bytes"),
    ("negative-min", BASE.replace(" 0 1024 ", " -1 1024 "), 4, "min_bytes '-1'"),
    ("plus-sign", BASE.replace(" 0 1024 ", " +0 1024 "), 4, "min_bytes '+0'"),
    ("hex-size", BASE.replace(" 0 1024 ", " 0 0x400 "), 4, "max_bytes '0x400'"),
    ("max-overflows", BASE.replace(" 0 1024 ", " 0 18446744073709551616 "), 4, "max_bytes"),
    ("zero-nodes", BASE.replace(" 1 2 2 ", " 0 2 2 "), 4, "nnodes '0'"),
    ("shape-too-big", BASE.replace(" 1 2 2 ", " 1 2147483648 2147483648 "), 4, "nranks '2147483648'"),
    ("inconsistent-shape", BASE.replace(" 1 2 2 ", " 2 2 2 "), 4, "nnodes x ranks_per_node is not nranks"),
    ("unknown-algo", BASE.replace(" ring ", " Ring "), 4, "unknown algorithm 'Ring'"),
    ("unknown-proto", BASE.replace(" ll128 ", " ll64 "), 4, "unknown protocol 'll64'"),
    ("channels-257", BASE.replace(" 16\n", " 257\n"), 4, "channels '257'"),
    ("channels-negative", BASE.replace(" 16\n", " -1\n"), 4, "channels '-1'"),
    ("end-count", BASE.replace("end 1", "end 2"), 5, "counts 2 entries, the table has 1"),
    ("end-word", BASE.replace("end 1", "end one"), 5, "expected 'end <number of entries>'"),
    ("after-end", BASE + ROW, 6, "content after the 'end' line"),
    ("overlap", HEAD + ROW + "allreduce 1024 4096 1 2 2 tree simple 0\nend 2\n", 5,
     "overlaps the entry on line 4"),
    ("overlap-inside", HEAD + "reduce 0 100 1 2 2 ring ll 0\nreduce 200 300 1 2 2 ring ll 0\n"
     "reduce 50 250 1 2 2 ring ll 0\nend 3\n", 6, "overlaps the entry on line 4"),
    ("crlf", BASE.replace("\n", "\r\n"), 1, "not printable ASCII"),
    ("non-ascii-comment", HEAD + ROW.replace("\n", " # größte\n") + "end 1\n", 4, "not printable ASCII"),
    ("nul-byte", HEAD + ROW.replace(" 16", " 1\x006") + "end 1\n", 4, "not printable ASCII"),
    ("vertical-tab", HEAD + ROW.replace(" 16", "\x0b16") + "end 1\n", 4, "not printable ASCII"),
    ("long-line", HEAD + ROW.replace("\n", " #" + "x" * (512 - len(ROW)) + "\n") + "end 1\n", 4, "longer than 512"),
    ("too-big", TOO_BIG, None, "larger than 1048576 bytes"),
    # NCCL version sections
    ("entry-before-section", NO_SECTION + ROW + "end 1\n", 3, "entry before the first 'nccl <version>'"),
    ("section-two-parts", BASE.replace("nccl 2.28.9", "nccl 2.28"), 3, "expected 'nccl <major.minor.patch>'"),
    ("section-four-parts", BASE.replace("nccl 2.28.9", "nccl 2.28.9.1"), 3, "expected 'nccl <major.minor.patch>'"),
    ("section-three-digits", BASE.replace("nccl 2.28.9", "nccl 2.280.9"), 3, "expected 'nccl <major.minor.patch>'"),
    ("section-major-zero", BASE.replace("nccl 2.28.9", "nccl 0.28.9"), 3, "expected 'nccl <major.minor.patch>'"),
    ("section-suffix", BASE.replace("nccl 2.28.9", "nccl 2.28.9a"), 3, "expected 'nccl <major.minor.patch>'"),
    ("section-extra-field", BASE.replace("nccl 2.28.9", "nccl 2.28.9 x"), 3, "expected 'nccl <major.minor.patch>'"),
    ("section-twice", HEAD + ROW + "nccl 2.27.7\n" + ROW + "nccl 2.28.09\n" + "end 2\n", 7,
     "a second section for NCCL 2.28.09"),
    ("too-many-sections", HEAD + "".join(f"nccl 3.{i}.0\n" for i in range(64)) + "end 0\n", 67,
     "more than 64 sections"),
    ("overlap-in-a-later-section", HEAD + "nccl 2.27.7\n" + ROW + ROW + "end 2\n", 6,
     "overlaps the entry on line 5"),
]

GOOD: list[tuple[str, str, int]] = [
    ("base", BASE, 1),
    ("no-entries", HEAD + "end 0\n", 0),
    ("comments-blank-tabs", "nccltune-tuner-table 2 # version\n\n# fp next\nfingerprint\t" + FP + "  \n\n"
     "\tnccl 2.28.9 # section\n\tallreduce\t0 1024 1 2 2 ring ll128 16   # small\n#\nend 1 # done\n"
     "# after the end\n\n", 1),
    ("adjacent-ranges", HEAD + ROW + "allreduce 1025 4096 1 2 2 ring simple 32\nend 2\n", 2),
    ("same-range-other-shape", HEAD + ROW + "allreduce 0 1024 2 4 2 tree simple 0\n"
     "allreduce 0 1024 2 2 1 tree ll 0\nallgather 0 1024 1 2 2 pat simple 0\nend 4\n", 4),
    ("largest-values", HEAD + "broadcast 0 18446744073709551615 2147483647 2147483647 1 collnet_direct ll 256\n"
     "end 1\n", 1),
    ("every-name", HEAD + "".join(f"{c} {i} {i} 1 2 2 {a} {p} 0\n" for i, (c, a, p) in enumerate(
        [("broadcast", "tree", "ll"), ("reduce", "ring", "ll128"), ("allgather", "collnet_direct", "simple"),
         ("reducescatter", "collnet_chain", "ll"), ("allreduce", "nvls", "ll128"),
         ("allreduce", "nvls_tree", "simple"), ("allreduce", "pat", "ll")])) + "end 7\n", 7),
    ("line-of-512", HEAD + ROW.replace("\n", " #" + "x" * (511 - len(ROW)) + "\n") + "end 1\n", 1),
    ("leading-zeros", BASE.replace(" 0 1024 ", " 000 01024 "), 1),
    ("two-sections-same-range", HEAD + ROW + "nccl 2.27.7\n" + ROW + "end 2\n", 2),
    ("other-version-only", BASE.replace("nccl 2.28.9", "nccl 2.27.7"), 1),
    ("empty-section", HEAD + "nccl 2.27.7\n" + ROW + "end 1\n", 1),
    ("version-leading-zero", BASE.replace("nccl 2.28.9", "nccl 02.28.09"), 1),
    ("largest-version", BASE.replace("nccl 2.28.9", "nccl 99.99.99"), 1),
]


@pytest.mark.parametrize(("text", "line", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_table_names_file_and_line(text: str, line: int | None, fragment: str) -> None:
    with pytest.raises(InputError) as err:
        parse_table(text, "/srv/nccltune/tuner-table.txt")
    assert err.value.line == line
    assert err.value.exit_code == EXIT_CONFIG
    where = "/srv/nccltune/tuner-table.txt" + (f":{line}" if line is not None else "")
    assert str(err.value).startswith(where + ": ")
    assert fragment in str(err.value)


@pytest.mark.parametrize(("text", "n_entries"), [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_good_tables_parse(text: str, n_entries: int) -> None:
    table = parse_table(text, "t")
    assert table.fingerprint == FP and len(table.entries) == n_entries


def test_round_trip() -> None:
    table = TunerTable(FP, (
        _entry("allreduce", 0, 1024 * 1024 - 1, 1, 2, 2, "ring", "ll128", 16),
        _entry("allreduce", 1024 * 1024, 2**30, 1, 2, 2, "ring", "simple", 32),
        _entry("allgather", 0, 2**64 - 1, 2, 16, 8, "pat", "simple", 0),
        _entry("reducescatter", 5, 5, 4, 4, 1, "collnet_chain", "ll", 1),
    ))
    text = render_table(table)
    assert text.startswith("nccltune-tuner-table 2\nfingerprint 0123456789abcdef\nnccl 2.28.9\n")
    assert text.endswith("end 4\n")
    parsed = parse_table(text, "t")
    assert parsed == table
    # the header, fingerprint, section line and a comment come first
    assert [e.line for e in parsed.entries] == [5, 6, 7, 8]
    assert render_table(parsed) == text


def test_sections_render_in_first_seen_order_and_round_trip() -> None:
    table = TunerTable(FP, (
        _entry("allreduce", 0, 1024, 1, 2, 2, "ring", "ll128", 16, nccl="2.28.9"),
        _entry("allreduce", 0, 1024, 1, 2, 2, "tree", "ll", 0, nccl="2.27.7"),  # same range, other section
        _entry("allgather", 0, 1024, 1, 2, 2, "ring", "simple", 0, nccl="2.28.9"),
    ))
    text = render_table(table)
    assert [ln for ln in text.splitlines() if ln.startswith("nccl ")] == ["nccl 2.28.9", "nccl 2.27.7"]
    parsed = parse_table(text, "t")
    assert parsed.versions() == ("2.28.9", "2.27.7")
    assert {(e.nccl, e.collective, e.algo) for e in parsed.entries} == {(e.nccl, e.collective, e.algo)
                                                                        for e in table.entries}
    assert render_table(parsed) == text


def test_render_refuses_an_entry_without_a_version_and_one_version_spelt_twice() -> None:
    with pytest.raises(ValueError, match=r"entry 0: NCCL version '' is not major\.minor\.patch"):
        render_table(TunerTable(FP, (_entry("allreduce", 0, 1, 1, 2, 2, "ring", "ll", 0, nccl=""),)))
    with pytest.raises(ValueError, match="name one version twice"):
        render_table(TunerTable(FP, (_entry("allreduce", 0, 1, 1, 2, 2, "ring", "ll", 0, nccl="2.28.9"),
                                     _entry("allreduce", 0, 1, 1, 2, 2, "ring", "ll", 0, nccl="2.28.09"))))


def test_choice_is_the_running_versions_section_only() -> None:
    # Two sections, three versions: 2.28.9 and 2.27.7 each get their own entry, 2.31.0 none.
    table = parse_table(HEAD + ROW + "nccl 2.27.7\nallreduce 0 1024 1 2 2 tree ll 0\nend 2\n", "t")
    assert table.choice("allreduce", 10, 1, 2, 2, "2.28.9") == table.entries[0]
    assert table.choice("allreduce", 10, 1, 2, 2, "2.27.7") == table.entries[1]
    assert table.choice("allreduce", 10, 1, 2, 2, "2.31.0") is None
    assert table.choice("allreduce", 10, 1, 2, 2, "2.28") is None


def test_read_table_keeps_bytes_and_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_bytes(BASE.encode())
    assert read_table(path).entries[0].channels == 16
    path.write_bytes(BASE.replace("\n", "\r\n").encode())  # a text-mode read would hide the CRs
    with pytest.raises(InputError, match=r":1: character '\\r' is not printable"):
        read_table(path)
    with pytest.raises(InputError, match="cannot read the tuner table"):
        read_table(tmp_path / "absent")


def test_render_refuses_overlap_and_bad_values() -> None:
    a = _entry("allreduce", 0, 1024, 1, 2, 2, "ring", "ll128", 16)
    with pytest.raises(ValueError, match="entry 1: size range overlaps entry 0"):
        render_table(TunerTable(FP, (a, _entry("allreduce", 1024, 2048, 1, 2, 2, "tree", "ll", 0))))
    # The same range for another shape or collective is no overlap.
    check_table(TunerTable(FP, (a, _entry("allreduce", 0, 1024, 2, 4, 2, "tree", "ll", 0),
                                _entry("allgather", 0, 1024, 1, 2, 2, "ring", "ll", 0))))
    for bad, message in ((_entry("allreduce", 0, 1, 1, 2, 2, "ring", "ll", 300), "channels 300"),
                         (_entry("allreduce", 2, 1, 1, 2, 2, "ring", "ll", 0), "min_bytes is larger"),
                         (_entry("allreduce", 0, 1, 1, 3, 2, "ring", "ll", 0), "is not nranks"),
                         (_entry("alltoall", 0, 1, 1, 2, 2, "ring", "ll", 0), "unknown collective"),
                         (_entry("allreduce", 0, 1, 1, 2, 2, "ring", "ll", True), "channels True")):
        with pytest.raises(ValueError, match=message):
            render_table(TunerTable(FP, (bad,)))
    with pytest.raises(ValueError, match="fingerprint"):
        render_table(TunerTable("XYZ", ()))


def test_choice_is_first_match_with_inclusive_edges() -> None:
    table = parse_table(HEAD + ROW + "allreduce 1025 4096 1 2 2 ring simple 32\nallreduce 0 1024 2 4 2 tree ll 0\n"
                        "end 3\n", "t")
    assert table.choice("allreduce", 1024, 1, 2, 2, "2.28.9") == table.entries[0]
    assert table.choice("allreduce", 1025, 1, 2, 2, "2.28.9") == table.entries[1]
    assert table.choice("allreduce", 4097, 1, 2, 2, "2.28.9") is None
    assert table.choice("allreduce", 0, 2, 4, 2, "2.28.9") == table.entries[2]
    assert table.choice("allreduce", 0, 2, 4, 4, "2.28.9") is None
    assert table.choice("allgather", 0, 1, 2, 2, "2.28.9") is None


# ---- the C parser agrees ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v5(tmp_path_factory: pytest.TempPathFactory) -> TunerV5:
    given = os.environ.get(LIB_ENV)
    if given:
        return load(Path(given))[1]
    result = build_plugin(tmp_path_factory.mktemp("tuner"))
    assert result.ok and result.path is not None, result.message
    return load(result.path)[1]


def test_line_length_edges() -> None:
    good = dict((g[0], g[1]) for g in GOOD)["line-of-512"]
    assert max(len(line) for line in good.split("\n")) == 512
    bad = dict((c[0], c[1]) for c in BAD)["long-line"]
    assert max(len(line) for line in bad.split("\n")) == 513


def _mutations(count: int) -> list[str]:
    """Seeded small edits of a good table: most break it somewhere, some keep it valid."""
    rng = random.Random(20260101)
    alphabet = "0123456789abcdefx #\t\n-+ \x00\xe9lrt"
    base = dict((g[0], g[1]) for g in GOOD)["same-range-other-shape"]
    out = []
    for _ in range(count):
        text = base
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            kind = rng.randrange(4)
            if kind == 0:
                text = text[:i] + text[i + 1:]
            elif kind == 1:
                text = text[:i] + rng.choice(alphabet) + text[i:]
            elif kind == 2:
                text = text[:i]
            else:
                lines = text.split("\n")
                j = rng.randrange(len(lines))
                lines.insert(j, lines[rng.randrange(len(lines))])
                text = "\n".join(lines)
        out.append(text)
    return out


CASES = {c[0]: c[1] for c in BAD} | {g[0]: g[1] for g in GOOD} | {f"mutation-{i}": t for i, t in
                                                                  enumerate(_mutations(150))}


@pytest.mark.parametrize("case", list(CASES))
def test_c_and_python_parsers_agree(v5: TunerV5, tmp_path: Path, case: str) -> None:
    path = tmp_path / "table.txt"
    path.write_bytes(CASES[case].encode("utf-8"))
    try:
        table: TunerTable | None = read_table(path)
        py_line: int | None = None
    except InputError as e:
        table, py_line = None, e.line
    with table_env(path, table.fingerprint if table is not None else FP):  # a mutation may edit the fingerprint
        comm = init(v5, 2, 1, (1, 2, 2))
    assert comm.init_rc == 0 and len(comm.lines) == 1
    message = comm.lines[0].message
    if table is not None:
        # init ran under NCCL 2.28.9 (the harness's host): that section alone applies.
        mine = [e for e in table.entries if e.nccl == "2.28.9"]
        assert comm.lines[0].level == LOG_INFO, message
        if "has no section for NCCL 2.28.9" in message:
            assert not mine, message
        else:
            assert f"using table {path} (NCCL 2.28.9 section, {len(mine)} entries" in message
        # And both pick the same entry for the same calls.
        probes = sorted({0, 1, 1024, 1025, 4096, 2**64 - 1} | {e.min_bytes for e in table.entries}
                        | {e.max_bytes for e in table.entries} | {min(e.max_bytes + 1, 2**64 - 1)
                                                                   for e in table.entries})
        for coll in ("broadcast", "reduce", "allgather", "reducescatter", "allreduce"):
            for n in probes:
                rc, before, after, nch = comm.call(coll, n)
                assert rc == 0
                chosen = table.choice(coll, n, 1, 2, 2, "2.28.9")
                if chosen is None:
                    assert (after, nch) == (before, 0), (coll, n)
                else:
                    assert after[ALGORITHMS.index(chosen.algo)][PROTOCOLS.index(chosen.proto)] == 0.0, (coll, n)
                    assert nch == chosen.channels, (coll, n)
    else:
        assert comm.lines[0].level == LOG_WARN, message
        found = re.search(re.escape(str(path)) + r":(\d+) is ", message)
        assert (int(found.group(1)) if found else None) == py_line, message
    assert comm.finalize() == 0

