"""The control channel between a torchrun sweep's coordinator and its joining nodes.

JSON lines over one TCP connection per joining node, the coordinator listening at HOST:PORT+1 on
the address it was given. Nothing before the handshake below is believed, and nothing after it
that does not carry a valid MAC.

Keys. Every node of the job holds the same secret key (KEY_FILE by default, `multinode.key_file`
in the config): 32 random bytes as 64 hex digits, created by `nccltune keygen` and copied to the
job's nodes by the site as it copies Slurm's munge key. It passes the trust rule (trust.check_file:
no symlink, owned by root or the user running nccltune, nothing on its way writable by others) and
no one else may read it (mode 0600 or stricter); otherwise nothing starts (exit 78, naming it).

Handshake (challenge-response, fresh nonces from both sides for every connection):
  joiner -> {"hello": host, "version": V, "nonce": Nj}
  coordinator -> {"challenge": Nc, "proof": MAC(K, "coordinator", Nj, Nc)}
  joiner checks the proof (a peer without the key cannot make it: the joiner stops and runs nothing)
  joiner -> {"proof": MAC(K, "joiner", Nc, Nj)}
  coordinator checks it; a joiner without the key gets {"refuse": why} and is closed.
MAC is HMAC-SHA256. Each side then holds the session key S = MAC(K, "session", Nc, Nj), and every
further message in either direction is {"seq": n, "body": JSON text, "mac": MAC(S, direction, n,
body)}: n counts from 0 in each direction and must be the next one, so a message replayed from
this or another connection, reordered, reflected or altered closes the connection.

After the handshake (bodies):
  coordinator -> {"welcome": N, "nproc_per_node": P}, or {"refuse": why} (another nccltune version);
  per trial coordinator -> {"trial": seq, "rdzv_id", "env", "files", "worker_args", "timeout_s",
  "nccl_debug"}, joiner -> {"result": seq, "exit": code, "wall_s", "rank0_out", "err_tail"}, plus,
  where rank 0 ran on the joiner and nccl_debug was asked, "nccl_log" (rank 0's NCCL log, zlib and
  base64: trials.nccllog.pack) or "nccl_log_missing" (why not); coordinator -> {"kill": seq} when
  the trial ends badly there, {"stop": true} at the end.

What a joiner accepts (check_welcome, check_trial), however authentic the message: ranks per node
up to this node's GPUs (or the demo's ranks); the candidate under publishing's own rules
(publish.validate_env: names and the safe value alphabet) and none of REFUSED_VARIABLES (what NCCL
reads as a path or library, and NCCL's log settings, which the joiner sets itself when nccl_debug
asks); the topology file only as text it writes itself (SHIPPED_FILES); worker arguments the runner
makes, with sizes, iterations and timeouts within the config's bounds; no NaN, infinity or
non-integer where an integer belongs. A refused trial is reported as exit 78 with the reason.

Bounds: a line is at most MAX_LINE_BYTES (a longer one closes the connection); a joiner's report
fits in one line (rank 0's output and NCCL log are cut to fit). Text a peer sends is escaped
(logsetup.escaped) before it reaches a log or a message.

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
  get) connects again (`handshake`), until its own wait for the coordinator is over;
- what is turned away is logged a few times per kind and then counted, in one line when
  admission ends: a flood of connections cannot flood the log either.

A joiner runs nothing but its own worker.py, with argument lists, never a shell. torch's c10d
store on HOST:PORT has no authentication of its own: it carries only the rendezvous, and both
ports should still be reachable from the job's nodes only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import select
import socket
import stat
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...collectives import NAMES as COLLECTIVE_NAMES
from ...config import MAX_MESSAGE_BYTES as MAX_SIZE_BYTES
from ...config import MultinodeConfig
from ...errors import InputError, UnavailableError
from ...files import trust
from ...files.inputfile import loads_strict
from ...logsetup import escaped
from ...publish import PATH_VARIABLES, TOPO_FILE_VAR, validate_env
from .. import nccllog
from . import host_port

log = logging.getLogger(__name__)

KEY_FILE = MultinodeConfig().key_file
KEY_BYTES = 32
CONTROL_PORT_OFFSET = 1  # the control channel listens next to the rendezvous port
MAX_LINE_BYTES = 1 << 20
MAX_HELLO_BYTES = 4096  # a handshake line
# Admission (see the module's description). A joining node needs one connection, and a second
# while its first is being closed; a few more leave room for nodes behind one address.
MAX_PENDING = 64  # handshakes at once
MAX_PENDING_PER_PEER = 4  # of them from one peer
ACCEPT_BATCH = 16  # new connections accepted per turn of the loop, after what has arrived is served
HANDSHAKE_S = 3.0  # from a connection's accept to its proof: two round trips on the job's network
MAX_LOGGED = 3  # connections turned away that are logged one by one, per kind, per admission
RETRY_S = 0.5  # a joining node's wait before it connects again, after a connection closed unanswered
REPLY_WAIT_S = 60.0  # for a joiner to hear the coordinator's challenge and welcome
SEND_TIMEOUT_S = 30.0  # a peer that stops reading cannot hold the other end longer
NONCE_BYTES = 16
# Variables naming a file whose text goes to the other nodes, and the name it gets there: the
# run's topology file (the candidate names it by the marker publish.OWN_TOPOLOGY), which a joining
# node writes itself and resolves the variable to.
SHIPPED_FILES = {TOPO_FILE_VAR: "ncclTopology.xml"}
# What never comes over the channel: every variable NCCL reads as a path or a library name
# (publishing's own list) but the shipped topology, which the joiner writes itself, and NCCL's log
# settings, which the joiner sets itself when the coordinator reads NCCL's log (nccl_debug).
DEBUG_VARIABLES = frozenset(nccllog.debug_env(Path("/")))
REFUSED_VARIABLES = (PATH_VARIABLES - set(SHIPPED_FILES)) | DEBUG_VARIABLES
# What one trial may ask of a joining node. Sizes are the config's own bound; the config leaves
# iterations and timeouts open above, so these bounds only keep a message from asking for days.
MAX_NODES = 4096
MAX_SIZES = 256
MAX_ITERS = 1_000_000
MAX_BLOCKS = 1000
MAX_TIMEOUT_S = 24 * 3600.0
MAX_TRIAL_SEQ = 10_000_000
MAX_FILE_CHARS = 256 << 10  # a topology file's text (a few dozen KiB on real nodes), escapes fit the line
MAX_RANK0_OUT_CHARS = 256 << 10
MAX_NCCL_LOG_CHARS = 384 << 10
MAX_TAIL_CHARS = 300
_RDZV_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_INT = re.compile(r"[0-9]{1,12}")
_HEX = re.compile(r"[0-9a-f]+")
_WORKER_CHOICES = {"--backend": ("nccl", "gloo"), "--timing": ("auto", "graph", "direct", "events")}
_WORKER_INTS = {"--warmup": (0, MAX_ITERS), "--iters": (1, MAX_ITERS), "--max-blocks": (1, MAX_BLOCKS)}
_WORKER_FLAGS = ("--no-check", "--no-prequeue")


# -- the key ------------------------------------------------------------------------------------------

KEY_HINT = "create it with `nccltune keygen` on one node and copy it (mode 0600, owner root) to every node of the job"


def load_key(path: str | Path) -> bytes:
    """The multi-node key in `path`, checked as the module says.

    Raises:
        InputError: missing, unreadable, not trusted, readable by others or not a key (exit 78).
    """
    what = "multi-node key file (multinode.key_file)"
    try:
        trust.check_file(path, what)
        fd = trust.open_file(path, os.O_RDONLY, what)
    except FileNotFoundError as exc:
        raise InputError(str(path), f"no {what}: sweeps over several nodes authenticate with it",
                         hint=KEY_HINT) from exc
    except OSError as exc:
        raise InputError(str(path), f"cannot read the {what}: {exc.strerror}", hint=KEY_HINT) from exc
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o077:
            raise InputError(str(path), f"refusing the {what}: other users may read it (mode {mode:04o})",
                             hint=f"chmod 600 {path}")
        text = os.read(fd, 4 * KEY_BYTES + 2).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if len(text) != 2 * KEY_BYTES or not _HEX.fullmatch(text):
        raise InputError(str(path), f"not a {what}: expected one line of {2 * KEY_BYTES} lower-case hex digits",
                         hint=KEY_HINT)
    return bytes.fromhex(text)


def write_key(path: str | Path) -> Path:
    """Create a new key at `path` (mode 0600), never over an existing file; its directory is
    created where missing and must pass the trust rule.

    Raises:
        InputError: the file exists, or its directory is not trusted (exit 78).
        OSError: it cannot be written (the caller words it).
    """
    path = Path(path)
    trust.ensure_dir(path.parent, "key file's directory")
    try:
        fd = trust.open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "multi-node key file", 0o600)
    except FileExistsError as exc:
        raise InputError(str(path), "a key file is there already; nccltune never replaces one",
                         hint="every node of a job needs the same key: copy this one, or remove it first") from exc
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but make the mode exact
        os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def _session_key(key: bytes, coordinator_nonce: str, joiner_nonce: str) -> bytes:
    return bytes.fromhex(_mac(key, "session", coordinator_nonce, joiner_nonce))


def _nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _is_nonce(value: object) -> bool:
    return isinstance(value, str) and len(value) == 2 * NONCE_BYTES and _HEX.fullmatch(value) is not None


def _is_mac(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and _HEX.fullmatch(value) is not None


def strict_json(data: bytes | str) -> Any:
    """A peer's message read as every input is (files.inputfile.loads_strict: no NaN or Infinity,
    no key twice, bounded depth, no lone surrogate), from UTF-8 bytes or text.

    Raises:
        ValueError: not UTF-8, not JSON, or refused by loads_strict.
    """
    try:
        return loads_strict(data)
    except ValueError as exc:
        # A peer's report names a non-finite number as such, as the channel always has.
        constant = str(exc).removesuffix(" is not JSON")
        if constant in ("NaN", "Infinity", "-Infinity"):
            raise ValueError(f"{constant} is not a number") from None
        raise


# -- one connection --------------------------------------------------------------------------------------


class Peer:
    """One JSON-lines connection; reads never block longer than asked. Once `session` holds a
    key, every message is sealed and checked as the module says (`outgoing`/`incoming`: the
    direction labels this end sends and expects)."""

    def __init__(self, sock: socket.socket, name: str, session: bytes | None = None, *,
                 outgoing: str = "", incoming: str = "") -> None:
        self.sock = sock
        self.name = name
        self.session = session
        self.outgoing, self.incoming = outgoing, incoming
        self.sent = self.received = 0
        self.buf = b""
        self.closed = False
        self.failure: str | None = None  # why this end closed it, when it did
        self.refused: str | None = None  # the other end's refusal, sent before a session existed
        self.pending: list[dict[str, Any]] = []  # messages read with the welcome, not yet handled

    def encode(self, doc: Mapping[str, Any]) -> bytes:
        body = json.dumps(doc, sort_keys=True, allow_nan=False)
        if self.session is None:
            return body.encode() + b"\n"
        mac = _mac(self.session, self.outgoing, str(self.sent), body)
        return json.dumps({"seq": self.sent, "body": body, "mac": mac}).encode() + b"\n"

    def send(self, doc: Mapping[str, Any]) -> bool:
        """Send one message; False when the connection is gone or the message is over MAX_LINE_BYTES."""
        line = self.encode(doc)
        if len(line) > MAX_LINE_BYTES:
            log.error("%s: not sending a message of %d bytes (at most %d)", self.name, len(line), MAX_LINE_BYTES)
            return False
        if self.closed:
            return False
        try:
            self.sock.sendall(line)
        except OSError:
            self.closed = True
            return False
        if self.session is not None:
            self.sent += 1
        return True

    def fail(self, why: str) -> None:
        if not self.closed:
            log.error("%s: %s; closing the connection", self.name, why)
        self.failure = self.failure or why
        self.close()

    def read(self, timeout_s: float) -> list[dict[str, Any]]:
        """Whatever whole messages arrive within `timeout_s` (none when the peer is closed)."""
        msgs: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        polled = False
        while not self.closed:
            msgs.extend(self._split())
            left = deadline - time.monotonic()
            if msgs or self.closed or (left <= 0 and polled):
                break
            polled = True  # a zero timeout still looks once at what has arrived
            try:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, left))
            except (OSError, ValueError):
                ready = [self.sock]
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
            if len(self.buf) > MAX_LINE_BYTES and b"\n" not in self.buf[:MAX_LINE_BYTES + 1]:
                self.fail(f"a message over {MAX_LINE_BYTES} bytes")
        return msgs

    def _split(self) -> list[dict[str, Any]]:
        msgs = []
        while b"\n" in self.buf and not self.closed:
            line, self.buf = self.buf.split(b"\n", 1)
            if len(line) > MAX_LINE_BYTES:
                self.fail(f"a message over {MAX_LINE_BYTES} bytes")
                break
            try:
                doc = strict_json(line)
            except ValueError as exc:
                self.fail(f"not a JSON message ({exc}): {line[:80]!r}")
                break
            if not isinstance(doc, dict):
                self.fail(f"not a JSON object: {line[:80]!r}")
                break
            if self.session is None:
                msgs.append(doc)
                continue
            if set(doc) == {"refuse"} and isinstance(doc["refuse"], str) and self.received == 0:
                # Refused in the handshake: the other end has no session to seal it with.
                self.refused = escaped(doc["refuse"], MAX_TAIL_CHARS)
                self.close()
                break
            body = self._open(doc)
            if body is None:
                break
            msgs.append(body)
        return msgs

    def _open(self, doc: Mapping[str, Any]) -> dict[str, Any] | None:
        """The body of a sealed message, or None (and the connection closed) when it is not the
        next message from the other end, unaltered."""
        assert self.session is not None
        seq, body, mac = doc.get("seq"), doc.get("body"), doc.get("mac")
        if not isinstance(body, str) or not _is_mac(mac) or type(seq) is not int:
            self.fail("an unsealed message after the handshake")
            return None
        expected = _mac(self.session, self.incoming, str(seq), body)
        if not hmac.compare_digest(expected, str(mac)):
            self.fail("a message whose MAC does not match (altered, or not from this session)")
            return None
        if seq != self.received:
            self.fail(f"message {seq} where {self.received} was due (replayed or reordered)")
            return None
        self.received += 1
        try:
            out = strict_json(body)
        except ValueError as exc:
            self.fail(f"a sealed message that is not JSON ({exc})")
            return None
        if not isinstance(out, dict):
            self.fail("a sealed message that is not a JSON object")
            return None
        return out

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


# -- the coordinator's end --------------------------------------------------------------------------------


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
    joiner_nonce: str = ""
    nonce: str = ""  # ours, once the hello came


class ControlServer:
    """The coordinator's end: joiners connect and authenticate, get each trial, report its end."""

    def __init__(self, host: str, port: int, *, key: bytes, joiners: int, nproc_per_node: int,
                 join_wait_s: float = 600.0, job_peers: Iterable[str] = ()) -> None:
        """`job_peers`: the job's own peers, as peer_of writes them (job_addresses), admitted first;
        every node admitted joins them."""
        self.key = key
        self.want = joiners
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
        self.results: dict[str, dict[str, Any]] = {}  # peer name -> its result of the current trial
        self.seq = 0

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
                    _close(hs.sock)
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
                    _close(sock)
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
        _close(hs.sock)

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
        host, version, nonce = doc.get("hello"), doc.get("version"), doc.get("nonce")
        if not (isinstance(host, str) and 0 < len(host) <= 255 and isinstance(version, str) and len(version) <= 64
                and _is_nonce(nonce)):
            self._turn_away(hs.addr, "not a joining node's hello")
            self._drop(hs)
            return
        hs.host, hs.version, hs.joiner_nonce, hs.nonce = host, version, str(nonce), _nonce()
        proof = _mac(self.key, "coordinator", hs.joiner_nonce, hs.nonce)
        if not _send_small(hs.sock, {"challenge": hs.nonce, "proof": proof}):
            self._drop(hs)

    def _proof(self, hs: _Handshake, doc: Mapping[str, Any]) -> None:
        proof = doc.get("proof")
        if not _is_mac(proof) or not hmac.compare_digest(str(proof), _mac(self.key, "joiner", hs.nonce,
                                                                            hs.joiner_nonce)):
            self._turn_away(f"{hs.addr} (calling itself {escaped(hs.host, 64)})",
                            "refused, it does not hold the multi-node key", logging.ERROR)
            _send_small(hs.sock, {"refuse": "authentication failed: this node does not hold the coordinator's "
                                            "multi-node key"})
            self._drop(hs)
            return
        self.pending.remove(hs)
        hs.sock.setblocking(True)
        hs.sock.settimeout(SEND_TIMEOUT_S)
        peer = Peer(hs.sock, f"node {escaped(hs.host, 64)} ({hs.addr})",
                    _session_key(self.key, hs.nonce, hs.joiner_nonce), outgoing="to-joiner", incoming="to-coordinator")
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
        peer.send({"welcome": self.want + 1, "nproc_per_node": self.nproc_per_node})
        log.info("%s joined", peer.name)
        self.peers.append(peer)

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
            _close(hs.sock)
        self.pending = []
        self.server.close()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _send_small(sock: socket.socket, doc: Mapping[str, Any]) -> bool:
    """A handshake message on a non-blocking socket: a few hundred bytes, sent whole or not at all."""
    line = json.dumps(doc, sort_keys=True).encode() + b"\n"
    try:
        return sock.send(line) == len(line)
    except OSError:
        return False


