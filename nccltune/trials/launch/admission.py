"""The coordinator's admission of joining nodes: the listening socket, the accept loop, and the
coordinator's half of the handshake (channel.py describes it), up to every joiner holding a
sealed connection (`Peer`) with its welcome.

Admission cannot be starved by connections that never authenticate:
- each connection has HANDSHAKE_S from its accept to its proof (a joiner sends its hello at once
  and its proof one round trip after the challenge), and the accept loop serves every pending
  connection, checking what has arrived before it accepts more (at most ACCEPT_BATCH a turn);
- one peer (an IPv4 address, an IPv6 /64, which one host may hold whole) holds at most
  MAX_PENDING_PER_PEER of the MAX_PENDING handshakes: a new connection from a peer at its share
  takes the slot of that peer's own oldest handshake (one without a hello first), so a peer can
  crowd out no one but itself;
- the job's own peers come first: the addresses of the allocation's nodes when the sweep runs in
  a Slurm allocation (`job_addresses`), and of every node admitted before in this sweep. Their
  handshakes are never closed for another's. When every slot is held, a new connection takes the
  slot of a handshake from another address: of the peer holding most slots, one that has not said
  hello yet before one that has, the oldest first; a new connection that finds only the job's own
  peers' handshakes is closed;
- a joining node whose connection is closed before the coordinator answered (a slot it did not
  get) connects again (channel.handshake), until its own wait for the coordinator is over;
- what is turned away is logged a few times per kind and then counted, in one line when
  admission ends: a flood of connections cannot flood the log either.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import select
import socket
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import UnavailableError
from ...logsetup import escaped
from .base import host_port
from .sealing import SEND_TIMEOUT_S, Peer, is_mac, is_nonce, mac, new_nonce, session_key, strict_json

log = logging.getLogger(__name__)

MAX_HELLO_BYTES = 4096  # a handshake line
# Admission (see the module's description). A joining node needs one connection, and a second
# while its first is being closed; a few more leave room for nodes behind one address.
MAX_PENDING = 64  # handshakes at once
MAX_PENDING_PER_PEER = 4  # of them from one peer
ACCEPT_BATCH = 16  # new connections accepted per turn of the loop, after what has arrived is served
HANDSHAKE_S = 3.0  # from a connection's accept to its proof: two round trips on the job's network
MAX_LOGGED = 3  # connections turned away that are logged one by one, per kind, per admission


def peer_of(address: str) -> str:
    """The peer a connection from `address` counts against: the IPv4 address (an IPv4-mapped IPv6
    address as its IPv4 one), or an IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def job_addresses(hosts: Iterable[str]) -> frozenset[str]:
    """The addresses `hosts` (the job's nodes, by name or address) resolve to here, each as
    `peer_of` writes it; a name that does not resolve is left out."""
    out: set[str] = set()
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):
            log.debug("the job's node %s does not resolve here; not counted among the job's own peers", host)
            continue
        out.update(peer_of(str(info[4][0])) for info in infos)
    return frozenset(out)


@dataclass
class _Handshake:
    """A connection the coordinator has not admitted yet: `peer` (peer_of its address), `ours`
    (one of the job's own peers), `since` (its accept)."""

    sock: socket.socket
    addr: str
    deadline: float
    peer: str = ""
    ours: bool = False
    since: float = 0.0
    buf: bytes = b""
    host: str = ""
    version: str = ""
    image: str | None = None  # the digest of the image the joiner measures in; None: its host
    joiner_nonce: str = ""
    nonce: str = ""  # ours, once the hello came


