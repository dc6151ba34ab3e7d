"""The control channel of sweeps over several nodes (trials.launch.channel): both ends prove they
hold the key before any trial, every message is sealed in order, and a joining node takes only
what the rules allow. Real sockets on 127.0.0.1, real `nccltune sweep --join` processes."""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nccltune.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, EXIT_USAGE, InputError, UnavailableError, UsageError
from nccltune.trials.launch.admission import (
    HANDSHAKE_S,
    MAX_LOGGED,
    MAX_PENDING,
    MAX_PENDING_PER_PEER,
    job_addresses,
    peer_of,
)
from nccltune.trials.launch.base import LaunchShape, make_launch
from nccltune.trials.launch.channel import ControlServer, Unanswered, handshake, join_session
from nccltune.trials.launch.messages import REFUSED_VARIABLES, check_trial, check_welcome, fit_report
from nccltune.trials.launch.sealing import MAX_LINE_BYTES, Peer, load_key, write_key
from tests.twonodes import node_env, port_pair

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    return write_key(tmp_path / "keys" / "multinode.key")


@pytest.fixture
def config(tmp_path: Path, key_file: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"multinode": {"key_file": str(key_file)}}))
    return path


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True, timeout=120,
                          env=node_env(), cwd=cwd)


def _joiner(tmp_path: Path, port: int, config: Path) -> subprocess.Popen[str]:
    """`nccltune sweep --join` as a process of its own: the demo's ranks (two), no GPU needed."""
    return subprocess.Popen(
        [sys.executable, "-m", "nccltune", "sweep", "--join", f"127.0.0.1:{port}", "--demo", "--state-dir",
         str(tmp_path / "joiner"), "--config", str(config), "--python", sys.executable, "-v"],
        env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        start_new_session=True)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception as exc:  # the test looks at what came out
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.fixture
def coordinator(key_file: Path) -> Iterator[tuple[ControlServer, int]]:
    """A coordinator's end holding the key, for one joining node of one rank."""
    port = port_pair()
    server = ControlServer("127.0.0.1", port + 1, key=load_key(key_file), joiners=1, nproc_per_node=1,
                           join_wait_s=60)
    try:
        yield server, port
    finally:
        server.close()


def _session(server: ControlServer, port: int, key: bytes, key_file: Path) -> Peer:
    """A joining end admitted by `server` (in this process): its side of the session."""
    thread, box = _in_thread(server.admit)
    sock = socket.create_connection(("127.0.0.1", port + 1), timeout=10)
    peer, nnodes, nproc = join_session(sock, "the coordinator", key, str(key_file))
    thread.join(30)
    assert box == [None] and (nnodes, nproc) == (2, 1)
    return peer


# -- the key ----------------------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_and_never_replaces_one(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "multinode.key"
    made = _cli("keygen", str(path), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert str(path) in made.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_key(path)
    assert len(key) == 32
    again = _cli("keygen", str(path), cwd=tmp_path)
    assert again.returncode == EXIT_CONFIG and str(path) in again.stderr and "Traceback" not in again.stderr
    assert load_key(path) == key  # unchanged


def test_an_unsafe_or_missing_key_is_refused_naming_the_file(tmp_path: Path, key_file: Path) -> None:
    with pytest.raises(InputError, match="no multi-node key file"):
        load_key(tmp_path / "absent.key")
    os.chmod(key_file, 0o640)
    with pytest.raises(InputError, match=r"other users may read it \(mode 0640\)"):
        load_key(key_file)
    os.chmod(key_file, 0o600)
    link = tmp_path / "link.key"
    link.symlink_to(key_file)
    with pytest.raises(InputError, match="symlink"):
        load_key(link)
    short = tmp_path / "short.key"
    short.write_text("abcd\n")
    os.chmod(short, 0o600)
    with pytest.raises(InputError, match="64 lower-case hex digits"):
        load_key(short)


def test_a_joiner_without_its_key_exits_78_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"multinode": {"key_file": str(tmp_path / "none.key")}}))
    port = port_pair()
    code, err = _finish(_joiner(tmp_path, port, config))
    assert code == EXIT_CONFIG, err
    assert str(tmp_path / "none.key") in err and "nccltune keygen" in err and "Traceback" not in err


