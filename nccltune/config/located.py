"""A small tree of values with their lines, made from YAML nodes (loader.py) or from Python
values (overrides.py), so that both are validated by the same code (build.py)."""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from .schema import join_key


@dataclass
class Scalar:
    line: int | None
    value: object
    # As written: a YAML int is published as the user spelled it, not as Python reprints it.
    text: str


@dataclass
class Seq:
    line: int | None
    items: list[Located]


@dataclass
class Entry:
    key: str
    line: int | None
    value: Located


@dataclass
class Map:
    line: int | None
    entries: list[Entry]


Located: TypeAlias = "Scalar | Seq | Map"


def from_python(value: object, dotted: str, line_of: Callable[[str], int | None]) -> Located:
    line = line_of(dotted)
    if isinstance(value, Mapping):
        entries = []
        for k, v in value.items():
            child = join_key(dotted, str(k))
            entries.append(Entry(str(k), line_of(child), from_python(v, child, line_of)))
        return Map(line, entries)
    if isinstance(value, (list, tuple)):
        return Seq(line, [from_python(v, f"{dotted}[{i}]", line_of) for i, v in enumerate(value)])
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return Scalar(line, value, str(value))


def describe(node: Located) -> str:
    if isinstance(node, Seq):
        return "a list"
    if isinstance(node, Map):
        return "a mapping"
    v = node.value
    if v is None:
        return "null (no value)"
    if isinstance(v, bool):
        return f"a boolean ({node.text})"
    if isinstance(v, int):
        return f"an integer ({node.text})"
    if isinstance(v, float):
        return f"a number ({node.text})"
    if isinstance(v, str):
        return f'a string ("{v}")'
    if isinstance(v, (_dt.date, _dt.datetime)):
        return f"a date ({node.text})"
    return f"a {type(v).__name__}"


def is_null(node: Located) -> bool:
    return isinstance(node, Scalar) and node.value is None
