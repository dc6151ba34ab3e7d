"""The multi-node key and what it seals: the key file, the MACs and nonces of the handshake, and
one connection of the control channel (`Peer`), every message of which after the handshake is
sealed with an HMAC and a sequence number and read as strictly as a file.

Every node of the job holds the same secret key (KEY_FILE by default, `multinode.key_file`
in the config): 32 random bytes as 64 hex digits, created by `nccltune keygen` and copied to the
job's nodes by the site as it copies Slurm's munge key. It passes the trust rule (trust.check_file:
no symlink, owned by root or the user running nccltune, nothing on its way writable by others) and
no one else may read it (mode 0600 or stricter); otherwise nothing starts (exit 78, naming it).

MAC is HMAC-SHA256 (`mac`). After the handshake (channel.py) each side holds the session key
S = MAC(K, "session", Nc, Nj) (`session_key`), and every further message in either direction is
{"seq": n, "body": JSON text, "mac": MAC(S, direction, n, body)}: n counts from 0 in each direction
and must be the next one, so a message replayed from this or another connection, reordered,
reflected or altered closes the connection. A line is at most MAX_LINE_BYTES (a longer one closes
the connection); every message is read by files/inputfile.py's `loads_strict` (`strict_json`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import select
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...config import MultinodeConfig
from ...errors import InputError
from ...files import trust
from ...files.inputfile import loads_strict
from ...logsetup import escaped

log = logging.getLogger(__name__)

KEY_FILE = MultinodeConfig().key_file
KEY_BYTES = 32
MAX_LINE_BYTES = 1 << 20
MAX_TAIL_CHARS = 300  # a short text a peer sends: a refusal's reason, the last line of a failing rank
SEND_TIMEOUT_S = 30.0  # a peer that stops reading cannot hold the other end longer
NONCE_BYTES = 16
_HEX = re.compile(r"[0-9a-f]+")


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


def mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def session_key(key: bytes, coordinator_nonce: str, joiner_nonce: str) -> bytes:
    return bytes.fromhex(mac(key, "session", coordinator_nonce, joiner_nonce))


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def is_nonce(value: object) -> bool:
    return isinstance(value, str) and len(value) == 2 * NONCE_BYTES and _HEX.fullmatch(value) is not None


def is_mac(value: object) -> bool:
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
        seal = mac(self.session, self.outgoing, str(self.sent), body)
        return json.dumps({"seq": self.sent, "body": body, "mac": seal}).encode() + b"\n"

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
        seq, body, seal = doc.get("seq"), doc.get("body"), doc.get("mac")
        if not isinstance(body, str) or not is_mac(seal) or type(seq) is not int:
            self.fail("an unsealed message after the handshake")
            return None
        expected = mac(self.session, self.incoming, str(seq), body)
        if not hmac.compare_digest(expected, str(seal)):
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