def test_a_coordinator_without_its_key_exits_78_before_planning(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"multinode": {"key_file": str(tmp_path / "none.key")}}))
    got = _cli("sweep", "--demo", "--nodes", "2", "--launcher", "torchrun", "--rdzv-endpoint",
               f"127.0.0.1:{port_pair()}", "--config", str(config), "--state-dir", str(tmp_path / "state"),
               cwd=tmp_path)
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert str(tmp_path / "none.key") in got.stderr and "Traceback" not in got.stderr


# -- authentication -----------------------------------------------------------------------------------------


def test_an_imposter_coordinator_is_refused_and_nothing_runs(tmp_path: Path, config: Path) -> None:
    """Someone listening on the control port first, without the key: the joining node stops
    before any trial, however the imposter answers."""
    # 1. One that answers as the old, unauthenticated channel did: a welcome and a hostile trial.
    port = port_pair()
    listener = socket.create_server(("127.0.0.1", port + 1))

    def old_style() -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("rwb") as stream:
            stream.readline()
            for doc in ({"welcome": 2, "nproc_per_node": 16},
                        {"trial": 1, "rdzv_id": "x-1", "env": {"NCCL_NET_PLUGIN": "/home/m/evil.so"},
                         "worker_args": [], "timeout_s": 60, "nccl_debug": False}):
                stream.write(json.dumps(doc).encode() + b"\n")
            stream.flush()
            stream.readline()

    thread, _ = _in_thread(old_style)
    code, err = _finish(_joiner(tmp_path, port, config))
    thread.join(30)
    listener.close()
    assert code == EXIT_UNAVAILABLE, err
    assert "is not an authenticated coordinator" in err and "nothing was run" in err and "Traceback" not in err
    assert not list((tmp_path / "joiner").glob("join/trial-*"))

    # 2. One that speaks the protocol with a key of its own.
    other = tmp_path / "other.key"
    write_key(other)
    port = port_pair()
    # It admits only once the joining node's connection is queued, so a short wait for joiners is
    # waited out on a refusal alone, not on an interpreter starting.
    imposter = ControlServer("127.0.0.1", port + 1, key=load_key(other), joiners=1, nproc_per_node=1, join_wait_s=5)
    joining = _joiner(tmp_path, port, config)
    assert select.select([imposter.server], [], [], 60)[0], "the joining node never connected"
    thread, box = _in_thread(imposter.admit)
    code, err = _finish(joining)
    thread.join(40)
    imposter.close()
    assert code == EXIT_UNAVAILABLE, err
    assert "does not prove it holds the multi-node key" in err and str(config.parent / "keys") in err
    assert isinstance(box[0], UnavailableError) and not imposter.peers  # nor did it admit the joiner
    assert not list((tmp_path / "joiner").glob("join/trial-*"))


def test_a_refusal_from_a_coordinator_reaches_the_joiners_message_escaped(key_file: Path) -> None:
    """Anyone may answer on the control port before the handshake: what it says is escaped."""
    port = port_pair()
    listener = socket.create_server(("127.0.0.1", port + 1))

    def refuse() -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("rwb") as stream:
            stream.readline()
            stream.write(json.dumps({"refuse": "no\n2026 ERROR nccltune: forged\x1b[2J"}).encode() + b"\n")
            stream.flush()

    thread, _ = _in_thread(refuse)
    with pytest.raises(UnavailableError) as caught:
        join_session(socket.create_connection(("127.0.0.1", port + 1), timeout=10), "the coordinator",
                     load_key(key_file), str(key_file))
    thread.join(30)
    listener.close()
    said = str(caught.value).splitlines()[0]  # the hint follows on a line of nccltune's own
    assert said.isprintable() and said.endswith("refused this node: no\\n2026 ERROR nccltune: forged\\x1b[2J")