def check_result(doc: Mapping[str, Any], who: str) -> dict[str, Any]:
    """A joiner's report as the coordinator uses it; a malformed one becomes a failed trial."""
    text_fields = {"rank0_out": MAX_RANK0_OUT_CHARS, "err_tail": MAX_TAIL_CHARS, "nccl_log": MAX_NCCL_LOG_CHARS,
                   "nccl_log_missing": MAX_TAIL_CHARS}
    code = doc.get("exit")
    bad = None if type(code) is int else "no integer exit status"
    for name, limit in text_fields.items():
        value = doc.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > limit):
            bad = bad or f"{name} is not a text of at most {limit} characters"
    if bad:
        log.error("%s: a malformed report: %s", who, bad)
        return {"result": doc.get("result"), "exit": 1, "err_tail": f"a malformed report: {bad}"}
    return {k: doc[k] for k in ("result", "exit", "wall_s", *text_fields) if k in doc}


# -- a joining node's end ----------------------------------------------------------------------------------


class Unanswered(UnavailableError):
    """The coordinator closed the connection before it answered: it had no slot for it (exit 69
    once the joining node's wait is over)."""


def handshake(host: str, port: int, wait_s: float, name: str, key: bytes, key_file: str) -> tuple[Peer, int, int]:
    """Connect to the coordinator's control channel at host:port and go through join_session,
    connecting again RETRY_S after a connection it closed unanswered, for up to `wait_s`.

    Raises:
        UnavailableError: as join_session, or no connection within `wait_s` (exit 69).
    """
    deadline = time.monotonic() + wait_s
    while True:
        sock = connect(host, port, max(0.0, deadline - time.monotonic()))
        try:
            return join_session(sock, name, key, key_file)
        except Unanswered:
            if time.monotonic() + RETRY_S > deadline:
                raise
            log.debug("%s closed the connection unanswered; connecting again", name)
            time.sleep(RETRY_S)


