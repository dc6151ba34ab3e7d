"""How a trial's ranks are started: on this node, across nodes through torchrun, or through srun.

The runner (trials.runner) builds the worker's command and environment for a trial and asks its
`Launch` what to start on this node; it spawns those processes, waits with its hard timeout and
kills them as before. A launch adds what several nodes need:

- `LocalLaunch`: one process per rank on this node (one node). With `loopback=True` every rank
  gets NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 (NCCL_NET_DISABLE_INTRA removed), so traffic
  between local GPUs goes through the NICs and NCCL sees one rank per node. Its results carry the
  shape `<nranks>x1-nic-loopback`, a key of its own that no other shape matches.
- `TorchrunLaunch`: one torchrun agent per node (`python -m torch.distributed.run`, torchrun
  itself, run by the worker's interpreter), joined by c10d rendezvous at HOST:PORT with a fresh
  rendezvous id per trial and `--max-restarts 0`. The coordinating node (the one running the
  sweep) starts its own agent, which hosts the c10d store (`is_host=1`). Every other node runs
  `nccltune sweep --join HOST:PORT` (started by hand, by the site's pdsh/ssh, or by one Slurm
  step per node); it connects to the coordinator's control channel at HOST:PORT+1 and starts one
  agent per trial, on the coordinator's word.
- `SrunLaunch`: inside a Slurm allocation, one `srun` per trial over the allocation's first N nodes
  (task 0 on the first, block distribution), one GPU bound to each task (`--gpus-per-task=1`);
  srun starts every rank and passes this node's environment to all of them (`--export=ALL,NAMES`,
  with the values in srun's own environment: Slurm's --export list cannot hold values with commas,
  NCCL_IB_HCA's can). The options are explained where the command line is built.

Same environment on every rank, by construction. With srun there is one environment, the one
srun was started with. With torchrun the coordinator sends each trial's candidate (validated by
publish.validate_env on both ends) with the trial id over the control channel; a joining node
runs its agent with its own base environment plus exactly that candidate, and the rendezvous id
is the trial id, so an agent started for another trial cannot join. A topology file among the
candidate's variables (NCCL_TOPO_FILE) travels as its text and is written on the joining node:
nodes of one class share one topology. When the coordinator reads NCCL's log, every node runs its
ranks with the same debug variables (trials.nccllog.debug_env, the log in its own trial
directory), and the node where global rank 0 ran sends rank 0's log back with its result.

Control channel: JSON lines over one TCP connection per joining node, coordinator at HOST:PORT+1.
  joiner -> {"hello": host, "version": V}; coordinator -> {"welcome": N, "nproc_per_node": P} or
  {"refuse": why} (another nccltune version); per trial coordinator -> {"trial": seq, "rdzv_id", "env", "files",
  "worker_args", "timeout_s", "nccl_debug"}, joiner -> {"result": seq, "exit": code, "rank0_out", "err_tail"},
  plus, where rank 0 ran on the joiner and nccl_debug was asked, "nccl_log" (rank 0's NCCL log,
  zlib and base64: trials.nccllog.pack) or "nccl_log_missing" (why not); coordinator -> {"kill": seq}
  when the trial ends badly here, {"stop": true} at the end.
It is as unauthenticated as torch's c10d store on HOST:PORT: both ports must be reachable from the
job's nodes only. A joiner runs nothing but its own worker.py, with argument lists, never a shell.

A trial that fails or hangs on any node ends on all of them, and the sweep goes on:
- a worker that exits non-zero: its agent stops the other local workers, and with --max-restarts
  0 every other agent sees the rendezvous closed and stops its workers too (torchrun's own rule);
  a joiner reports the exit to the coordinator, whose runner kills its own agent.
- a hang: only the coordinator's timeout can tell. It sends {"kill": seq} to every joiner and
  stops its own agent: SIGTERM (torchrun passes it on to its workers), KILL_GRACE_S later SIGKILL
  to the agent and to every process below it (torchrun starts each worker in a session of its
  own, so a process group kill alone would leave them). A joiner does the same to its agent on
  "kill"; without the message (coordinator gone) it does so at the trial's timeout plus
  KILL_GRACE_S by its own clock (the store's death usually makes its agent exit earlier). So every
  node is clear at most timeout_s + KILL_GRACE_S after the trial started when the coordinator is
  alive (measured here: a 20 s timeout, the joining node's agent gone 1.5 s after it), and
  timeout_s + 2 * KILL_GRACE_S when it is not; the coordinator then waits up to 2 * KILL_GRACE_S
  for the other nodes' reports, and the next trial starts.
- an agent killed outright (SIGKILL, the OOM killer) takes its workers with it: each worker dies
  with its parent (rankexec.die_with_parent), and a joiner's agent dies with the joiner.
- with srun, a task that exits non-zero ends the step (--kill-on-bad-exit=1), one that ends while
  the others still run ends them SRUN_WAIT_S later (--wait); the runner's timeout sends srun
  SIGTERM, which srun delivers to every task on every node; Slurm's KillWait later kills what
  remains, and the runner SIGKILLs srun after KILL_GRACE_S.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EXIT_CONFIG, NccltuneError, UnavailableError, UsageError
from ..publish import validate_env
from ..sweep.plan import JobShape
from . import nccllog
from .rankexec import die_with_parent

log = logging.getLogger(__name__)

RANKEXEC = Path(__file__).with_name("rankexec.py")
WORKER = Path(__file__).with_name("worker.py")
LAUNCHERS = ("auto", "local", "torchrun", "srun")
DEFAULT_RDZV_PORT = 29400  # torchrun's own default for c10d
CONTROL_PORT_OFFSET = 1  # the control channel listens next to the rendezvous port
KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL, for an agent or srun
MONITOR_INTERVAL_S = 0.5  # torchrun's worker polling (its default is 0.1 s on 2.x, 5 s before)
MAX_MESSAGE_BYTES = 16 << 20
# Variables naming a file whose text goes to the other nodes, and the name it gets there.
SHIPPED_FILES = {"NCCL_TOPO_FILE": "ncclTopology.xml"}
LOOPBACK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
LOOPBACK_UNSET = ("NCCL_NET_DISABLE_INTRA",)
# Rank variables of an enclosing launch must not reach a trial's ranks: the launch sets its own.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class LaunchShape:
    """The job a trial measures, as the results are keyed: nodes x ranks per node, NIC loopback.

    A NIC-loopback trial runs on one node but NCCL sees one rank per node, so its shape is
    nranks x 1 with `loopback`, and its label differs from every real multi-node shape."""

    nnodes: int
    ranks_per_node: int
    loopback: bool = False

    @property
    def nranks(self) -> int:
        return self.nnodes * self.ranks_per_node

    @property
    def label(self) -> str:
        return f"{self.nnodes}x{self.ranks_per_node}" + ("-nic-loopback" if self.loopback else "")

    def plan_shape(self) -> JobShape:
        """The shape build_plan prunes for: the physical nodes, loopback or not."""
        return JobShape(nnodes=1, loopback=True) if self.loopback else JobShape(nnodes=self.nnodes)


def loopback_shape(nranks: int) -> LaunchShape:
    return LaunchShape(nnodes=nranks, ranks_per_node=1, loopback=True)


@dataclass(frozen=True)
class ProcSpec:
    """One process the runner starts on this node: `name` for its output files (name.out/.err),
    `who` for messages ("rank 1", "torchrun on this node")."""

    name: str
    argv: list[str]
    env: dict[str, str]
    who: str


@dataclass(frozen=True)
class TrialSpec:
    """What the runner knows of a trial: `worker` is [python, worker.py, args...]; `env` the full
    environment with the candidate applied; `candidate` the candidate alone; `nccl_log`: the
    runner reads NCCL's log of rank 0 (`env` holds nccllog.debug_env for this node)."""

    seq: int
    trial_dir: Path
    worker: list[str]
    env: dict[str, str]
    candidate: dict[str, str]
    timeout_s: float
    nccl_log: bool = False