def test_a_joiner_without_the_key_is_refused_before_any_trial(tmp_path: Path, coordinator: tuple[ControlServer, int],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    server, port = coordinator
    other = tmp_path / "other.key"
    write_key(other)
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump({"multinode": {"key_file": str(other)}}))
    server.join_wait_s = 30
    thread, box = _in_thread(server.admit)
    joiner = _joiner(tmp_path, port, config)
    code, err = _finish(joiner)
    # The coordinator's own proof fails first on the joiner's side: it stops without answering.
    assert code == EXIT_UNAVAILABLE and "Traceback" not in err
    assert "not an authenticated coordinator" in err
    # A peer that answers the challenge without the key is refused by the coordinator, with why.
    sock = socket.create_connection(("127.0.0.1", port + 1), timeout=10)
    with pytest.raises(UnavailableError, match="is not an authenticated coordinator"):
        join_session(sock, "the coordinator", load_key(other), str(other))
    stream = socket.create_connection(("127.0.0.1", port + 1), timeout=10)
    stream.sendall(json.dumps({"hello": "mallory", "version": "x", "nonce": "ab" * 16}).encode() + b"\n")
    challenge = json.loads(stream.makefile("rb").readline())
    assert set(challenge) == {"challenge", "proof"}
    stream.sendall(json.dumps({"proof": "00" * 32}).encode() + b"\n")
    refusal = json.loads(stream.makefile("rb").readline())
    assert refusal == {"refuse": "authentication failed: this node does not hold the coordinator's multi-node key"}
    stream.close()
    # The real joiner still gets in afterwards; no refused peer was admitted.
    good, _, _ = join_session(socket.create_connection(("127.0.0.1", port + 1), timeout=10), "the coordinator",
                              server.key, "key")
    thread.join(40)
    assert box == [None]
    assert len(server.peers) == 1 and not good.closed
    assert any("does not hold the multi-node key" in r.getMessage() for r in caplog.records)


def test_idle_and_slow_connections_do_not_hold_up_a_real_joiner(key_file: Path,
                                                                coordinator: tuple[ControlServer, int]) -> None:
    server, port = coordinator
    # From addresses of their own: one address holds a few handshakes only (see below).
    idle = [_from(f"127.0.4.{i}", port + 1) for i in range(1, 6)]
    slow = _from("127.0.4.6", port + 1)
    slow.sendall(b'{"hello": "slow", ')  # half a line, and then nothing
    peer = _session(server, port, load_key(key_file), key_file)
    # Admitted while every idle connection was still waiting out its own handshake deadline.
    assert len(server.peers) == 1 and len(server.pending) == 6
    peer.close()
    for sock in [*idle, slow]:
        sock.close()


# -- admission ---------------------------------------------------------------------------------------------


