"""Reading the config file: bounded (size, values once aliases are expanded, depth), strict YAML.

The file is read with `yaml.compose` rather than `yaml.safe_load`: composed nodes keep their
line numbers, and a mapping node still holds both copies of a duplicated key, which
`safe_load` would silently collapse to the last one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from yaml.constructor import ConstructorError, SafeConstructor

from ..errors import InputError
from ..files.inputfile import read_input_file
from .builder import Builder
from .located import Entry, Located, Map, Scalar, Seq
from .schema import Config, join_key

logger = logging.getLogger(__package__)

_MERGE_TAG = "tag:yaml.org,2002:merge"

# Bounds on a config document: a real one is a few KiB with a few hundred nodes, nested a few
# levels. Beyond them it is a mistake or an attack (a 472-byte alias bomb expands to billions
# of nodes), refused before it costs time or memory.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_DEPTH = 64


def _check_text(text: str, where: str, path: str, line: int) -> None:
    """A YAML escape (\\ud800 in a double-quoted string) can make a lone surrogate: no character,
    text no UTF-8 writer can encode. Refused where it is written.

    Raises:
        InputError: naming the key and the line (exit 78).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(path, f"{where}: a lone surrogate escape (\\ud800-\\udfff without its pair) is no "
                         "character, so the text is not valid UTF-8", line=line) from None


def _from_yaml(
    node: yaml.Node, dotted: str, path: str, constructor: SafeConstructor, active: set[int],
    budget: list[int] | None = None,
) -> Located:
    """Convert a composed YAML node; ``budget`` holds the nodes still allowed, aliases expanded.

    Raises:
        InputError: a self-referring alias, more than MAX_CONFIG_NODES nodes once aliases are
            expanded, or deeper than MAX_CONFIG_DEPTH (exit 78).
    """
    if budget is None:
        budget = [MAX_CONFIG_NODES]
    line = node.start_mark.line + 1
    where = dotted or "the top level"
    budget[0] -= 1
    if budget[0] < 0:
        raise InputError(path, f"{where}: more than {MAX_CONFIG_NODES} values once YAML aliases are expanded",
                         line=line, hint="an alias bomb, or a document that is no nccltune config")
    if len(active) >= MAX_CONFIG_DEPTH:
        raise InputError(path, f"{where}: nested deeper than {MAX_CONFIG_DEPTH} levels", line=line)
    if id(node) in active:
        # `&a [*a]` composes to a node that contains itself.
        raise InputError(path, f"{where}: a YAML alias refers to itself", line=line)
    if isinstance(node, yaml.ScalarNode):
        try:
            value = constructor.construct_object(node, deep=True)
        except (ConstructorError, ValueError) as exc:
            problem = exc.problem if isinstance(exc, ConstructorError) else str(exc)
            raise InputError(path, f"{where}: {problem}", line=line) from exc
        _check_text(node.value, where, path, line)
        return Scalar(line, value, node.value)
    active.add(id(node))
    try:
        if isinstance(node, yaml.SequenceNode):
            items = [
                _from_yaml(item, f"{dotted}[{i}]", path, constructor, active, budget)
                for i, item in enumerate(node.value)
            ]
            return Seq(line, items)
        assert isinstance(node, yaml.MappingNode)
        entries: list[Entry] = []
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
                raise InputError(
                    path,
                    f"{where}: YAML merge keys (<<) are not supported",
                    line=key_line,
                    hint="write the keys out",
                )
            if not isinstance(key_node, yaml.ScalarNode):
                raise InputError(path, f"{where}: a key must be a plain name", line=key_line)
            key = str(key_node.value)
            child = join_key(dotted, key)
            _check_text(key, f"{where}: the key {key!a}", path, key_line)
            if key in first_line:
                raise InputError(
                    path,
                    f"duplicate key {child} (first at line {first_line[key]})",
                    line=key_line,
                    hint="YAML would keep only the last one; remove the other",
                )
            first_line[key] = key_line
            entries.append(Entry(key, key_line, _from_yaml(value_node, child, path, constructor, active, budget)))
        return Map(line, entries)
    finally:
        active.discard(id(node))


def parse_config(text: str, path: str = "<config>") -> Config:
    """Parse and validate a config document; `path` names it in messages.

    Raises:
        InputError: YAML syntax error (with its line), or any fault in the settings (exit 78).
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise InputError(path, f"larger than {MAX_CONFIG_BYTES} bytes; not an nccltune config")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError as exc:
        raise InputError(path, "nested too deeply to read") from exc
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        if exc.context and exc.problem and exc.context_mark is not None:
            problem += f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise InputError(path, f"not valid YAML: {problem}", line=mark.line + 1 if mark else None) from exc
    except yaml.YAMLError as exc:
        raise InputError(path, f"not valid YAML: {exc}") from exc
    if root is None:
        return Config(path=path)
    node = _from_yaml(root, "", path, SafeConstructor(), set())
    return Builder(path, path).build(node)


def load_config(path: Path | str | None, *, required: bool = False) -> Config:
    """Load the config file at path.

    None gives the built-in defaults. A missing file gives the defaults too, unless required
    (the user named it with --config, so its absence is a mistake, not a choice). An empty file
    is the defaults.

    Raises:
        InputError: a required file is missing, the file cannot be read, is not UTF-8 or not
            valid YAML, or a setting is unknown, duplicated, mistyped or out of range (exit 78).
    """
    if path is None:
        return Config()
    p = Path(path)
    name = str(p)
    try:
        raw = read_input_file(p, MAX_CONFIG_BYTES, "config file", trusted=True)
    except (FileNotFoundError, NotADirectoryError) as exc:
        if required:
            raise InputError(
                name,
                "config file not found",
                hint="check the --config path, or leave it out for the defaults",
            ) from exc
        logger.debug("no config file at %s; using the defaults", name)
        return Config()
    except OSError as exc:
        raise InputError(name, f"cannot read: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(name, "not UTF-8 text", line=raw[: exc.start].count(b"\n") + 1) from exc
    cfg = parse_config(text, name)
    logger.debug("loaded config %s", name)
    return cfg