class Launch:
    """Base: what to start on this node, and the hooks around the runner's wait and kill."""

    launcher = "local"

    def __init__(self, shape: LaunchShape, node_class: str | None = None) -> None:
        self.shape = shape
        self.node_class = node_class

    def record(self) -> dict[str, Any]:
        """What results are stored with: the shape, its label (the key) and the node class."""
        return {"label": self.shape.label, "nnodes": self.shape.nnodes, "ranks_per_node": self.shape.ranks_per_node,
                "loopback": self.shape.loopback, "launcher": self.launcher, "node_class": self.node_class}

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        """Tell other nodes (where there are any) and return what to spawn here."""
        raise NotImplementedError

    def poll(self) -> str | None:
        """Why the trial failed on another node, once it has; None while nothing is known."""
        return None

    def stop(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """Before the runner SIGKILLs its process groups: end the trial everywhere."""

    def finish(self, trial_dir: Path) -> None:
        """After the wait: leave rank 0's JSON lines in trial_dir/rank0.out."""

    def close(self) -> None:
        """At the end of the sweep."""


class LocalLaunch(Launch):
    """Today's launch: one process per rank on this node, rendezvous at 127.0.0.1:port."""

    def __init__(self, nranks: int, *, loopback: bool = False, node_class: str | None = None) -> None:
        super().__init__(loopback_shape(nranks) if loopback else LaunchShape(1, nranks), node_class)

    def rank_env(self, env: Mapping[str, str], rank: int, port: int) -> dict[str, str]:
        out = dict(env)
        if self.shape.loopback:
            for name in LOOPBACK_UNSET:
                out.pop(name, None)
            out.update(LOOPBACK_ENV)
        n = self.shape.nranks
        out.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return out

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        port = free_port()
        return [ProcSpec(f"rank{r}", list(trial.worker), self.rank_env(trial.env, r, port), f"rank {r}")
                for r in range(self.shape.nranks)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(text: str, what: str = "--rdzv-endpoint") -> tuple[str, int]:
    """HOST:PORT (IPv6 as [ADDR]:PORT); PORT+1 must be a port too (the control channel).

    Raises:
        UsageError: malformed (exit 2).
    """
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65534:
        raise UsageError(f"{what} {text!r}: expected HOST:PORT with PORT between 1 and 65534")
    if any(c.isspace() for c in host) or host.startswith("-"):
        raise UsageError(f"{what} {text!r}: not a host name or address")
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def worker_args(worker: Sequence[str]) -> list[str]:
    """The arguments after worker.py in [python, worker.py, args...]."""
    return list(worker[2:])


def torchrun_argv(python: str, *, nnodes: int, nproc_per_node: int, endpoint: tuple[str, int], rdzv_id: str,
                  is_host: bool, timeout_s: float, args: Sequence[str], local_addr: str | None = None,
                  monitor_interval_s: float = MONITOR_INTERVAL_S) -> list[str]:
    """One node's torchrun agent for one trial, running rankexec.py -> worker.py with `args`."""
    # join_timeout: a node that never comes must not keep the others waiting past the trial;
    # read_timeout: how long an agent waits on a store that stopped answering.
    conf = f"is_host={1 if is_host else 0},join_timeout={max(30, int(timeout_s))},read_timeout=10"
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", _host_port(*endpoint), "--rdzv-id", rdzv_id,
            "--rdzv-conf", conf, "--max-restarts", "0", "--monitor-interval", f"{monitor_interval_s:g}"]
    if local_addr:
        argv += ["--local-addr", local_addr]
    return [*argv, str(RANKEXEC), str(WORKER), *args]


def clean_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in RANK_VARS}


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children first found, deepest last)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM `proc` (a torchrun agent or srun, in its own session), SIGKILL it and everything
    below it after `grace_s`. The tree is read first: once the agent dies its workers are orphans."""
    if proc.poll() is not None:
        below = _descendants(proc.pid)
        _kill_all(below)
        return
    below = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    # Workers started after the first look (a rendezvous finishing meanwhile) are below it too.
    below = list(dict.fromkeys(below + _descendants(proc.pid)))
    _kill_all([proc.pid, *below])
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a worker leads its own session, so its pid is its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# -- the control channel ------------------------------------------------------------------------------


class _Peer:
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
            raise UnavailableError(f"cannot listen on {_host_port(host, port)} for joining nodes: {exc.strerror}",
                                   hint="pick another --rdzv-endpoint port (PORT and PORT+1 must be free)") from exc
        self.server.settimeout(1.0)
        self.peers: list[_Peer] = []
        self.results: dict[str, dict[str, Any]] = {}  # peer name -> its result of the current trial
        self.seq = 0

    def _accept(self, deadline: float) -> None:
        self.peers = [p for p in self.peers if not p.closed]
        while len(self.peers) < self.want and time.monotonic() < deadline:
            try:
                sock, addr = self.server.accept()
            except TimeoutError:
                continue
            peer = _Peer(sock, f"{addr[0]}:{addr[1]}")
            hello = peer.read(30.0)
            if not hello or "hello" not in hello[0]:
                peer.close()
                continue
            peer.name = f"node {hello[0]['hello']} ({addr[0]})"
            from .. import __version__

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


class TorchrunLaunch(Launch):
    """One torchrun agent per node and trial, c10d rendezvous; this node coordinates."""

    launcher = "torchrun"

    def __init__(self, nnodes: int, nproc_per_node: int, endpoint: tuple[str, int], *,
                 node_class: str | None = None, local_addr: str | None = None, join_wait_s: float = 600.0) -> None:
        super().__init__(LaunchShape(nnodes, nproc_per_node), node_class)
        self.endpoint = endpoint
        self.local_addr = local_addr if local_addr else ("127.0.0.1" if _is_loopback(endpoint[0]) else None)
        self.join_wait_s = join_wait_s
        self._token = secrets.token_hex(4)
        self._control: ControlServer | None = None
        self._trial_dir: Path | None = None

    def rdzv_id(self, seq: int) -> str:
        return f"nccltune-{self._token}-{seq}"

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        candidate = validate_env(trial.candidate, source="trial candidate")
        self._trial_dir = trial.trial_dir
        rdzv_id = self.rdzv_id(trial.seq)
        args = worker_args(trial.worker)
        if self.shape.nnodes > 1:
            if self._control is None:
                host, port = self.endpoint
                self._control = ControlServer(host, port + CONTROL_PORT_OFFSET, joiners=self.shape.nnodes - 1,
                                              nproc_per_node=self.shape.ranks_per_node, join_wait_s=self.join_wait_s)
            self._control.publish({"trial": trial.seq, "rdzv_id": rdzv_id, "env": candidate,
                                   "files": _file_payload(candidate), "worker_args": args,
                                   "timeout_s": trial.timeout_s, "nccl_debug": trial.nccl_log})
        argv = torchrun_argv(trial.worker[0], nnodes=self.shape.nnodes, nproc_per_node=self.shape.ranks_per_node,
                             endpoint=self.endpoint, rdzv_id=rdzv_id, is_host=True, timeout_s=trial.timeout_s,
                             args=args, local_addr=self.local_addr)
        return [ProcSpec("agent", argv, clean_env(trial.env), "torchrun on this node")]

    def poll(self) -> str | None:
        return self._control.failure() if self._control is not None else None

    def stop(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        if self._control is not None:
            self._control.kill()
        for proc in procs:
            stop_tree(proc)

    def finish(self, trial_dir: Path) -> None:
        """Rank 0's output from the node it ran on: this one, or the joiner whose report carries it,
        with its NCCL log (nccllog.RANK0_LOG)."""
        remote = self._control.collect(KILL_GRACE_S * 2) if self._control is not None else []
        local = _read(trial_dir / "agent.out")
        text = local
        if not local.strip():
            rank0 = next((r for r in remote if str(r.get("rank0_out", "")).strip()), None)
            text = str(rank0["rank0_out"]) if rank0 else ""
            if rank0 is not None:
                _write_rank0_log(trial_dir, rank0)
        (trial_dir / "rank0.out").write_text(text)
        (trial_dir / "rank0.err").write_text(_read(trial_dir / "agent.err"))

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None


def _write_rank0_log(trial_dir: Path, report: Mapping[str, Any]) -> None:
    """The NCCL log a joiner sent with rank 0's output, as nccllog.RANK0_LOG; a warning when the
    runner reads NCCL's log and none came."""
    packed = report.get("nccl_log")
    if isinstance(packed, str):
        try:
            (trial_dir / nccllog.RANK0_LOG).write_bytes(nccllog.unpack(packed))
            return
        except ValueError as exc:
            log.warning("trial %s: rank 0's NCCL log from the other node is unreadable: %s", trial_dir.name, exc)
    if report.get("nccl_log_missing"):
        log.warning("trial %s: rank 0 ran on another node, whose NCCL log did not come: %s", trial_dir.name,
                    report["nccl_log_missing"])


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _file_payload(candidate: Mapping[str, str]) -> dict[str, str]:
    """Files the candidate names (SHIPPED_FILES), by variable: their text travels, paths are node-local."""
    out = {}
    for name in SHIPPED_FILES:
        path = candidate.get(name)
        if path:
            try:
                out[name] = Path(path).read_text()
            except OSError as exc:
                raise UnavailableError(f"{name} {path}: {exc.strerror}") from exc
    return out