def _from(address: str, port: int) -> socket.socket:
    """A connection to the control channel on 127.0.0.1:port from `address` (any of 127/8 is this host)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def _hello() -> bytes:
    return json.dumps({"hello": "flood", "version": "0", "nonce": "ab" * 16}).encode() + b"\n"


def _closed(sock: socket.socket, within_s: float = 0.0) -> bool:
    """The coordinator closed `sock` (what it sent before, a challenge, read and dropped)."""
    deadline = time.monotonic() + within_s
    while True:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        try:
            if not sock.recv(1 << 16):
                return True
        except OSError:
            return True


def test_unauthenticated_connections_cannot_keep_a_real_joiner_out(key_file: Path, caplog: pytest.LogCaptureFixture,
                                                                   coordinator: tuple[ControlServer, int]) -> None:
    """Every handshake slot held, by connections from as many addresses that each said a good
    hello (the most a connection without the key can do), and more from one address: a real
    joiner still gets in at once (in the slot of the oldest of another address), one address
    holds its share only, and the log says it in a few lines."""
    server, port = coordinator
    thread, box = _in_thread(server.admit)
    flood = [_from(f"127.0.1.{i}", port + 1) for i in range(1, MAX_PENDING + 1)]
    for sock in flood:
        sock.sendall(_hello())
    for sock in flood:  # each challenged: all of them hold a slot, hello said
        assert b"challenge" in sock.recv(4096)
    one_peer = [_from("127.0.2.1", port + 1) for _ in range(4 * MAX_PENDING_PER_PEER)]
    started = time.monotonic()
    peer, nnodes, _ = handshake("127.0.0.1", port + 1, 30, "the coordinator", load_key(key_file), str(key_file))
    thread.join(30)
    assert box == [None] and len(server.peers) == 1 and nnodes == 2
    assert time.monotonic() - started < HANDSHAKE_S
    # One address keeps at most its share (admission is over: what is pending stays as it was).
    assert sum(hs.peer == "127.0.2.1" for hs in server.pending) <= MAX_PENDING_PER_PEER
    assert len(server.pending) <= MAX_PENDING
    assert sum(_closed(sock, 0.2) for sock in one_peer) >= len(one_peer) - MAX_PENDING_PER_PEER
    turned = [r.getMessage() for r in caplog.records if "closed" in r.getMessage()]
    assert len(turned) <= 2 * MAX_LOGGED + 1
    assert any(m.startswith("closed ") and "did not complete a handshake" in m for m in turned)
    peer.close()
    for sock in [*flood, *one_peer]:
        sock.close()


def test_the_jobs_own_peers_keep_their_slots(key_file: Path) -> None:
    """A handshake from one of the job's own nodes is never closed for another connection, however
    many come; theirs are closed for each other, oldest first."""
    port = port_pair()
    server = ControlServer("127.0.0.1", port + 1, key=load_key(key_file), joiners=1, nproc_per_node=1,
                           join_wait_s=60, job_peers=job_addresses(["127.0.0.1"]))
    try:
        thread, box = _in_thread(server.admit)
        ours = _from("127.0.0.1", port + 1)
        flood = [_from(f"127.0.3.{i}", port + 1) for i in range(1, 3 * MAX_PENDING)]
        time.sleep(0.5)  # every connection accepted
        assert not _closed(ours) and len(server.pending) == MAX_PENDING
        assert _closed(flood[0], 1.0) and not _closed(flood[-1])
        peer, _, _ = join_session(ours, "the coordinator", server.key, str(key_file))
        thread.join(30)
        assert box == [None] and len(server.peers) == 1 and not peer.closed
        for sock in flood:
            sock.close()
    finally:
        server.close()


IMAGE_A, IMAGE_B = "sha256:" + "ab" * 32, "sha256:" + "cd" * 32


def _join_with_images(key_file: Path, ours: str | None, theirs: str | None,
                      wait_s: float) -> tuple[ControlServer, Any, list[Any]]:
    """A coordinator measuring in `ours` and one joiner in `theirs` through the handshake: the
    server (closed), the joiner's session or its exception, and what admit() gave."""
    port = port_pair()
    server = ControlServer("127.0.0.1", port + 1, key=load_key(key_file), joiners=1, nproc_per_node=1,
                           join_wait_s=wait_s, image=ours)
    try:
        thread, box = _in_thread(server.admit)
        sock = socket.create_connection(("127.0.0.1", port + 1), timeout=10)
        try:
            got: Any = join_session(sock, "the coordinator", server.key, str(key_file), image=theirs)
        except UnavailableError as exc:
            got = exc
        thread.join(30)
        return server, got, box
    finally:
        server.close()


@pytest.mark.parametrize(("ours", "theirs"), [(None, IMAGE_A), (IMAGE_A, None), (IMAGE_A, IMAGE_B)])
def test_a_joiner_measuring_in_another_image_is_refused_before_any_trial(
        key_file: Path, ours: str | None, theirs: str | None) -> None:
    """One job, one NCCL: the coordinator refuses a joiner whose bench.image (digest, or none: its
    host) is not its own, after both proved the key, naming both."""
    server, got, _box = _join_with_images(key_file, ours, theirs, wait_s=2)
    assert isinstance(got, UnavailableError) and not server.peers
    said = str(got)
    assert "refused this node: the coordinator measures" in said and "give every node the same bench.image" in said
    assert (ours or "on its host") in said and (theirs or "on its host") in said


def test_a_joiner_in_the_coordinators_image_is_admitted(key_file: Path) -> None:
    server, got, box = _join_with_images(key_file, IMAGE_A, IMAGE_A, wait_s=30)
    peer, _, _ = got
    assert box == [None] and len(server.peers) == 1 and not peer.closed


def test_a_connection_that_says_nothing_is_closed_at_the_pre_auth_deadline(coordinator: tuple[ControlServer, int]
                                                                          ) -> None:
    server, port = coordinator
    _in_thread(server.admit)
    idle = _from("127.0.0.1", port + 1)
    started = time.monotonic()
    assert _closed(idle, HANDSHAKE_S + 5)
    assert HANDSHAKE_S - 0.5 <= time.monotonic() - started <= HANDSHAKE_S + 2
    idle.close()


