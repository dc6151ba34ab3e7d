"""Rendering helpers for the command line: tables and JSON documents. No I/O besides strings.

Every JSON document has a schema in the repository's `schemas/` directory (`<kind>.schema.json`)
and follows two rules there, so that a consumer parses one shape:

- a per-size row (sweep, report, history, verify) starts with `size_bytes` and `collective`, and
  names a quantity the same way everywhere (`*_busbw_gbps`, `*_noise_pct`, `time_us`);
- numbers are rounded by what their key measures (`ROUNDING`): GB/s (10^9 bytes per second) to
  3 decimals, percentages and microseconds and seconds to 2, ratios and weights to 4.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..logsetup import escaped
from ..records import ReportRow

if TYPE_CHECKING:  # the views only; rendering runs no sweep, verify or check
    pass



SCHEMA_VERSION = 1


# Key suffix -> decimals: the one rounding rule of every JSON document (see the module docstring).
ROUNDING: tuple[tuple[str, int], ...] = (("_gbps", 3), ("_pct", 2), ("_us", 2), ("_s", 2), ("ratio", 4),
                                         ("weight", 4))


def _digits(key: str | None) -> int | None:
    if key is None:
        return None
    return next((d for suffix, d in ROUNDING if key.endswith(suffix)), None)


def rounded(value: Any, digits: int | None = None) -> Any:
    """`value` with every float rounded by the key it sits under (`ROUNDING`); a map or list under
    such a key (busbw by size) takes its key's rule. Integers, strings and unruled keys stay as they are."""
    if isinstance(value, float):
        return round(value, digits) if digits is not None else value
    if isinstance(value, dict):
        return {k: rounded(v, _digits(k) if _digits(k) is not None else digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(rounded({"schema_version": SCHEMA_VERSION, **doc}), indent=2, sort_keys=False)


def size_row(size_bytes: int, collective: str, **fields: Any) -> dict[str, Any]:
    """One per-size row of a JSON document: `size_bytes` and `collective` first, then its numbers."""
    return {"size_bytes": size_bytes, "collective": collective, **fields}


def report_row(row: ReportRow) -> dict[str, Any]:
    """A sweep's report row (sweep, report, history documents)."""
    fields = {k: v for k, v in row.as_dict().items() if k not in ("size_bytes", "collective")}
    return size_row(row.size_bytes, row.collective, **fields)


def fmt_bw(gbps: float) -> str:
    """GB/s with the digits that matter: 345.2, 12.34, 0.0123 (CPU demo sizes move little)."""
    if gbps >= 100:
        return f"{gbps:.1f}"
    if gbps >= 1:
        return f"{gbps:.2f}"
    return f"{gbps:.3g}"


def shown(value: str) -> str:
    """A value from the environment or a config as one terminal-safe line: a newline or an escape
    sequence is printed escaped (\\n, \\x1b), never acted on by the terminal."""
    return escaped(value, None)
