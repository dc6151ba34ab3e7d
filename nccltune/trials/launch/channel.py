"""The control channel between a torchrun sweep's coordinator and its joining nodes.

Control channel: JSON lines over one TCP connection per joining node, coordinator at HOST:PORT+1.
  joiner -> {"hello": host, "version": V}; coordinator -> {"welcome": N, "nproc_per_node": P} or
  {"refuse": why} (another nccltune version); per trial coordinator -> {"trial": seq, "rdzv_id", "env", "files",
  "worker_args", "timeout_s", "nccl_debug"}, joiner -> {"result": seq, "exit": code, "rank0_out", "err_tail"},
  plus, where rank 0 ran on the joiner and nccl_debug was asked, "nccl_log" (rank 0's NCCL log,
  zlib and base64: trials.nccllog.pack) or "nccl_log_missing" (why not); coordinator -> {"kill": seq}
  when the trial ends badly here, {"stop": true} at the end.
It is as unauthenticated as torch's c10d store on HOST:PORT: both ports must be reachable from the
job's nodes only. A joiner runs nothing but its own worker.py, with argument lists, never a shell.

"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Mapping
from typing import Any

from ...errors import UnavailableError
from . import host_port

log = logging.getLogger(__name__)

CONTROL_PORT_OFFSET = 1  # the control channel listens next to the rendezvous port
MAX_MESSAGE_BYTES = 16 << 20


class Peer:
    """One JSON-lines connection; reads never block longer than asked."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        self.buf = b""
        self.closed = False

    def send(self, doc: Mapping[str, Any]) -> bool:
        try:
            self.sock.sendall(json.dumps(doc, sort_keys=True).encode() + b"\n")
            return True
        except OSError:
            self.closed = True
            return False

    def read(self, timeout_s: float) -> list[dict[str, Any]]:
        """Whatever whole messages arrive within `timeout_s` (none when the peer is closed)."""
        msgs: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        polled = False
        while not self.closed:
            msgs.extend(self._split())
            left = deadline - time.monotonic()
            if msgs or (left <= 0 and polled):
                break
            polled = True  # a zero timeout still looks once at what has arrived
            ready, _, _ = select.select([self.sock], [], [], max(0.0, left))
            if not ready:
                break
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self.buf += data
            if len(self.buf) > MAX_MESSAGE_BYTES:
                log.warning("%s: message over %d bytes; closing", self.name, MAX_MESSAGE_BYTES)
                self.closed = True
        return msgs

    def _split(self) -> list[dict[str, Any]]:
        msgs = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            try:
                doc = json.loads(line)
            except ValueError:
                log.warning("%s: not a JSON message: %r", self.name, line[:80])
                continue
            if isinstance(doc, dict):
                msgs.append(doc)
        return msgs

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


class ControlServer:
    """The coordinator's end: joiners connect, get each trial, report each trial's end."""

    def __init__(self, host: str, port: int, *, joiners: int, nproc_per_node: int, join_wait_s: float = 600.0) -> None:
        self.want = joiners
        self.nproc_per_node = nproc_per_node
        self.join_wait_s = join_wait_s
        try:
            self.server = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise UnavailableError(f"cannot listen on {host_port(host, port)} for joining nodes: {exc.strerror}",
                                   hint="pick another --rdzv-endpoint port (PORT and PORT+1 must be free)") from exc
        self.server.settimeout(1.0)
        self.peers: list[Peer] = []
        self.results: dict[str, dict[str, Any]] = {}  # peer name -> its result of the current trial
        self.seq = 0

    def _accept(self, deadline: float) -> None:
        self.peers = [p for p in self.peers if not p.closed]
        while len(self.peers) < self.want and time.monotonic() < deadline:
            try:
                sock, addr = self.server.accept()
            except TimeoutError:
                continue
            peer = Peer(sock, f"{addr[0]}:{addr[1]}")
            hello = peer.read(30.0)
            if not hello or "hello" not in hello[0]:
                peer.close()
                continue
            peer.name = f"node {hello[0]['hello']} ({addr[0]})"
            from ... import __version__

            if hello[0].get("version") != __version__:
                # The worker's arguments and records must mean the same on both ends.
                peer.send({"refuse": f"the coordinator runs nccltune {__version__}, this node "
                                     f"{hello[0].get('version')}"})
                peer.close()
                continue
            peer.send({"welcome": self.want + 1, "nproc_per_node": self.nproc_per_node})
            log.info("%s joined", peer.name)
            self.peers.append(peer)
        if len(self.peers) < self.want:
            raise UnavailableError(
                f"{len(self.peers)} of {self.want} other node(s) joined within {self.join_wait_s:g} s",
                hint="run `nccltune sweep --join HOST:PORT` on each other node (the coordinator's --rdzv-endpoint)")

    def publish(self, msg: dict[str, Any]) -> None:
        self._accept(time.monotonic() + self.join_wait_s)
        self.seq = int(msg["trial"])
        self.results = {}
        for peer in self.peers:
            peer.send(msg)

    def _drain(self, timeout_s: float) -> None:
        for peer in self.peers:
            for doc in peer.read(timeout_s):
                if doc.get("result") == self.seq:
                    self.results[peer.name] = doc

    def failure(self) -> str | None:
        self._drain(0.0)
        for peer in self.peers:
            got = self.results.get(peer.name)
            if got is not None and got.get("exit") != 0:
                tail = f": {got['err_tail']}" if got.get("err_tail") else ""
                return f"{peer.name}: torchrun exited with status {got.get('exit')}{tail}"
            if got is None and peer.closed:
                return f"{peer.name} closed the control connection"
        return None

    def kill(self) -> None:
        for peer in self.peers:
            peer.send({"kill": self.seq})

    def collect(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every joiner's result of the current trial, waiting at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [p for p in self.peers if not p.closed and p.name not in self.results]
            if not live:
                break
            self._drain(0.1)
        return [self.results[p.name] for p in self.peers if p.name in self.results]

    def close(self) -> None:
        for peer in self.peers:
            peer.send({"stop": True})
            peer.close()
        self.server.close()


def connect(host: str, port: int, wait_s: float) -> socket.socket:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=10)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise UnavailableError(f"cannot reach the coordinator at {host_port(host, port)}: {exc}",
                                       hint="start `nccltune sweep --nodes N --rdzv-endpoint HOST:PORT` there") from exc
            time.sleep(1.0)


def version() -> str:
    from ... import __version__

    return __version__