def test_a_joiner_closed_unanswered_connects_again(key_file: Path, coordinator: tuple[ControlServer, int]) -> None:
    server, port = coordinator
    key = load_key(key_file)
    joining, box = _in_thread(lambda: handshake("127.0.0.1", port + 1, 30, "the coordinator", key, str(key_file)))
    # Its first connection closed before any answer, as a coordinator without a slot for it does.
    assert select.select([server.server], [], [], 10)[0]
    first, _ = server.server.accept()
    first.close()
    admitting, admitted = _in_thread(server.admit)
    joining.join(30)
    admitting.join(30)
    assert admitted == [None] and len(server.peers) == 1 and isinstance(box[0][0], Peer)
    # A coordinator that closes every connection unanswered: exit 69 once the wait is over.
    listener = socket.create_server(("127.0.0.1", 0))
    _in_thread(lambda: [listener.accept()[0].close() for _ in range(100)])
    started = time.monotonic()
    with pytest.raises(Unanswered, match="closed the connection before it answered"):
        handshake("127.0.0.1", listener.getsockname()[1], 2, "the coordinator", key, str(key_file))
    assert time.monotonic() - started < 10
    listener.close()


@pytest.mark.parametrize(("address", "peer"), [
    ("10.1.2.3", "10.1.2.3"), ("::ffff:10.1.2.3", "10.1.2.3"), ("fd00:1:2:3:4:5:6:7", "fd00:1:2:3::/64"),
    ("fd00:1:2:3:ffff::1", "fd00:1:2:3::/64"), ("fe80::1%eth0", "fe80::/64"), ("not an address", "not an address"),
])
def test_one_peer_is_an_address_or_an_ipv6_64(address: str, peer: str) -> None:
    assert peer_of(address) == peer


def test_the_jobs_own_peers_are_its_nodes_addresses() -> None:
    assert job_addresses(["127.0.0.1", "localhost", "no-such-node.invalid"]) >= {"127.0.0.1"}
    assert job_addresses([]) == frozenset()


# -- sealed messages ---------------------------------------------------------------------------------------


def test_every_message_is_sealed_and_in_order(key_file: Path, coordinator: tuple[ControlServer, int]) -> None:
    server, port = coordinator
    joiner = _session(server, port, load_key(key_file), key_file)
    (to_joiner,) = server.peers
    first = to_joiner.encode({"kill": 1})
    to_joiner.sock.sendall(first)
    to_joiner.sent += 1
    assert joiner.read(10) == [{"kill": 1}]
    to_joiner.sock.sendall(first)  # the same message again
    assert joiner.read(10) == [] and joiner.closed
    assert joiner.failure == "message 1 where 2 was due (replayed or reordered)"


def test_a_reordered_or_altered_message_closes_the_connection(key_file: Path,
                                                              coordinator: tuple[ControlServer, int]) -> None:
    server, port = coordinator
    joiner = _session(server, port, load_key(key_file), key_file)
    (to_joiner,) = server.peers
    one = to_joiner.encode({"kill": 1})
    to_joiner.sent += 1
    two = to_joiner.encode({"kill": 2})
    to_joiner.sent += 1
    to_joiner.sock.sendall(two + one)
    assert joiner.read(10) == [] and joiner.failure == "message 2 where 1 was due (replayed or reordered)"

    server2 = ControlServer("127.0.0.1", port_pair() + 1, key=load_key(key_file), joiners=1, nproc_per_node=1)
    port2 = server2.address[1] - 1
    joiner2 = _session(server2, port2, load_key(key_file), key_file)
    (peer2,) = server2.peers
    sealed = json.loads(peer2.encode({"kill": 1}))
    sealed["body"] = json.dumps({"stop": True})  # altered on the way
    peer2.sock.sendall(json.dumps(sealed).encode() + b"\n")
    assert joiner2.read(10) == [] and joiner2.failure is not None and "MAC does not match" in joiner2.failure
    server2.close()


def test_a_line_over_the_bound_closes_the_connection() -> None:
    a, b = socket.socketpair()
    receiver = Peer(b, "peer")
    writer = threading.Thread(target=lambda: a.sendall(b"x" * (MAX_LINE_BYTES + 1024)), daemon=True)
    writer.start()
    while not receiver.closed:
        receiver.read(5)
    assert receiver.failure == f"a message over {MAX_LINE_BYTES} bytes"
    a.close()
    writer.join(10)