def join_session(sock: socket.socket, name: str, key: bytes, key_file: str) -> tuple[Peer, int, int]:
    """The joiner's handshake on a connected socket: the peer, and the welcome's node count and
    ranks per node (not yet checked against this node: check_welcome).

    Raises:
        UnavailableError: the peer did not prove it holds the key, refused this node, or fell
            silent (exit 69); nothing has run.
    """
    hint = (f"every node of the job needs the same key ({key_file}); check that --join names the "
            "coordinator's --rdzv-endpoint")
    sock.settimeout(SEND_TIMEOUT_S)
    plain = Peer(sock, name)
    nonce = _nonce()
    plain.send({"hello": socket.gethostname(), "version": version(), "nonce": nonce})
    reply = plain.read(REPLY_WAIT_S)
    doc = reply[0] if reply else {}
    if not reply and plain.closed and plain.failure is None:
        raise Unanswered(f"{name} closed the connection before it answered: nothing was run", hint=hint)
    if isinstance(doc.get("refuse"), str):
        plain.close()
        raise UnavailableError(f"{name} refused this node: {escaped(doc['refuse'], MAX_TAIL_CHARS)}", hint=hint)
    challenge, proof = doc.get("challenge"), doc.get("proof")
    if not _is_nonce(challenge) or not _is_mac(proof) or not hmac.compare_digest(
            str(proof), _mac(key, "coordinator", nonce, str(challenge))):
        plain.close()
        why = plain.failure or ("no answer" if not reply else "its answer does not prove it holds the multi-node key")
        raise UnavailableError(f"{name} is not an authenticated coordinator ({why}): nothing was run", hint=hint)
    peer = Peer(sock, name, _session_key(key, str(challenge), nonce),
                outgoing="to-coordinator", incoming="to-joiner")
    peer.buf = plain.buf
    sock_send = plain.encode({"proof": _mac(key, "joiner", str(challenge), nonce)})
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