# -- a joining node ----------------------------------------------------------------------------------


def _connect(host: str, port: int, wait_s: float) -> socket.socket:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=10)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise UnavailableError(f"cannot reach the coordinator at {_host_port(host, port)}: {exc}",
                                       hint="start `nccltune sweep --nodes N --rdzv-endpoint HOST:PORT` there") from exc
            time.sleep(1.0)


def join(endpoint: tuple[str, int], *, python: str, base_env: Mapping[str, str], work_dir: Path,
         connect_wait_s: float = 600.0) -> int:
    """Run trials for the coordinator at `endpoint` until it says stop, with as many ranks on this
    node as the coordinator runs on its own. Returns the trial count.

    Raises:
        UnavailableError: the coordinator cannot be reached or refused this node (exit 69).
    """
    host, port = endpoint
    local_addr = "127.0.0.1" if _is_loopback(host) else None
    peer = _Peer(_connect(host, port + CONTROL_PORT_OFFSET, connect_wait_s), f"coordinator {_host_port(host, port)}")
    peer.sock.settimeout(None)
    peer.send({"hello": socket.gethostname(), "version": _version()})
    reply = peer.read(60.0)
    if not reply or "welcome" not in reply[0]:
        why = reply[0].get("refuse") if reply else "no answer"
        peer.close()
        raise UnavailableError(f"the coordinator at {_host_port(host, port)} refused this node: {why}")
    nnodes, nproc_per_node = int(reply[0]["welcome"]), int(reply[0]["nproc_per_node"])
    pending = reply[1:]  # the first trial may come in the same read as the welcome
    trials = 0
    try:
        while not peer.closed:
            if not pending:
                pending.extend(peer.read(3600.0))
            while pending:
                msg = pending.pop(0)
                if msg.get("stop"):
                    return trials
                if "trial" in msg:
                    trials += 1
                    # Messages that arrive during the trial, other than its kill, wait in `pending`.
                    peer.send(_join_trial(msg, peer, pending, python=python, base_env=base_env, work_dir=work_dir,
                                          nnodes=nnodes, nproc_per_node=nproc_per_node, endpoint=endpoint,
                                          local_addr=local_addr))
        log.warning("the coordinator closed the connection")
        return trials
    finally:
        peer.close()


