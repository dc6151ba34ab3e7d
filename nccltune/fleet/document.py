"""A fleet document as read: an export or a class profile, bounded, strict, valid against its
schema and its class id checked against its facts, with the bytes whose digest names it
(`fleet decide` pools exports, `fleet apply` and the daemon read profiles, `export` holds what
it writes to the same bound)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..files.inputfile import parse_json, read_input_file
from ..topology.nodeclass import class_id_of
from .jsonschema import SchemaViolation, load_schema, validate

# Kinds documents already on disk carry, from before kinds were their schemas' names.
OLD_KINDS = {"export": "nccltune-export", "profile": "nccltune-class-profile"}
# Far above any real export or profile (a few MiB), far below what would exhaust memory.
MAX_DOCUMENT_BYTES = 64 << 20


@dataclass(frozen=True)
class FleetDocument:
    """An export or a class profile as read (`read_json_document`): the document, valid against its
    schema, and its bytes, whose digest names the file in a profile's evidence and a published set."""

    path: Path
    doc: dict[str, Any]
    raw: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def class_id(self) -> str:
        return str(self.doc["node_class"]["id"])


def read_json_document(path: Path, schema_name: str, kind: str, *,
                       shown: Path | None = None) -> tuple[dict[str, Any], bytes]:
    """Parse and validate one document against its schema. `shown`: the name messages give it
    (the name a profile was given, when `path` is the real file it was checked to be).

    Raises:
        InputError: unreadable, not JSON (with its line; NaN, a duplicate key or nesting past
            inputfile.MAX_JSON_DEPTH included), another kind, or an element the schema does not
            allow (named by its JSON path). Exit 78.
    """
    name = str(shown or path)
    try:
        # Bounded, regular files only: a FIFO or /dev/zero given as a document must not hang.
        raw = read_input_file(path, MAX_DOCUMENT_BYTES, f"{kind} document")
    except OSError as exc:
        raise InputError(name, f"cannot read: {exc.strerror}") from exc
    doc = parse_json(raw, name)
    if not isinstance(doc, dict) or doc.get("kind") not in (kind, OLD_KINDS.get(kind)):
        got = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise InputError(name, f"not {'an' if kind[0] in 'aeiou' else 'a'} {kind} document (kind is {got!r})")
    try:
        validate(doc, load_schema(schema_name))
    except SchemaViolation as exc:
        raise InputError(name, f"{exc.where}: {exc.detail}",
                         hint=f"the format is schemas/{schema_name}.schema.json") from exc
    cls = doc["node_class"]
    if class_id_of(cls["facts"]) != cls["id"]:
        # An edited fact with the old id would pass for the class it no longer describes.
        raise InputError(name, f"$.node_class.id: {cls['id']} is not the id of $.node_class.facts "
                         f"({class_id_of(cls['facts'])})", hint="regenerate the document rather than editing it")
    return doc, raw


@dataclass(frozen=True)
class Export(FleetDocument):
    """A node's export, as `decide` pools it."""

    @property
    def name(self) -> str:
        return f"{self.doc['hostname']} ({self.path.name})"
