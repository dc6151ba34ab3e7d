"""A small validator for the subset of JSON Schema that nccltune's own schemas use.

The schemas in `schemas/` (shipped as package data) are the contract for export and profile
documents; other tools can check them with any JSON Schema validator. nccltune itself does not
depend on one, so it reads the keywords it uses: type, required, properties, additionalProperties,
items, enum, const, minimum, minLength, pattern, dependentRequired and local `$ref`s to `#/$defs/...`. An unknown
keyword in a schema is an error, so that a schema never says more than is checked.
"""

from __future__ import annotations

import json
import logging
import re
from functools import cache
from pathlib import Path
from typing import Any

from ..files.inputfile import read_json

log = logging.getLogger(__name__)

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
MAX_SCHEMA_BYTES = 1 << 20

_KNOWN = {"$schema", "$id", "$defs", "$ref", "title", "description", "type", "required", "properties",
          "additionalProperties", "items", "enum", "const", "minimum", "minLength", "pattern", "default",
          "dependentRequired"}
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,), "null": (type(None),),
    "integer": (int,), "number": (int, float),
}


class SchemaViolation(ValueError):
    """A document does not match its schema; `where` is the JSON path of the first bad element."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.detail = message


@cache
def load_schema(name: str) -> dict[str, Any]:
    """`export` or `profile`: the parsed schema file (shipped with nccltune, read as every JSON is)."""
    doc: dict[str, Any] = read_json(SCHEMA_DIR / f"{name}.schema.json", MAX_SCHEMA_BYTES, "JSON schema")
    return doc


def _type_ok(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[name])


def validate(doc: Any, schema: dict[str, Any], root: dict[str, Any] | None = None, where: str = "$") -> None:
    """Raise SchemaViolation for the first element of `doc` that `schema` does not allow."""
    root = schema if root is None else root
    unknown = set(schema) - _KNOWN
    if unknown:
        raise ValueError(f"schema at {where} uses unsupported keyword(s) {sorted(unknown)}")
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"schema at {where}: only local #/$defs references are supported, not {ref}")
        validate(doc, root["$defs"][ref.removeprefix("#/$defs/")], root, where)
        return
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(doc, t) for t in types):
            raise SchemaViolation(where, f"expected {' or '.join(types)}, got {type(doc).__name__} {_short(doc)}")
    if "const" in schema and doc != schema["const"]:
        raise SchemaViolation(where, f"expected {schema['const']!r}, got {_short(doc)}")
    if "enum" in schema and doc not in schema["enum"]:
        raise SchemaViolation(where, f"{_short(doc)} is not one of {schema['enum']}")
    if isinstance(doc, (int, float)) and not isinstance(doc, bool) and "minimum" in schema \
            and doc < schema["minimum"]:
        raise SchemaViolation(where, f"{doc} is below the minimum {schema['minimum']}")
    if isinstance(doc, str):
        if len(doc) < schema.get("minLength", 0):
            raise SchemaViolation(where, f"shorter than {schema['minLength']} character(s)")
        if "pattern" in schema and not re.search(schema["pattern"], doc):
            raise SchemaViolation(where, f"{_short(doc)} does not match {schema['pattern']}")
    if isinstance(doc, dict):
        for key in schema.get("required", []):
            if key not in doc:
                raise SchemaViolation(where, f"missing required key {key!r}")
        for key, needs in schema.get("dependentRequired", {}).items():
            missing = [need for need in needs if key in doc and need not in doc]
            if missing:
                raise SchemaViolation(where, f"{key!r} needs {missing[0]!r} beside it")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key in sorted(doc):
            sub = f"{where}.{key}"
            if key in props:
                validate(doc[key], props[key], root, sub)
            elif extra is False:
                raise SchemaViolation(sub, "unknown key")
            elif isinstance(extra, dict):
                validate(doc[key], extra, root, sub)
    if isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            validate(item, schema["items"], root, f"{where}[{i}]")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