def check_welcome(nnodes: int, nproc_per_node: int, max_ranks: int, who: str) -> None:
    """Raises UnavailableError (exit 69) for a job this node cannot be part of."""
    if not 2 <= nnodes <= MAX_NODES:
        raise UnavailableError(f"{who} asks for {nnodes} nodes: between 2 and {MAX_NODES}")
    if not 1 <= nproc_per_node <= max_ranks:
        raise UnavailableError(f"{who} asks for {nproc_per_node} ranks per node; this node runs 1 to {max_ranks} "
                               "(its GPUs, or the demo's ranks)")


@dataclass(frozen=True)
class TrialOrder:
    """One trial as a joining node runs it, every field checked (check_trial)."""

    seq: int
    rdzv_id: str
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    worker_args: list[str] = field(default_factory=list)
    timeout_s: float = 180.0
    nccl_debug: bool = False


def trial_seq(msg: Mapping[str, Any]) -> int | None:
    """The trial number of a trial message, or None when it has none that can be one."""
    seq = msg.get("trial")
    return seq if type(seq) is int and 1 <= seq <= MAX_TRIAL_SEQ else None


def check_trial(msg: Mapping[str, Any]) -> TrialOrder:
    """A trial message as the module's rules allow it.

    Raises:
        InputError: the first field that breaks them, named (exit 78).
    """
    seq = trial_seq(msg)
    source = f"trial {seq if seq is not None else '?'} from the coordinator"
    if seq is None:
        raise InputError(source, f"trial: {msg.get('trial')!r:.40} is not a trial number (1 to {MAX_TRIAL_SEQ})")
    rdzv_id = msg.get("rdzv_id")
    if not isinstance(rdzv_id, str) or not _RDZV_ID.fullmatch(rdzv_id):
        raise InputError(source, "rdzv_id: not a rendezvous id (letters, digits, _ . -, at most 128)")
    env = msg.get("env", {})
    if not isinstance(env, dict):
        raise InputError(source, "env: not a mapping of variables")
    env = validate_env(env, source=source)
    refused = sorted(set(env) & REFUSED_VARIABLES)
    if refused:
        raise InputError(source, f"{refused[0]}: a joining node takes no variable that names a file or library, "
                         "nor NCCL's log settings, from the coordinator")
    files = msg.get("files", {})
    if not isinstance(files, dict):
        raise InputError(source, "files: not a mapping")
    for name, text in files.items():
        if name not in SHIPPED_FILES or name not in env:
            raise InputError(source, f"files: {str(name)[:40]!r} is not a file the candidate ships")
        if not isinstance(text, str) or len(text) > MAX_FILE_CHARS:
            raise InputError(source, f"files: {name} is not a text of at most {MAX_FILE_CHARS} characters")
    for name in SHIPPED_FILES:
        if name in env and name not in files:
            raise InputError(source, f"{name}: names a file on the coordinator whose text did not come with it")
    args = msg.get("worker_args", [])
    timeout = msg.get("timeout_s", 180.0)
    if type(timeout) not in (int, float) or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise InputError(source, f"timeout_s: {timeout!r:.40} is not a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    nccl_debug = msg.get("nccl_debug", False)
    if type(nccl_debug) is not bool:
        raise InputError(source, "nccl_debug: not true or false")
    return TrialOrder(seq, rdzv_id, env, dict(files), check_worker_args(args, source), float(timeout), nccl_debug)


def check_worker_args(args: object, source: str) -> list[str]:
    """The worker's arguments as the runner makes them (trials.runner), every value in bounds.

    Raises:
        InputError: an argument the runner never makes, or a value out of bounds (exit 78).
    """
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args) or len(args) > 64:
        raise InputError(source, "worker_args: not a list of at most 64 texts")
    out = list(args)
    it = iter(enumerate(out))
    for _, flag in it:
        if flag in _WORKER_FLAGS:
            continue
        value = next(it, (0, None))[1]
        if value is None:
            raise InputError(source, f"worker_args: {flag[:40]!r} without its value")
        if flag in _WORKER_CHOICES:
            ok = value in _WORKER_CHOICES[flag]
        elif flag in _WORKER_INTS:
            low, high = _WORKER_INTS[flag]
            ok = _INT.fullmatch(value) is not None and low <= int(value) <= high
        elif flag == "--sizes":
            sizes = value.split(",")
            ok = 0 < len(sizes) <= MAX_SIZES and all(_INT.fullmatch(s) and 1 <= int(s) <= MAX_SIZE_BYTES
                                                     for s in sizes)
        elif flag == "--collectives":
            ok = all(c in COLLECTIVE_NAMES for c in value.split(","))
        elif flag == "--timeout-s":
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            ok = math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S
        else:
            raise InputError(source, f"worker_args: {flag[:40]!r} is not an argument of the worker")
        if not ok:
            raise InputError(source, f"worker_args: {flag} {value[:40]!r} is out of bounds")
    return out