def test_a_report_fits_one_line_whatever_rank_0_printed() -> None:
    huge = {"result": 1, "exit": 0, "rank0_out": "\u2603" * (2 << 20), "err_tail": "e" * 5000,
            "nccl_log": "z" * (1 << 20)}
    fitted = fit_report(huge)
    assert len(json.dumps(json.dumps(fitted))) <= MAX_LINE_BYTES
    assert "nccl_log" not in fitted and "stays there" in fitted["nccl_log_missing"]
    assert fitted["rank0_out"] and len(fitted["err_tail"]) == 300


# -- what a joining node accepts -------------------------------------------------------------------------------


def _trial(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"trial": 3, "rdzv_id": "nccltune-ab12-3", "env": {"NCCL_ALGO": "Ring"}, "files": {},
                            "worker_args": ["--backend", "gloo", "--sizes", "4096,16384", "--warmup", "1",
                                            "--start-warmup", "1", "--iters", "2", "--timeout-s", "120"],
                            "timeout_s": 120.0, "nccl_debug": False}
    return {**base, **fields}


def test_a_well_formed_trial_passes() -> None:
    order = check_trial(_trial(env={"NCCL_ALGO": "Ring", "NCCL_TOPO_FILE": "/var/lib/nccltune/t.xml"},
                               files={"NCCL_TOPO_FILE": "<system/>"}, nccl_debug=True))
    assert order.seq == 3 and order.nccl_debug and order.files == {"NCCL_TOPO_FILE": "<system/>"}


