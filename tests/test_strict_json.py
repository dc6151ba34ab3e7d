"""Every JSON nccltune reads goes through one strict reader (files/inputfile.py): each reader of a
file refuses NaN, a key twice, nesting past MAX_JSON_DEPTH and a file past its size bound, with a
message naming the file; the readers of text in memory (the control channel, the probe, the
store's columns, a rank's lines) refuse the same. And no module parses JSON any other way."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

from nccltune import install
from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.files.inputfile import MAX_JSON_DEPTH, loads_strict, parse_json, read_json
from nccltune.fleet import document
from nccltune.fleet.export import EXPORT_KIND
from nccltune.publish import generations, readback
from nccltune.report import nccltests_json
from nccltune.store.rows import load_json
from nccltune.topology import snapshot
from nccltune.trials.launch.sealing import strict_json
from nccltune.trials.probe import parse_probe

LIMIT = 4096

NAN = '{"kind": "x", "gain": NaN}'
INFINITY = '{"kind": "x", "gain": -Infinity}'
TWICE = '{"kind": "x", "env": {"NCCL_ALGO": "Ring", "NCCL_ALGO": "Tree"}}'
DEEP = '{"kind": "x", "a": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}"
HUGE = '{"kind": "x", "pad": "' + "x" * LIMIT + '"}'

REFUSALS = {
    "nan": (NAN, "NaN is not JSON"),
    "infinity": (INFINITY, "-Infinity is not JSON"),
    "duplicate-key": (TWICE, "duplicate key 'NCCL_ALGO'"),
    "too-deep": (DEEP, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    "too-large": (HUGE, f"larger than {LIMIT} bytes"),
}


@dataclass(frozen=True)
class FileReader:
    """One of nccltune's readers of a JSON file: where it looks for the file (below a directory of
    its own), how it is called, and which bound of its module caps the file's size."""

    name: str
    read: Callable[[Path], object]
    file: str = "doc.json"
    bound: tuple[object, str] | None = None


FILE_READERS = [
    FileReader("read_json", lambda p: read_json(p, LIMIT, "test document")),
    FileReader("parse_json", lambda p: parse_json(p.read_bytes(), str(p), max_bytes=LIMIT)),
    FileReader("snapshot", snapshot.load_snapshot, bound=(snapshot, "MAX_SNAPSHOT_BYTES")),
    FileReader("published nccl.json", lambda p: readback.read_published(p.parent), file="nccl.json",
               bound=(readback, "MAX_PUBLISHED_BYTES")),
    FileReader("fleet document", lambda p: document.read_json_document(p, "export", EXPORT_KIND),
               bound=(document, "MAX_DOCUMENT_BYTES")),
    FileReader("nccl-tests document", nccltests_json.read_document, bound=(nccltests_json, "MAX_DOCUMENT_BYTES")),
    FileReader("install manifest", lambda p: install.uninstall(p.parents[2], disable=False, dry_run=True),
               file=install.MANIFEST, bound=(install, "MAX_MANIFEST_BYTES")),
]


