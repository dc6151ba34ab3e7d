"""A trial's rendezvous port comes from below the kernel's ephemeral range, where no outgoing
connection takes it as its source port before rank 0 listens on it; a port something already
listens on is never chosen, and with the range taken the kernel's choice is the fallback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from nccltune.trials.launch import base
from nccltune.trials.launch.base import RDZV_PORTS, TrialSpec, free_port
from nccltune.trials.launch.local import LocalLaunch


def test_the_port_is_below_the_ephemeral_range_and_free_to_listen_on() -> None:
    assert RDZV_PORTS.stop <= 32768  # Linux's default ephemeral range starts at 32768
    for _ in range(20):
        port = free_port()
        assert port in RDZV_PORTS
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_a_port_something_listens_on_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(base, "RDZV_PORTS", range(taken, taken + 1))
        port = free_port()  # the one port of the range is taken: the kernel's choice
        assert port != taken and port > 0


def test_a_local_launch_gives_every_rank_one_port_from_the_range(tmp_path: Path) -> None:
    specs = LocalLaunch(3).start(TrialSpec(1, tmp_path, ["python", "worker.py"], {}, {}, 60.0))
    ports = {spec.env["MASTER_PORT"] for spec in specs}
    assert len(specs) == 3 and len(ports) == 1 and int(ports.pop()) in RDZV_PORTS