class Admission:
    """The coordinator's listening end: joiners connect and authenticate (`admit`); `peers` holds
    every node admitted."""

    def __init__(self, host: str, port: int, *, key: bytes, joiners: int, nproc_per_node: int,
                 join_wait_s: float = 600.0, job_peers: Iterable[str] = (), image: str | None = None) -> None:
        """`job_peers`: the job's own peers, as peer_of writes them (job_addresses), admitted first;
        every node admitted joins them. `image`: the digest of the image this job measures in (None:
        on the hosts); a joiner measuring anywhere else is refused."""
        self.key = key
        self.want = joiners
        self.image = image
        self.nproc_per_node = nproc_per_node
        self.join_wait_s = join_wait_s
        self.job_peers = set(job_peers)
        self.turned_away: Counter[str] = Counter()  # why connections were closed unadmitted, this admission
        try:
            # Exactly the address given: the channel is for the job's nodes, reached as they reach it.
            self.server = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise UnavailableError(f"cannot listen on {host_port(host, port)} for joining nodes: {exc.strerror}",
                                   hint="pick another --rdzv-endpoint port (PORT and PORT+1 must be free)") from exc
        self.server.setblocking(False)
        self.pending: list[_Handshake] = []
        self.peers: list[Peer] = []

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.getsockname()[:2]
        return str(host), int(port)

    def admit(self) -> None:
        """Admit joiners until every node of the job is here, serving every connection at once.

        Raises:
            UnavailableError: not every node joined within join_wait_s (exit 69).
        """
        self.peers = [p for p in self.peers if not p.closed]
        self.turned_away.clear()
        try:
            self._admit()
        finally:
            if self.turned_away:
                said = ", ".join(f"{n} {why}" for why, n in self.turned_away.most_common())
                log.warning("closed %d connection(s) to the control channel that did not complete a handshake: %s",
                            sum(self.turned_away.values()), said)

    def _admit(self) -> None:
        deadline = time.monotonic() + self.join_wait_s
        while len(self.peers) < self.want:
            now = time.monotonic()
            if now >= deadline:
                for hs in self.pending:
                    close_quietly(hs.sock)
                self.pending = []
                raise UnavailableError(
                    f"{len(self.peers)} of {self.want} other node(s) joined within {self.join_wait_s:g} s",
                    hint="run `nccltune sweep --join HOST:PORT` on each other node (the coordinator's "
                         "--rdzv-endpoint), with the same multi-node key")
            wait = min([deadline, *(hs.deadline for hs in self.pending)]) - now
            try:
                ready, _, _ = select.select([self.server, *(hs.sock for hs in self.pending)], [], [],
                                            max(0.0, min(wait, 1.0)))
            except (OSError, ValueError):
                ready = []
            # What has arrived first (a proof waiting is checked before new connections can take
            # its slot), then new connections.
            for hs in list(self.pending):
                if hs.sock in ready and hs in self.pending:
                    self._serve(hs)
            if self.server in ready:
                self._accept()
            now = time.monotonic()
            for hs in list(self.pending):
                if hs in self.pending and now > hs.deadline:
                    self._turn_away(hs.addr, f"no handshake within {HANDSHAKE_S:g} s")
                    self._drop(hs)

    def _turn_away(self, addr: str, why: str, level: int = logging.WARNING) -> None:
        """Say why a connection is closed unadmitted: logged the first MAX_LOGGED times per reason
        in an admission, counted always."""
        self.turned_away[why] += 1
        if self.turned_away[why] <= MAX_LOGGED:
            log.log(level, "%s: %s; closed", addr, why)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accepting a joining node: %s", exc)
                return
            name = host_port(str(addr[0]), int(addr[1]))
            peer = peer_of(str(addr[0]))
            same = [hs for hs in self.pending if hs.peer == peer]
            if len(same) >= MAX_PENDING_PER_PEER:
                own = max(same, key=lambda hs: (not hs.nonce, -hs.since))
                self._turn_away(own.addr, f"its peer's share ({MAX_PENDING_PER_PEER}) went to a newer connection")
                self._drop(own)
            elif len(self.pending) >= MAX_PENDING:
                victim = self._victim()
                if victim is None:
                    self._turn_away(name, f"{MAX_PENDING} handshakes of the job's own nodes are under way")
                    close_quietly(sock)
                    continue
                self._turn_away(victim.addr, "its slot went to a newer connection")
                self._drop(victim)
            sock.setblocking(False)
            now = time.monotonic()
            self.pending.append(_Handshake(sock, name, now + HANDSHAKE_S, peer=peer, ours=peer in self.job_peers,
                                           since=now))

    def _victim(self) -> _Handshake | None:
        """The handshake whose slot a new connection takes: never one of the job's own peers; of
        the peer holding most slots, one without a hello before one with, the oldest first."""
        held = Counter(hs.peer for hs in self.pending)
        others = [hs for hs in self.pending if not hs.ours]
        return max(others, key=lambda hs: (held[hs.peer], not hs.nonce, -hs.since), default=None)

    def _drop(self, hs: _Handshake) -> None:
        self.pending.remove(hs)
        close_quietly(hs.sock)

    def _serve(self, hs: _Handshake) -> None:
        try:
            data = hs.sock.recv(MAX_HELLO_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(hs)
            return
        hs.buf += data
        if b"\n" not in hs.buf:
            if len(hs.buf) > MAX_HELLO_BYTES:
                self._turn_away(hs.addr, f"a handshake line over {MAX_HELLO_BYTES} bytes")
                self._drop(hs)
            return
        line, hs.buf = hs.buf.split(b"\n", 1)
        try:
            doc = strict_json(line)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            self._turn_away(hs.addr, "not a handshake message")
            self._drop(hs)
        elif not hs.nonce:
            self._hello(hs, doc)
        else:
            self._proof(hs, doc)

    def _hello(self, hs: _Handshake, doc: Mapping[str, Any]) -> None:
        host, version, nonce, image = doc.get("hello"), doc.get("version"), doc.get("nonce"), doc.get("image")
        if not (isinstance(host, str) and 0 < len(host) <= 255 and isinstance(version, str) and len(version) <= 64
                and is_nonce(nonce) and (image is None or (isinstance(image, str) and len(image) <= 128))):
            self._turn_away(hs.addr, "not a joining node's hello")
            self._drop(hs)
            return
        hs.host, hs.version, hs.joiner_nonce, hs.nonce = host, version, str(nonce), new_nonce()
        hs.image = image
        proof = mac(self.key, "coordinator", hs.joiner_nonce, hs.nonce)
        if not send_small(hs.sock, {"challenge": hs.nonce, "proof": proof}):
            self._drop(hs)

    def _proof(self, hs: _Handshake, doc: Mapping[str, Any]) -> None:
        proof = doc.get("proof")
        if not is_mac(proof) or not hmac.compare_digest(str(proof), mac(self.key, "joiner", hs.nonce,
                                                                            hs.joiner_nonce)):
            self._turn_away(f"{hs.addr} (calling itself {escaped(hs.host, 64)})",
                            "refused, it does not hold the multi-node key", logging.ERROR)
            send_small(hs.sock, {"refuse": "authentication failed: this node does not hold the coordinator's "
                                            "multi-node key"})
            self._drop(hs)
            return
        self.pending.remove(hs)
        hs.sock.setblocking(True)
        hs.sock.settimeout(SEND_TIMEOUT_S)
        peer = Peer(hs.sock, f"node {escaped(hs.host, 64)} ({hs.addr})",
                    session_key(self.key, hs.nonce, hs.joiner_nonce), outgoing="to-joiner", incoming="to-coordinator")
        if hs.buf:
            peer.fail("a message before its welcome")
            return
        self.job_peers.add(hs.peer)  # a node that proved it holds the key: one of the job's own
        from ... import __version__

        if hs.version != __version__:
            # The worker's arguments and records must mean the same on both ends.
            peer.send({"refuse": f"the coordinator runs nccltune {__version__}, this node {hs.version[:64]}"})
            peer.close()
            return
        if hs.image != self.image:
            # One job, one NCCL: a node measuring in another image (or on its host) would mix two.
            peer.send({"refuse": f"the coordinator measures {_where(self.image)}, this node {_where(hs.image)}; "
                                 "give every node the same bench.image"})
            peer.close()
            return
        peer.send({"welcome": self.want + 1, "nproc_per_node": self.nproc_per_node})
        log.info("%s joined", peer.name)
        self.peers.append(peer)


def close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def send_small(sock: socket.socket, doc: Mapping[str, Any]) -> bool:
    """A handshake message on a non-blocking socket: a few hundred bytes, sent whole or not at all."""
    line = json.dumps(doc, sort_keys=True).encode() + b"\n"
    try:
        return sock.send(line) == len(line)
    except OSError:
        return False


def _where(image: str | None) -> str:
    return f"in the image {image}" if image else "on its host (no bench.image)"