@pytest.mark.parametrize("case", REFUSALS)
@pytest.mark.parametrize("reader", FILE_READERS, ids=lambda r: r.name)
def test_every_json_file_reader_refuses_with_the_file_named(reader: FileReader, case: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    text, said = REFUSALS[case]
    if reader.bound is not None:
        monkeypatch.setattr(*reader.bound, LIMIT)
    path = tmp_path / "dir" / reader.file
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(InputError) as info:
        reader.read(path)
    assert info.value.exit_code == EXIT_CONFIG
    assert str(info.value).startswith(f"{path}"), str(info.value)
    assert said in str(info.value)


def test_a_file_reader_says_the_line_and_column_json_reports(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    path.write_text('{\n  "env": {\n    "NCCL_ALGO": }\n}\n')
    with pytest.raises(InputError) as info:
        read_json(path, LIMIT, "test document")
    assert info.value.line == 3
    assert str(info.value) == f"{path}:3: not valid JSON: Expecting value (column 18)"
    with pytest.raises(InputError, match=r"^<peer>:1: not valid JSON: Extra data \(column 4\)$"):
        parse_json("{} []", "<peer>")


def test_read_json_names_a_file_it_cannot_read_and_refuses_what_is_no_regular_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"missing\.json: cannot read: No such file or directory"):
        read_json(tmp_path / "missing.json", LIMIT, "test document")
    with pytest.raises(InputError, match="is a directory, not a test document"):
        read_json(tmp_path, LIMIT, "test document")
    with pytest.raises(InputError, match="not a regular file"):
        read_json(Path("/dev/zero"), LIMIT, "test document")
    with pytest.raises(InputError, match=r"shown\.json: cannot read"):
        read_json(tmp_path / "missing.json", LIMIT, "test document", shown="shown.json")


def test_a_legacy_nccl_json_that_is_not_strict_json_restarts_the_count(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The generation a set written before generation directories recorded: a key twice is no
    generation at all (either copy could be the one meant)."""
    path = tmp_path / "nccl.json"
    path.write_text('{"provenance": {"generation": 7}}')
    assert generations._legacy_generation(path) == 7
    path.write_text('{"provenance": {"generation": 7}, "provenance": {"generation": 9}}')
    with caplog.at_level(logging.WARNING, logger=generations.__name__):
        assert generations._legacy_generation(path) == 0
    assert f"{path}: unreadable" in caplog.text and "duplicate key 'provenance'" in caplog.text


# -- what is read from memory: a peer's message, the probe's line, a column of the history -----------------


MEMORY_READERS: dict[str, Callable[[str], object]] = {
    "loads_strict": loads_strict,
    "control channel": strict_json,
    "probe": parse_probe,
    "history column": load_json,
}
MEMORY_REFUSALS = {
    "nan": (NAN, "NaN is not"),
    "duplicate-key": (TWICE, "duplicate key 'NCCL_ALGO'"),
    "too-deep": (DEEP, f"nested deeper than {MAX_JSON_DEPTH} levels"),
}


@pytest.mark.parametrize("case", MEMORY_REFUSALS)
@pytest.mark.parametrize("reader", MEMORY_READERS)
def test_every_reader_of_json_in_memory_refuses_the_same(reader: str, case: str) -> None:
    text, said = MEMORY_REFUSALS[case]
    with pytest.raises(ValueError, match=said):
        MEMORY_READERS[reader](text)


def test_the_history_keeps_a_lone_surrogate_for_its_writers_to_name() -> None:
    """A run's environment may hold an undecodable byte (Python's surrogateescape): the history
    reads it back as it was given, and the export refuses it by name (tests/test_fleet.py)."""
    column = '{"NCCL_ALGO": "Ring\\udcff"}'
    assert load_json(column) == {"NCCL_ALGO": "Ring\udcff"}
    with pytest.raises(ValueError, match=r"\$\.NCCL_ALGO: a lone surrogate escape"):
        loads_strict(column)


def test_loads_strict_takes_utf8_bytes_and_a_size_bound() -> None:
    assert loads_strict(b'{"a": "\xc3\xa9"}') == {"a": "\u00e9"}
    with pytest.raises(UnicodeDecodeError):
        loads_strict(b'{"a": "\xff"}')
    assert loads_strict("[1]", max_bytes=3) == [1]
    with pytest.raises(ValueError, match="larger than 3 bytes"):
        loads_strict("[10]", max_bytes=3)
    # Bytes count, not characters: two characters of two bytes each are four.
    with pytest.raises(ValueError, match="larger than 7 bytes"):
        loads_strict('["\u00e9\u00e9"]', max_bytes=7)
    with pytest.raises(InputError, match=r"^<peer>: larger than 3 bytes"):
        parse_json(b"[10]", "<peer>", max_bytes=3)


# -- the rule stays true ----------------------------------------------------------------------------------


# The one parser, and the two programs that run in an interpreter of their own (bench.python, `-I`)
# and import nothing of nccltune.
ALLOWED = {"nccltune/files/inputfile.py", "nccltune/trials/worker.py", "nccltune/trials/rankserver.py"}
PARSERS = {"load", "loads", "JSONDecoder"}


def _direct_parses(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "json":
            found += [(node.lineno, f"from json import {a.name}") for a in node.names if a.name in PARSERS]
        elif (isinstance(node, ast.Attribute) and node.attr in PARSERS and isinstance(node.value, ast.Name)
              and node.value.id == "json"):
            found.append((node.lineno, f"json.{node.attr}"))
    return found


def test_no_module_parses_json_but_through_the_strict_reader() -> None:
    offenders = []
    for path in sorted((REPO / "nccltune").rglob("*.py")):
        name = path.relative_to(REPO).as_posix()
        if name in ALLOWED:
            continue
        offenders += [f"{name}:{line}: {what}" for line, what in _direct_parses(ast.parse(path.read_text(), name))]
    assert not offenders, ("parse JSON with files.inputfile (loads_strict, parse_json, read_json), not json.loads:\n"
                           + "\n".join(offenders))


def test_the_scan_finds_every_spelling() -> None:
    code = "import json\nfrom json import loads\njson.load(f)\nx = json.loads\njson.JSONDecoder().decode(s)\n"
    assert [what for _, what in sorted(_direct_parses(ast.parse(code)))] == [
        "from json import loads", "json.load", "json.loads", "json.JSONDecoder"]
