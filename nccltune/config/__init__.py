"""The configuration file: `/etc/nccltune/config.yaml`, or the one given with `--config FILE`.

Every setting has a default, so a node without a config file works; every path the daemon
writes has a key here (and a command-line flag that goes through `with_overrides`), so that
nothing needs root in tests. The file is checked strictly: an unknown key, a value of the wrong
type or out of range, or a key written twice is an `InputError` (exit 78) naming the file, the
line and the dotted key, because a silently ignored typo in a tuning daemon's config shows up
only weeks later as a slower job.

    schema.py     the settings: one frozen dataclass per section, defaults, range checks, sizes
                  and windows, and the reflection the others walk
    nodes.py      a tree of values with their lines, from YAML or from Python values
    loader.py     the file: bounded, strict YAML (`load_config`, `parse_config`)
    build.py      the tree validated into a Config, every message with file:line and did-you-mean
    overrides.py  plain values and back (`config_to_dict`, `config_from_dict`, `with_overrides`)
"""

from __future__ import annotations

from ..names import VARIABLE_NAME_RE, format_size
from .loader import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES, load_config, parse_config
from .overrides import config_from_dict, config_to_dict, with_overrides
from .schema import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_STATE_DIR,
    MAX_MESSAGE_BYTES,
    OVERRIDE_SOURCE,
    Backend,
    BenchConfig,
    Config,
    DaemonConfig,
    Engine,
    MultinodeConfig,
    ProfileConfig,
    ProfileWeights,
    PublishConfig,
    Strategy,
    SweepConfig,
    TopologyConfig,
    TunerConfig,
    TunerPlugin,
    parse_size,
    parse_window,
    profile_collectives,
    setting_names,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_STATE_DIR",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "MAX_MESSAGE_BYTES",
    "OVERRIDE_SOURCE",
    "VARIABLE_NAME_RE",
    "Backend",
    "BenchConfig",
    "Config",
    "DaemonConfig",
    "Engine",
    "MultinodeConfig",
    "ProfileConfig",
    "ProfileWeights",
    "PublishConfig",
    "Strategy",
    "SweepConfig",
    "TopologyConfig",
    "TunerConfig",
    "TunerPlugin",
    "config_from_dict",
    "config_to_dict",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
    "parse_window",
    "profile_collectives",
    "setting_names",
    "with_overrides",
]
