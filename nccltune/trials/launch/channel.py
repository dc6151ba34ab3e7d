"""The control channel between a torchrun sweep's coordinator and its joining nodes.

JSON lines over one TCP connection per joining node, the coordinator listening at HOST:PORT+1 on
the address it was given. Nothing before the handshake below is believed, and nothing after it
that does not carry a valid MAC.

Handshake (challenge-response, fresh nonces from both sides for every connection):
  joiner -> {"hello": host, "version": V, "nonce": Nj}
  coordinator -> {"challenge": Nc, "proof": MAC(K, "coordinator", Nj, Nc)}
  joiner checks the proof (a peer without the key cannot make it: the joiner stops and runs nothing)
  joiner -> {"proof": MAC(K, "joiner", Nc, Nj)}
  coordinator checks it; a joiner without the key gets {"refuse": why} and is closed.
MAC is HMAC-SHA256. Each side then holds the session key S = MAC(K, "session", Nc, Nj), and every
further message in either direction is sealed with it and a sequence number (sealing.py).

After the handshake (bodies):
  coordinator -> {"welcome": N, "nproc_per_node": P}, or {"refuse": why} (another nccltune version,
  or another image: the hello's "image", bench.image's digest or null, must be the coordinator's);
  per trial coordinator -> {"trial": seq, "rdzv_id", "env", "files", "worker_args", "timeout_s",
  "nccl_debug"}, joiner -> {"result": seq, "exit": code, "wall_s", "rank0_out", "err_tail"}, plus,
  where rank 0 ran on the joiner and nccl_debug was asked, "nccl_log" (rank 0's NCCL log, zlib and
  base64: trials.nccllog.pack) or "nccl_log_missing" (why not); coordinator -> {"kill": seq} when
  the trial ends badly there, {"stop": true} at the end.

The key, the MACs and the sealed messages: sealing.py. What a joining node accepts, and the
bounds of every message: messages.py. The coordinator's admission, which connections that never
authenticate cannot starve: admission.py. This module: the coordinator's trials over the admitted
connections (`ControlServer`) and the joining node's end of the handshake (`handshake`).

A joiner runs nothing but its own worker.py, with argument lists, never a shell. torch's c10d
store on HOST:PORT has no authentication of its own: it carries only the rendezvous, and both
ports should still be reachable from the job's nodes only.
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections.abc import Iterable
from typing import Any

from ...errors import InputError, UnavailableError
from ...logsetup import escaped
from .admission import Admission, close_quietly
from .base import host_port
from .messages import check_result
from .sealing import (
    MAX_LINE_BYTES,
    MAX_TAIL_CHARS,
    SEND_TIMEOUT_S,
    Peer,
    is_mac,
    is_nonce,
    mac,
    new_nonce,
    session_key,
)

log = logging.getLogger(__name__)

CONTROL_PORT_OFFSET = 1  # the control channel listens next to the rendezvous port
RETRY_S = 0.5  # a joining node's wait before it connects again, after a connection closed unanswered
# A joining node's wait between attempts while the coordinator does not listen yet: it listens from
# its first trial on, and the nodes of a job start together, so the joiner usually comes first.
CONNECT_RETRY_S = 0.2
REPLY_WAIT_S = 60.0  # for a joiner to hear the coordinator's challenge and welcome


# -- the coordinator's end --------------------------------------------------------------------------------


class ControlServer(Admission):
    """The coordinator's end: joiners connect and authenticate (Admission), get each trial, report its end."""

    def __init__(self, host: str, port: int, *, key: bytes, joiners: int, nproc_per_node: int,
                 join_wait_s: float = 600.0, job_peers: Iterable[str] = (), image: str | None = None) -> None:
        super().__init__(host, port, key=key, joiners=joiners, nproc_per_node=nproc_per_node,
                         join_wait_s=join_wait_s, job_peers=job_peers, image=image)
        self.results: dict[str, dict[str, Any]] = {}  # peer name -> its result of the current trial
        self.seq = 0

    def publish(self, msg: dict[str, Any]) -> None:
        """Send a trial to every joiner (admitting any still missing first).

        Raises:
            InputError: the trial does not fit in one message (exit 78).
            UnavailableError: not every node joined (exit 69).
        """
        self.admit()
        if self.peers and len(self.peers[0].encode(msg)) > MAX_LINE_BYTES:
            raise InputError(f"trial {msg.get('trial')}", f"over {MAX_LINE_BYTES} bytes as a message to the other "
                             "nodes (its topology file?)")
        self.seq = int(msg["trial"])
        self.results = {}
        for peer in self.peers:
            peer.send(msg)

    def _drain(self, timeout_s: float) -> None:
        for peer in self.peers:
            for doc in peer.read(timeout_s):
                if doc.get("result") == self.seq and type(doc.get("result")) is int:
                    self.results[peer.name] = check_result(doc, peer.name)

    def failure(self) -> str | None:
        self._drain(0.0)
        for peer in self.peers:
            got = self.results.get(peer.name)
            if got is not None and got.get("exit") != 0:
                tail = f": {got['err_tail']}" if got.get("err_tail") else ""
                return f"{peer.name}: torchrun exited with status {got.get('exit')}{tail}"
            if got is None and peer.closed:
                why = f" ({peer.failure})" if peer.failure else ""
                return f"{peer.name} closed the control connection{why}"
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
        for hs in self.pending:
            close_quietly(hs.sock)
        self.pending = []
        self.server.close()


