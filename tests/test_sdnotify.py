"""sd_notify protocol against real AF_UNIX datagram sockets, as systemd listens on them."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nccltune.daemon.sdnotify import Notifier, watchdog_interval_s


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket in tmp_path, like the one systemd passes in NOTIFY_SOCKET."""
    path = str(tmp_path / "notify")
    assert len(path) < 100, "sun_path holds 108 bytes"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


@pytest.fixture
def abstract_listener() -> Iterator[tuple[socket.socket, str]]:
    name = f"nccltune-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    yield sock, "@" + name
    sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(65536).decode()


def test_ready_and_status_arrive_as_sent(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier(path)
    assert notifier.enabled
    assert notifier.ready(status="idle, 8 GPUs")
    assert recv(sock) == "READY=1\nSTATUS=idle, 8 GPUs\n"
    assert notifier.status("sweeping 3/40")
    assert recv(sock) == "STATUS=sweeping 3/40\n"
    assert notifier.ready()
    assert recv(sock) == "READY=1\n"


def test_socket_taken_from_env(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier(env={"NOTIFY_SOCKET": path})
    assert notifier.enabled and notifier.socket_path == path
    notifier.notify(READY=1, MAINPID=1234)
    assert recv(sock) == "READY=1\nMAINPID=1234\n"


def test_socket_taken_from_os_environ(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert Notifier().watchdog()
    assert recv(sock) == "WATCHDOG=1\n"


def test_explicit_path_wins_over_env(listener: tuple[socket.socket, str], tmp_path: Path) -> None:
    sock, path = listener
    notifier = Notifier(path, env={"NOTIFY_SOCKET": str(tmp_path / "elsewhere")})
    assert notifier.status("x")
    assert recv(sock) == "STATUS=x\n"


def test_abstract_socket(abstract_listener: tuple[socket.socket, str]) -> None:
    sock, name = abstract_listener
    notifier = Notifier(env={"NOTIFY_SOCKET": name})
    assert notifier.enabled
    assert notifier.ready("up")
    assert recv(sock) == "READY=1\nSTATUS=up\n"


def test_newlines_in_status_are_replaced(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier(path)
    notifier.status("sweep failed:\nNCCL error\r\nunhandled cuda error\n")
    assert recv(sock) == "STATUS=sweep failed: NCCL error unhandled cuda error\n"
    notifier.stopping("bye\nnow")
    assert recv(sock) == "STOPPING=1\nSTATUS=bye now\n"


def test_stopping_and_extend_timeout(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier(path)
    notifier.stopping()
    assert recv(sock) == "STOPPING=1\n"
    notifier.extend_timeout(90_000_000)
    assert recv(sock) == "EXTEND_TIMEOUT_USEC=90000000\n"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            notifier.extend_timeout(bad)  # type: ignore[arg-type]


def test_reloading_carries_monotonic_usec(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier(path)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = recv(sock).splitlines()
    assert lines[0] == "RELOADING=1"
    key, _, value = lines[1].partition("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    assert len(lines) == 2


def test_invalid_field_name_is_a_programming_error(listener: tuple[socket.socket, str]) -> None:
    notifier = Notifier(listener[1])
    with pytest.raises(ValueError):
        notifier.notify(**{"A=B": 1})
    with pytest.raises(ValueError):
        notifier.notify(**{"": 1})


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "relative/notify"}])
def test_no_socket_means_disabled_and_no_op(env: dict[str, str]) -> None:
    notifier = Notifier(env=env)
    assert not notifier.enabled
    assert notifier.send("READY=1\n") is False
    assert notifier.ready("x") is False
    assert notifier.watchdog() is False
    assert notifier.reloading() is False


def test_not_under_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not Notifier().enabled


def test_vanished_socket_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    notifier = Notifier(path)
    # Nobody listening any more, but the file is still there: ECONNREFUSED.
    sock.close()
    with caplog.at_level(logging.DEBUG, logger="nccltune.daemon.sdnotify"):
        assert notifier.ready() is False
        # The file is gone too (systemd restarted, socket cleaned up): ENOENT.
        os.unlink(path)
        assert notifier.watchdog() is False
        assert notifier.status("still alive") is False
    assert any("sd_notify" in r.getMessage() for r in caplog.records)
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_vanished_abstract_socket_does_not_raise() -> None:
    assert Notifier(f"@nccltune-test-gone-{uuid.uuid4().hex}").ready() is False


class TestWatchdogInterval:
    def test_from_watchdog_usec(self) -> None:
        assert watchdog_interval_s({"WATCHDOG_USEC": "300000000"}) == 300.0
        assert watchdog_interval_s({"WATCHDOG_USEC": "1500000"}) == 1.5

    def test_matching_pid(self) -> None:
        env = {"WATCHDOG_USEC": "300000000", "WATCHDOG_PID": str(os.getpid())}
        assert watchdog_interval_s(env) == 300.0
        assert watchdog_interval_s({**env, "WATCHDOG_PID": "4242"}, pid=4242) == 300.0

    def test_pid_mismatch_means_not_ours(self) -> None:
        env = {"WATCHDOG_USEC": "300000000", "WATCHDOG_PID": str(os.getpid() + 1)}
        assert watchdog_interval_s(env) is None
        assert watchdog_interval_s({**env, "WATCHDOG_PID": "4242"}, pid=4243) is None

    @pytest.mark.parametrize(
        "env",
        [
            {},
            {"WATCHDOG_USEC": ""},
            {"WATCHDOG_USEC": "0"},
            {"WATCHDOG_USEC": "-5"},
            {"WATCHDOG_USEC": "5s"},
            {"WATCHDOG_USEC": "300000000", "WATCHDOG_PID": "self"},
        ],
    )
    def test_absent_or_invalid(self, env: dict[str, str]) -> None:
        assert watchdog_interval_s(env) is None

    def test_defaults_to_os_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("WATCHDOG_USEC", "20000000")
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        assert watchdog_interval_s() == 20.0
        monkeypatch.delenv("WATCHDOG_USEC")
        assert watchdog_interval_s() is None