def fit_report(report: dict[str, Any]) -> dict[str, Any]:
    """A joiner's report cut to one line: rank 0's output and NCCL log within their bounds, and
    the log left out (said why) if the whole would still be too long."""
    out = dict(report)
    if isinstance(out.get("rank0_out"), str):
        out["rank0_out"] = out["rank0_out"][:MAX_RANK0_OUT_CHARS]
    if isinstance(out.get("err_tail"), str):
        out["err_tail"] = out["err_tail"][:MAX_TAIL_CHARS]
    log_text = out.get("nccl_log")
    if isinstance(log_text, str) and len(log_text) > MAX_NCCL_LOG_CHARS:
        out.pop("nccl_log")
        out["nccl_log_missing"] = f"rank 0's NCCL log is over {MAX_NCCL_LOG_CHARS} characters packed; it stays there"
    # JSON escapes (and the sealed envelope's own) can make a text several times longer.
    while len(json.dumps(json.dumps(out))) > MAX_LINE_BYTES - 512:
        if "nccl_log" in out:
            out.pop("nccl_log")
            out["nccl_log_missing"] = "rank 0's NCCL log does not fit in one message; it stays there"
        elif out.get("rank0_out"):
            out["rank0_out"] = out["rank0_out"][: len(out["rank0_out"]) // 2]
        else:
            break
    return out


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