# -- a joining node's end ----------------------------------------------------------------------------------


class Unanswered(UnavailableError):
    """The coordinator closed the connection before it answered: it had no slot for it (exit 69
    once the joining node's wait is over)."""


def handshake(host: str, port: int, wait_s: float, name: str, key: bytes, key_file: str, *,
              image: str | None = None) -> tuple[Peer, int, int]:
    """Connect to the coordinator's control channel at host:port and go through join_session,
    connecting again RETRY_S after a connection it closed unanswered, for up to `wait_s`.

    Raises:
        UnavailableError: as join_session, or no connection within `wait_s` (exit 69).
    """
    deadline = time.monotonic() + wait_s
    while True:
        sock = connect(host, port, max(0.0, deadline - time.monotonic()))
        try:
            return join_session(sock, name, key, key_file, image=image)
        except Unanswered:
            if time.monotonic() + RETRY_S > deadline:
                raise
            log.debug("%s closed the connection unanswered; connecting again", name)
            time.sleep(RETRY_S)


def join_session(sock: socket.socket, name: str, key: bytes, key_file: str, *,
                 image: str | None = None) -> tuple[Peer, int, int]:
    """The joiner's handshake on a connected socket: the peer, and the welcome's node count and
    ranks per node (not yet checked against this node: check_welcome). `image`: the digest of the
    image this node measures in (None: on the host), which the coordinator's must be.

    Raises:
        UnavailableError: the peer did not prove it holds the key, refused this node, or fell
            silent (exit 69); nothing has run.
    """
    hint = (f"every node of the job needs the same key ({key_file}); check that --join names the "
            "coordinator's --rdzv-endpoint")
    sock.settimeout(SEND_TIMEOUT_S)
    plain = Peer(sock, name)
    nonce = new_nonce()
    plain.send({"hello": socket.gethostname(), "version": version(), "nonce": nonce, "image": image})
    reply = plain.read(REPLY_WAIT_S)
    doc = reply[0] if reply else {}
    if not reply and plain.closed and plain.failure is None:
        raise Unanswered(f"{name} closed the connection before it answered: nothing was run", hint=hint)
    if isinstance(doc.get("refuse"), str):
        plain.close()
        raise UnavailableError(f"{name} refused this node: {escaped(doc['refuse'], MAX_TAIL_CHARS)}", hint=hint)
    challenge, proof = doc.get("challenge"), doc.get("proof")
    if not is_nonce(challenge) or not is_mac(proof) or not hmac.compare_digest(
            str(proof), mac(key, "coordinator", nonce, str(challenge))):
        plain.close()
        why = plain.failure or ("no answer" if not reply else "its answer does not prove it holds the multi-node key")
        raise UnavailableError(f"{name} is not an authenticated coordinator ({why}): nothing was run", hint=hint)
    peer = Peer(sock, name, session_key(key, str(challenge), nonce),
                outgoing="to-coordinator", incoming="to-joiner")
    peer.buf = plain.buf
    sock_send = plain.encode({"proof": mac(key, "joiner", str(challenge), nonce)})
    try:
        sock.sendall(sock_send)
    except OSError as exc:
        raise UnavailableError(f"{name} closed the connection in the handshake: {exc}") from exc
    welcome = peer.read(REPLY_WAIT_S)
    first = welcome[0] if welcome else {}
    if peer.refused or "refuse" in first:
        peer.close()
        raise UnavailableError(f"{name} refused this node: {peer.refused or escaped(first['refuse'], MAX_TAIL_CHARS)}",
                               hint=hint)
    if "welcome" not in first:
        peer.close()
        raise UnavailableError(f"{name} sent no welcome ({peer.failure or 'no answer'}): nothing was run", hint=hint)
    nnodes, nproc = first.get("welcome"), first.get("nproc_per_node")
    if type(nnodes) is not int or type(nproc) is not int:
        peer.close()
        raise UnavailableError(f"{name}: a welcome without integer node and rank counts: nothing was run")
    peer.pending = welcome[1:]  # the first trial may come in the same read as the welcome
    return peer, nnodes, nproc


def connect(host: str, port: int, wait_s: float) -> socket.socket:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=10)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise UnavailableError(f"cannot reach the coordinator at {host_port(host, port)}: {exc}",
                                       hint="start `nccltune sweep --nodes N --rdzv-endpoint HOST:PORT` there") from exc
            time.sleep(CONNECT_RETRY_S)


def version() -> str:
    from ... import __version__

    return __version__
