"""Settings as plain values and back: `config_to_dict` (the history, the JSON documents),
`config_from_dict`, and `with_overrides` (the command line's flags), validated as the loader
validates a file."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any

from ..errors import InputError
from .builder import Builder
from .located import from_python
from .schema import OVERRIDE_SOURCE, Config, is_section, setting_names, settings_of, split_optional


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The settings as plain JSON-able values, in file layout (no path, no lines).

    Message sizes in profiles become string keys ("65536"), as JSON requires; config_from_dict
    and the loader read them back.
    """

    def plain(value: object) -> Any:
        if is_section(type(value)):
            return {name: plain(getattr(value, name)) for name in settings_of(type(value))}
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    result: dict[str, Any] = plain(cfg)
    return result


def config_from_dict(data: Mapping[str, object], *, source: str = "<dict>") -> Config:
    """Validate plain values in file layout (what config_to_dict gives) into a Config.

    Raises:
        InputError: as for a file, naming `source` instead of a file and line (exit 78).
    """
    return Builder(None, source).build(from_python(data, "", lambda _dotted: None))


def with_overrides(cfg: Config, **dotted: object) -> Config:
    """cfg with some settings replaced, by dotted key, validated as the loader would.

    `with_overrides(cfg, **{"state_dir": "/tmp/x", "sweep.profile": "large"})`. A key may reach
    into a mapping setting ("sweep.pin.NCCL_PROTO") or replace a whole section ("bench"). None
    sets an optional setting back to None. Lines from the file are kept for the settings not
    overridden, so a later error about them still names file:line.

    Raises:
        InputError: an unknown key, or a value the loader would refuse; named as coming from
            the command line (exit 78).
    """
    if not dotted:
        return cfg
    data = config_to_dict(cfg)
    for key, value in dotted.items():
        _set_dotted(data, key, value)
    overridden = list(dotted)

    def line_of(name: str) -> int | None:
        for key in overridden:
            if name == key or name.startswith((key + ".", key + "[")):
                return None
        return cfg.lines.get(name)

    return Builder(cfg.path, OVERRIDE_SOURCE).build(from_python(data, "", line_of))


def _set_dotted(data: dict[str, Any], key: str, value: object) -> None:
    parts = key.split(".")
    cls: type | None = Config
    target = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if cls is not None:
            specs = settings_of(cls)
            if part not in specs:
                near = difflib.get_close_matches(key, list(setting_names()), n=1, cutoff=0.6)
                raise InputError(
                    OVERRIDE_SOURCE,
                    f"unknown setting {key}",
                    hint=f"did you mean {near[0]}?" if near else None,
                )
            _, base = split_optional(specs[part].hint)
            if is_section(base):
                cls = base
            elif typing.get_origin(base) is dict:
                cls = None  # below here, keys are the user's own (variable or profile names)
            elif not last:
                raise InputError(
                    OVERRIDE_SOURCE, f"unknown setting {key}: {'.'.join(parts[: i + 1])} has no sub-keys"
                )
        if last:
            target[part] = value
            return
        child = target.get(part)
        if not isinstance(child, dict):
            child = {}
            target[part] = child
        target = child