def _join_trial(msg: Mapping[str, Any], peer: _Peer, pending: list[dict[str, Any]], *, python: str,
                base_env: Mapping[str, str], work_dir: Path, nnodes: int, nproc_per_node: int,
                endpoint: tuple[str, int], local_addr: str | None) -> dict[str, Any]:
    seq = int(msg["trial"])
    trial_dir = work_dir / f"trial-{seq:03d}"
    trial_dir.mkdir(parents=True, exist_ok=True)
    try:
        candidate = validate_env(msg.get("env") or {}, source=f"trial {seq} from the coordinator")
        files = dict(msg.get("files") or {})
        args = [str(a) for a in msg.get("worker_args") or []]
        timeout_s = min(float(msg.get("timeout_s", 180.0)), 24 * 3600.0)
        rdzv_id = str(msg["rdzv_id"])
        nccl_debug = msg.get("nccl_debug") is True
    except (NccltuneError, KeyError, TypeError, ValueError) as exc:
        log.error("trial %d: %s", seq, exc)
        return {"result": seq, "exit": EXIT_CONFIG, "err_tail": f"the joining node refused the trial: {exc}"[:300]}
    for name, local_name in SHIPPED_FILES.items():
        if name in candidate and name in files:
            local = trial_dir / local_name
            local.write_text(str(files[name]))
            candidate[name] = str(local)
    env = clean_env({**base_env, **candidate, "PYTHONUNBUFFERED": "1"})
    env.setdefault("OMP_NUM_THREADS", "1")
    if nccl_debug:
        # As the coordinator runs its own ranks, with the log in this node's trial directory.
        env.update(nccllog.debug_env(trial_dir))
    argv = torchrun_argv(python, nnodes=nnodes, nproc_per_node=nproc_per_node, endpoint=endpoint,
                         rdzv_id=rdzv_id, is_host=False, timeout_s=timeout_s, args=args,
                         local_addr=local_addr)
    started = time.monotonic()
    with open(trial_dir / "agent.out", "wb") as out, open(trial_dir / "agent.err", "wb") as err:
        # The agent dies with this process (as the runner's ranks do with theirs), its workers with it.
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=trial_dir, preexec_fn=die_with_parent(os.getpid()))
    log.info("trial %d: agent %d started", seq, proc.pid)
    try:
        deadline = started + timeout_s + KILL_GRACE_S
        while proc.poll() is None:
            got = peer.read(0.2)
            killed = any(m.get("kill") == seq for m in got)
            pending.extend(m for m in got if "kill" not in m)
            why = ("the coordinator ended it" if killed else "the coordinator is gone" if peer.closed
                   else "its timeout passed" if time.monotonic() > deadline else None)
            if why:
                log.warning("trial %d: stopping this node's agent: %s", seq, why)
                stop_tree(proc)
                break
    except BaseException:
        stop_tree(proc)
        raise
    code = proc.wait()
    _kill_all(_descendants(proc.pid))
    err_lines = _read(trial_dir / "agent.err").strip().splitlines()
    rank0_out = _read(trial_dir / "agent.out")[:MAX_MESSAGE_BYTES // 4]
    report: dict[str, Any] = {"result": seq, "exit": code, "wall_s": round(time.monotonic() - started, 2),
                              "rank0_out": rank0_out, "err_tail": err_lines[-1][:300] if err_lines else ""}
    if nccl_debug and rank0_out.strip():
        report.update(_rank0_log_payload(trial_dir, rank0_out))
    return report


def _rank0_log_payload(trial_dir: Path, rank0_out: str) -> dict[str, str]:
    """Rank 0 ran here (its JSON lines are on this agent's stdout): its NCCL log, packed, for the
    coordinator's runner; or why there is none."""
    pid = None
    for line in rank0_out.splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "start":
                pid = doc.get("pid")
                break
    path = nccllog.rank0_log(trial_dir, pid)
    if path is None:
        return {"nccl_log_missing": f"no NCCL log in {trial_dir}"}
    try:
        packed = nccllog.pack(nccllog.read_log(path))
    except OSError as exc:
        return {"nccl_log_missing": f"{path}: {exc.strerror}"}
    if len(packed) > MAX_MESSAGE_BYTES // 4:
        log.warning("%s: too large to send even compressed (%d bytes)", path, len(packed))
        return {"nccl_log_missing": f"{path} is over {MAX_MESSAGE_BYTES // 4} bytes compressed; it stays there"}
    return {"nccl_log": packed}


def _version() -> str:
    from .. import __version__

    return __version__


# -- Slurm ---------------------------------------------------------------------------------------------


def slurm_nodes(env: Mapping[str, str], scontrol: str = "scontrol") -> list[str]:
    """The allocation's host names, in order, from `scontrol show hostnames $SLURM_JOB_NODELIST`.

    Raises:
        UnavailableError: not in an allocation, or scontrol failed (exit 69).
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UnavailableError("SLURM_JOB_NODELIST is not set: srun trials need a Slurm allocation",
                               hint="run inside sbatch/salloc, or use --launcher torchrun")
    exe = shutil.which(scontrol, path=env.get("PATH")) or scontrol
    try:
        done = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60,
                              env=dict(env), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UnavailableError(f"scontrol show hostnames failed: {exc}") from exc
    hosts = done.stdout.split()
    if done.returncode != 0 or not hosts:
        raise UnavailableError(f"scontrol show hostnames {nodelist} failed: {done.stderr.strip()[:200]}")
    return hosts


def slurm_node_count(env: Mapping[str, str]) -> int:
    """Nodes of the enclosing allocation; 0 outside one."""
    if not env.get("SLURM_JOB_ID"):
        return 0
    text = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return int(text) if text.isdigit() else 1


SRUN_WAIT_S = 60  # srun --wait: a task that ended while others run means those others are stuck


class SrunLaunch(Launch):
    """One srun over the allocation's nodes per trial; rank 0's output comes back on srun's stdout.

    `nodelist`: the nodes of the step, the first one hosting task 0 (rank 0, MASTER_ADDR; sbatch
    runs its script there); `gpus_per_task`: GPUs bound to each task (0 for the CPU demo, whose
    allocation has none)."""

    launcher = "srun"

    def __init__(self, nnodes: int, ntasks_per_node: int, *, master_addr: str, master_port: int | None = None,
                 nodelist: Sequence[str] = (), gpus_per_task: int = 0, srun: str = "srun",
                 node_class: str | None = None) -> None:
        super().__init__(LaunchShape(nnodes, ntasks_per_node), node_class)
        self.master_addr = master_addr
        self.master_port = master_port
        self.nodelist = list(nodelist)
        self.gpus_per_task = gpus_per_task
        self.srun = srun

    def command(self, trial: TrialSpec, names: Sequence[str]) -> list[str]:
        """srun's command line for `trial`; `names`: the variables every task must get from srun's
        own environment (the candidate's, the rendezvous', NCCL's log settings). What each option
        does, as srun(1) documents it, is said beside it."""
        minutes = int(trial.timeout_s // 60) + 2  # Slurm's own limit is a backstop behind the runner's
        n, p = self.shape.nnodes, self.shape.ranks_per_node
        # An explicit task count: --gpus-per-task requires one.
        argv = [self.srun, "--nodes", str(n), "--ntasks", str(n * p), "--ntasks-per-node", str(p)]
        if self.nodelist:
            argv.append(f"--nodelist={','.join(self.nodelist)}")
        # block: consecutive tasks share a node, in node order, so task 0 runs on the first node.
        # Without an explicit distribution, a configured topology plugin orders tasks by topology.
        argv.append("--distribution=block")
        if self.gpus_per_task:
            # Implies --tres-bind=gres/gpu:per_task:N: each task is bound to its own GPU(s), and
            # Slurm sets CUDA_VISIBLE_DEVICES for each task to them (the worker takes the one it sees).
            argv.append(f"--gpus-per-task={self.gpus_per_task}")
        # --kill-on-bad-exit=1: the step is terminated as soon as any task exits non-zero (this takes
        # precedence over --wait; current Slurm documents it as needing proctrack/cgroup with
        # cgroup/v2). --wait: the remaining tasks are terminated this long after the first task
        # ends; without it, slurm.conf's WaitTime decides. The runner's timeout stays the last word.
        argv += ["--kill-on-bad-exit=1", f"--wait={SRUN_WAIT_S}"]
        # --export=ALL,NAMES: a name without a value passes srun's current value to every task (values
        # stay out of the list: it is comma-separated, and NCCL_IB_HCA's values hold commas). Given
        # on the command line, it wins over the export setting steps would otherwise inherit from
        # sbatch (--export=NONE, say): srun's command line options override its environment variables.
        argv.append(f"--export=ALL,{','.join(['MASTER_ADDR', 'MASTER_PORT', *names])}")
        return [*argv, f"--time={minutes}", trial.worker[0], str(RANKEXEC), "--slurm", str(WORKER),
                *worker_args(trial.worker)]

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        candidate = validate_env(trial.candidate, source="trial candidate")
        # The master port is chosen free here; sbatch runs its script on the allocation's first node,
        # so that is where rank 0 listens (elsewhere, give the port explicitly).
        port = self.master_port or free_port("0.0.0.0")
        env = {**clean_env(trial.env), **candidate, "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port)}
        names = sorted(candidate)
        if trial.nccl_log:
            # The log's path is this node's trial directory: rank 0, on this node, writes it there.
            names += sorted(set(nccllog.debug_env(trial.trial_dir)) - set(names))
        if self.gpus_per_task:
            env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm sets it for each task from its binding
        return [ProcSpec("srun", self.command(trial, names), env, "srun")]

    def stop(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        # srun passes SIGTERM to every task on every node; the runner's SIGKILL follows.
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S)

    def finish(self, trial_dir: Path) -> None:
        (trial_dir / "rank0.out").write_text(_read(trial_dir / "srun.out"))
        (trial_dir / "rank0.err").write_text(_read(trial_dir / "srun.err"))


# -- choosing one ----------------------------------------------------------------------------------------


def resolve_launcher(launcher: str, nnodes: int, env: Mapping[str, str]) -> str:
    """auto: srun inside an allocation of several nodes, torchrun for --nodes > 1, else local.

    Raises:
        UsageError: an impossible combination (exit 2).
    """
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    if launcher == "auto":
        if slurm_node_count(env) > 1:
            return "srun"
        return "torchrun" if nnodes > 1 else "local"
    if launcher == "local" and nnodes > 1:
        raise UsageError(f"--launcher local runs on this node only; --nodes {nnodes} needs torchrun or srun")
    if launcher == "srun" and not env.get("SLURM_JOB_ID"):
        raise UsageError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID is not set)",
                         hint="run inside sbatch/salloc, or use --launcher torchrun")
    return launcher


def make_launch(shape: LaunchShape, launcher: str, endpoint: tuple[str, int] | None, *,
                node_class: str | None = None, env: Mapping[str, str] | None = None, gpus: bool = False) -> Launch:
    """The Launch for a sweep of `shape` (`launcher` one of LAUNCHERS, `endpoint` the rendezvous;
    `gpus`: the ranks run on GPUs, one each, which srun then binds).

    Raises:
        UsageError: an impossible combination (exit 2); UnavailableError: Slurm asked for and
        scontrol cannot name the nodes (exit 69).
    """
    env = os.environ if env is None else env
    if shape.loopback:
        if launcher not in ("auto", "local"):
            raise UsageError(f"--loopback measures this node alone; it cannot run with --launcher {launcher}")
        return LocalLaunch(shape.nranks, loopback=True, node_class=node_class)
    choice = resolve_launcher(launcher, shape.nnodes, env)
    if choice == "local":
        return LocalLaunch(shape.ranks_per_node, node_class=node_class)
    if choice == "torchrun":
        ep = endpoint or (socket.getfqdn(), DEFAULT_RDZV_PORT)
        return TorchrunLaunch(shape.nnodes, shape.ranks_per_node, ep, node_class=node_class)
    nnodes = shape.nnodes if shape.nnodes > 1 else max(1, slurm_node_count(env))
    hosts = slurm_nodes(env)
    if nnodes > len(hosts):
        raise UsageError(f"--nodes {nnodes}: the allocation has {len(hosts)} node(s)")
    here = socket.gethostname().split(".")[0]
    if hosts[0].split(".")[0] != here:
        log.warning("rank 0 runs on %s, the allocation's first node, not on this node (%s): its NCCL log stays "
                    "there, and trials go without the algorithm and protocol per size; run the sweep on %s",
                    hosts[0], here, hosts[0])
    return SrunLaunch(nnodes, shape.ranks_per_node, master_addr=hosts[0],
                      master_port=endpoint[1] if endpoint else None, nodelist=hosts[:nnodes],
                      gpus_per_task=1 if gpus else 0, node_class=node_class)


@dataclass(frozen=True)
class LaunchRequest:
    """What the command line asked for; the pipeline turns it into a Launch once it knows the
    node's ranks (`build`)."""

    nodes: int = 1
    loopback: bool = False
    launcher: str = "auto"
    endpoint: tuple[str, int] | None = None
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), compare=False, repr=False)

    @property
    def single_node(self) -> bool:
        """Today's sweep: this node, its own ranks, no NIC loopback."""
        return resolve_launcher(self.launcher, self.nodes, self.env) == "local" and not self.loopback

    def shape(self, ranks_per_node: int) -> LaunchShape:
        return loopback_shape(ranks_per_node) if self.loopback else LaunchShape(self.nodes, ranks_per_node)

    def build(self, ranks_per_node: int, node_class: str | None = None, *, gpus: bool = False) -> Launch:
        return make_launch(self.shape(ranks_per_node), self.launcher, self.endpoint, node_class=node_class,
                           env=self.env, gpus=gpus)
