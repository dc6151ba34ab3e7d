"""The launcher registry is the one list of names: the parser and resolve_launcher read it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nccltune.cli.parser import build_parser
from nccltune.errors import UsageError
from nccltune.trials.launch import LAUNCHERS, resolve_launcher
from nccltune.trials.launch.registry import CHOICES, LAUNCHER_NAMES


def test_parser_accepts_every_registered_launcher_and_nothing_else():
    parser = build_parser()
    for name in CHOICES:
        assert parser.parse_args(["sweep", "--launcher", name]).launcher == name
    with pytest.raises(UsageError, match="choose from 'auto', 'local', 'torchrun', 'srun'"):
        parser.parse_args(["sweep", "--launcher", "mpirun"])


def test_resolve_launcher_reads_the_registry():
    assert LAUNCHERS == CHOICES == ("auto", *LAUNCHER_NAMES)
    with pytest.raises(UsageError, match="expected one of auto, local, torchrun, srun"):
        resolve_launcher("mpirun", 1, {})


def test_registry_imports_alone_without_the_launch_package():
    code = ("import sys; import nccltune.trials.launch.registry; "
            "assert 'nccltune.trials.launch.torchrun' not in sys.modules; "
            "assert 'nccltune.trials.launch.channel' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_peer_messages_are_read_as_strictly_as_files():
    from nccltune.trials.launch.channel import strict_json

    assert strict_json(b'{"seq": 1}') == {"seq": 1}
    for bad in (b'{"kill": 1, "kill": 2}', b'{"gain": NaN}', b"[" * 200 + b"]" * 200, b'"\xff"'):
        with pytest.raises(ValueError):
            strict_json(bad)