@pytest.mark.parametrize(("fields", "named"), [
    ({"env": {"NCCL_NET_PLUGIN": "/home/mallory/evil.so"}}, "NCCL_NET_PLUGIN"),
    ({"env": {"NCCL_TUNER_PLUGIN": "/home/mallory/libnccl-tuner-nccltune.so"}}, "NCCL_TUNER_PLUGIN"),
    ({"env": {"NCCL_CONF_FILE": "/home/mallory/nccl.conf"}}, "NCCL_CONF_FILE"),
    ({"env": {"NCCL_DEBUG_FILE": "/etc/passwd"}}, "NCCL_DEBUG_FILE"),
    ({"env": {"NCCL_GRAPH_FILE": "/tmp/g.xml"}}, "NCCL_GRAPH_FILE"),
    ({"env": {"NCCL_DEBUG": "TRACE"}}, "NCCL_DEBUG"),
    ({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "LD_PRELOAD"),
    ({"env": {"NCCL_ALGO": "Ring;reboot"}}, "forbidden character ';'"),
    ({"env": {"NCCL_TOPO_FILE": "/etc/shadow"}}, "whose text did not come"),
    ({"files": {"NCCL_CONF_FILE": "x"}}, "not a file the candidate ships"),
    ({"trial": 1.5}, "not a trial number"),
    ({"trial": True}, "not a trial number"),
    ({"rdzv_id": "x --nnodes 9"}, "not a rendezvous id"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"timeout_s": 1e9}, "timeout_s"),
    ({"timeout_s": "60"}, "timeout_s"),
    ({"nccl_debug": "yes"}, "nccl_debug"),
    ({"worker_args": ["--sizes", "17179869185"]}, "--sizes"),
    ({"worker_args": ["--iters", "1e9"]}, "--iters"),
    ({"worker_args": ["--iters", "100000000"]}, "--iters"),
    ({"worker_args": ["--start-warmup", "-1"]}, "--start-warmup"),
    ({"worker_args": ["--timeout-s", "nan"]}, "--timeout-s"),
    ({"worker_args": ["--backend", "mpi"]}, "--backend"),
    ({"worker_args": ["--python", "/tmp/py"]}, "not an argument of the worker"),
    ({"worker_args": ["--sizes"]}, "without its value"),
])
def test_a_joiner_refuses_what_the_rules_do_not_allow(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(InputError, match=named.replace("(", r"\(").replace(";", ";")):
        check_trial(_trial(**fields))


def test_no_variable_that_names_a_file_or_library_crosses() -> None:
    assert {"NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_CONF_FILE", "NCCL_DEBUG_FILE", "NCCL_GRAPH_FILE",
            "NCCL_PROFILER_PLUGIN", "NCCLTUNE_TUNER_TABLE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS"} <= REFUSED_VARIABLES
    assert "NCCL_TOPO_FILE" not in REFUSED_VARIABLES  # only as text the joiner writes itself


def test_ranks_per_node_are_bounded_by_the_node() -> None:
    check_welcome(2, 2, 2, "c")
    with pytest.raises(UnavailableError, match="16 ranks per node; this node runs 1 to 2"):
        check_welcome(2, 16, 2, "c")
    with pytest.raises(UnavailableError, match="nodes"):
        check_welcome(1, 1, 2, "c")


def test_an_authenticated_coordinator_still_gets_hostile_fields_refused(tmp_path: Path, config: Path,
                                                                        key_file: Path) -> None:
    """The joiner as a process: a trial naming a library is refused (exit 78 in its report, no
    trial directory); then a NaN and a non-integer trial end the joiner with a message, no traceback."""
    port = port_pair()
    server = ControlServer("127.0.0.1", port + 1, key=load_key(key_file), joiners=1, nproc_per_node=2,
                           join_wait_s=60)
    joiner = _joiner(tmp_path, port, config)
    try:
        server.admit()
        server.publish(_trial(trial=1, env={"NCCL_NET_PLUGIN": "/home/mallory/evil.so"}))
        (report,) = server.collect(60)
        assert report["exit"] == EXIT_CONFIG and "NCCL_NET_PLUGIN" in report["err_tail"]
        assert not (tmp_path / "joiner" / "join" / "trial-001").exists()
        (peer,) = server.peers
        body = '{"trial": 2, "rdzv_id": "x-2", "timeout_s": NaN}'
        from nccltune.trials.launch.sealing import mac

        assert peer.session is not None
        sealed = {"seq": peer.sent, "body": body, "mac": mac(peer.session, peer.outgoing, str(peer.sent), body)}
        peer.sock.sendall(json.dumps(sealed).encode() + b"\n")
        code, err = _finish(joiner)
    finally:
        server.close()
        if joiner.poll() is None:
            joiner.kill()
    assert code == EXIT_UNAVAILABLE, err
    assert "NaN is not a number" in err and "Traceback" not in err
    assert not (tmp_path / "joiner" / "join" / "trial-002").exists()


def test_a_non_integer_trial_number_ends_the_joiner_cleanly(tmp_path: Path, config: Path, key_file: Path) -> None:
    port = port_pair()
    server = ControlServer("127.0.0.1", port + 1, key=load_key(key_file), joiners=1, nproc_per_node=2,
                           join_wait_s=60)
    joiner = _joiner(tmp_path, port, config)
    try:
        server.admit()
        (peer,) = server.peers
        peer.send(_trial(trial=1.5))
        code, err = _finish(joiner)
    finally:
        server.close()
    assert code == EXIT_UNAVAILABLE, err
    assert "sent a trial without a trial number ('1.5')" in err and "Traceback" not in err


def test_a_joiner_refuses_more_ranks_than_its_node_has(tmp_path: Path, config: Path, key_file: Path) -> None:
    port = port_pair()
    server = ControlServer("127.0.0.1", port + 1, key=load_key(key_file), joiners=1, nproc_per_node=16,
                           join_wait_s=60)
    joiner = _joiner(tmp_path, port, config)
    try:
        server.admit()
        code, err = _finish(joiner)
    finally:
        server.close()
    assert code == EXIT_UNAVAILABLE, err
    assert "asks for 16 ranks per node; this node runs 1 to 2" in err


# -- where the coordinator listens ---------------------------------------------------------------------------


def test_the_coordinator_listens_on_the_address_given_only(key_file: Path) -> None:
    port = port_pair()
    launch = make_launch(LaunchShape(2, 1), "torchrun", ("127.0.0.1", port), key_file=str(key_file))
    from nccltune.trials.launch.torchrun import TorchrunLaunch

    assert isinstance(launch, TorchrunLaunch)
    server = launch._server()
    assert server.address == ("127.0.0.1", port + 1)
    launch.close()
    with pytest.raises(UsageError, match="needs --rdzv-endpoint"):
        make_launch(LaunchShape(2, 1), "torchrun", None)


def test_the_cli_asks_for_the_endpoint_of_a_sweep_over_nodes(tmp_path: Path, config: Path) -> None:
    got = _cli("sweep", "--demo", "--nodes", "2", "--launcher", "torchrun", "--config", str(config),
               "--state-dir", str(tmp_path / "state"), cwd=tmp_path)
    assert got.returncode == EXIT_USAGE and "--rdzv-endpoint" in got.stderr
