"""torchrun agents joined by c10d rendezvous: the coordinator's launch and a joining node's loop."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import EXIT_CONFIG, InputError, NccltuneError, UnavailableError, UsageError
from ...files.inputfile import loads_strict, read_bounded, read_input_file
from ...files.trust import ensure_dir, python_argv
from ...logsetup import escaped
from ...publish import OWN_TOPOLOGY, TOPO_FILE_VAR, validate_env
from ...topology.ncclxml import MAX_XML_BYTES
from .. import credentials, nccllog, rankexec
from ..held import Child, Held, below
from ..trialenv import RankSide, TrialEnv
from .admission import job_addresses
from .base import (
    KILL_GRACE_S,
    Launch,
    LaunchShape,
    ProcSpec,
    TrialSpec,
    clean_env,
    host_port,
    is_loopback,
    rank_argv,
    read_text,
    worker_args,
)
from .channel import CONTROL_PORT_OFFSET, ControlServer, handshake
from .messages import (
    DEBUG_VARIABLES,
    MAX_NCCL_LOG_CHARS,
    MAX_RANK0_OUT_CHARS,
    SHIPPED_FILES,
    check_trial,
    check_welcome,
    fit_report,
    trial_seq,
)
from .sealing import KEY_FILE, MAX_TAIL_CHARS, Peer, load_key
from .slurm import allocation_hosts

if TYPE_CHECKING:
    from .base import LaunchRequest

if TYPE_CHECKING:
    from ..container import Container

log = logging.getLogger(__name__)

DEFAULT_RDZV_PORT = 29400  # torchrun's own default for c10d
# torchrun's worker polling, its own default on 2.x (5 s before): a trial ends when the agent sees
# its ranks' exit, up to one interval after it.
MONITOR_INTERVAL_S = 0.1


def torchrun_argv(python: str, *, nnodes: int, nproc_per_node: int, endpoint: tuple[str, int], rdzv_id: str,
                  is_host: bool, timeout_s: float, args: Sequence[str], local_addr: str | None = None,
                  monitor_interval_s: float = MONITOR_INTERVAL_S) -> list[str]:
    """One node's torchrun agent for one trial, running rankexec.py -> worker.py with `args`."""
    # join_timeout: a node that never comes must not keep the others waiting past the trial;
    # read_timeout: how long an agent waits on a store that stopped answering.
    conf = f"is_host={1 if is_host else 0},join_timeout={max(30, int(timeout_s))},read_timeout=10"
    # Isolated (-I), as every Python nccltune starts; the agent's workers run rankexec.py, which
    # starts the worker isolated too.
    argv = [*python_argv(python, "-m", "torch.distributed.run"), "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", host_port(*endpoint), "--rdzv-id", rdzv_id,
            "--rdzv-conf", conf, "--max-restarts", "0", "--monitor-interval", f"{monitor_interval_s:g}"]
    if local_addr:
        argv += ["--local-addr", local_addr]
    return [*argv, *rank_argv(args)]


def stop_tree(proc: Child, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM `proc` (a torchrun agent or srun, in its own session), SIGKILL it and everything
    below it after `grace_s`. The tree is read first, every process in it held by a pidfd
    (trials.held.below): once the agent dies its workers are orphans, no longer found below it,
    and a held worker is signalled through its pidfd or not at all. An agent already reaped has
    nothing below it to find (its workers were given to another parent as it died, and die with
    it: rankexec.die_with_parent)."""
    if proc.poll() is not None:
        return
    tree = below(proc.held)
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    # Workers started after the first look (a rendezvous finishing meanwhile) are below it too.
    if proc.poll() is None:
        seen = {h.pid for h in tree}
        tree += [h for h in below(proc.held) if h.pid not in seen]
    _kill_all([proc.held, *tree])
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _kill_all(tree: Sequence[Held]) -> None:
    # A worker leads its own session, so its pid is its group: Held.kill ends both.
    for held in tree:
        held.kill()


def from_request(request: LaunchRequest, shape: LaunchShape, *, node_class: str | None = None,
                 gpus: bool = False) -> TorchrunLaunch:
    """The registry's factory: agents at the request's endpoint (this node's own for one node),
    the allocation's nodes admitted first where it runs in one.

    Raises:
        UsageError: several nodes without an endpoint (exit 2).
    """
    if request.endpoint is None and shape.nnodes > 1:
        # The control channel listens on exactly the address given, never one of its own choosing.
        raise UsageError(f"--nodes {shape.nnodes} with torchrun needs --rdzv-endpoint HOST:PORT: the address of "
                         "this node that the other nodes reach (the rendezvous and the control channel listen "
                         "there, on PORT and PORT+1)")
    return TorchrunLaunch(shape.nnodes, shape.ranks_per_node, request.endpoint or ("127.0.0.1", DEFAULT_RDZV_PORT),
                          node_class=node_class, key_file=request.key_file or KEY_FILE,
                          job_hosts=allocation_hosts(request.env) if shape.nnodes > 1 else (), image=request.image)


class TorchrunLaunch(Launch):
    """One torchrun agent per node and trial, c10d rendezvous; this node coordinates."""

    launcher = "torchrun"

    def __init__(self, nnodes: int, nproc_per_node: int, endpoint: tuple[str, int], *,
                 node_class: str | None = None, local_addr: str | None = None, join_wait_s: float = 600.0,
                 key_file: str = KEY_FILE, job_hosts: Sequence[str] = (), image: str | None = None) -> None:
        """`job_hosts`: the job's nodes where they are known (a Slurm allocation's), whose
        connections the control channel admits first (admission.job_addresses); `image`: the
        digest of bench.image (None: on the host), which every joining node must measure in too."""
        super().__init__(LaunchShape(nnodes, nproc_per_node), node_class)
        self.endpoint = endpoint
        self.key_file = key_file
        self.job_hosts = list(job_hosts)
        self.local_addr = local_addr if local_addr else ("127.0.0.1" if is_loopback(endpoint[0]) else None)
        self.join_wait_s = join_wait_s
        self.image = image
        self._token = secrets.token_hex(4)
        self._control: ControlServer | None = None
        self._trial_dir: Path | None = None

    def rdzv_id(self, seq: int) -> str:
        return f"nccltune-{self._token}-{seq}"

    def _server(self) -> ControlServer:
        """The control channel, listening from the first trial on (the key read then: exit 78 without it)."""
        if self._control is None:
            host, port = self.endpoint
            self._control = ControlServer(host, port + CONTROL_PORT_OFFSET, key=load_key(self.key_file),
                                          joiners=self.shape.nnodes - 1, nproc_per_node=self.shape.ranks_per_node,
                                          join_wait_s=self.join_wait_s, job_peers=job_addresses(self.job_hosts),
                                          image=self.image)
        return self._control

    def prepare(self) -> None:
        """Every other node joined and authenticated before the trial's clock starts."""
        if self.shape.nnodes > 1:
            self._server().admit()

    def start(self, trial: TrialSpec) -> list[ProcSpec]:
        candidate = validate_env(trial.candidate, source="trial candidate")
        self._trial_dir = trial.trial_dir
        rdzv_id = self.rdzv_id(trial.seq)
        args = worker_args(trial.worker)
        if self.shape.nnodes > 1:
            # The candidate as it is (the marker for nccltune's topology file): each node resolves it.
            msg = {"trial": trial.seq, "rdzv_id": rdzv_id, "env": candidate, "files": _file_payload(trial),
                   "worker_args": args, "timeout_s": trial.timeout_s, "nccl_debug": trial.nccl_log}
            check_trial(msg)  # what the joiners would refuse is refused here, before anything starts
            self._server().publish(msg)
        argv = torchrun_argv(trial.worker[0], nnodes=self.shape.nnodes, nproc_per_node=self.shape.ranks_per_node,
                             endpoint=self.endpoint, rdzv_id=rdzv_id, is_host=True, timeout_s=trial.timeout_s,
                             args=args, local_addr=self.local_addr)
        return [ProcSpec("agent", argv, clean_env(trial.env), "torchrun on this node")]

    def poll(self) -> str | None:
        return self._control.failure() if self._control is not None else None

    def stop(self, procs: Sequence[Child]) -> None:
        if self._control is not None:
            self._control.kill()
        for proc in procs:
            stop_tree(proc)

    def finish(self, trial_dir: Path) -> None:
        """Rank 0's output from the node it ran on: this one, or the joiner whose report carries it,
        with its NCCL log (nccllog.RANK0_LOG)."""
        remote = self._control.collect(KILL_GRACE_S * 2) if self._control is not None else []
        local = read_text(trial_dir / "agent.out")
        text = local
        if not local.strip():
            rank0 = next((r for r in remote if str(r.get("rank0_out", "")).strip()), None)
            text = str(rank0["rank0_out"]) if rank0 else ""
            if rank0 is not None:
                _write_rank0_log(trial_dir, rank0)
        (trial_dir / "rank0.out").write_text(text)
        (trial_dir / "rank0.err").write_text(read_text(trial_dir / "agent.err", tail=True))

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
                    escaped(report["nccl_log_missing"]))


def _file_payload(trial: TrialSpec) -> dict[str, str]:
    """Files the candidate names (SHIPPED_FILES), by variable: their text travels, paths are node-local."""
    out = {}
    candidate = trial.resolved_candidate
    for name in SHIPPED_FILES:
        path = candidate.get(name)
        if path:
            try:
                # A site may pin its own file here: a regular one, bounded as every input is.
                raw = read_input_file(Path(path), MAX_XML_BYTES, f"{name} file")
            except OSError as exc:
                raise UnavailableError(f"{name} {path}: {exc.strerror}") from exc
            try:
                out[name] = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(path, f"not UTF-8 (byte {exc.start})") from None
    return out


# -- a joining node ----------------------------------------------------------------------------------


def join(endpoint: tuple[str, int], *, python: str, base_env: Mapping[str, str], work_dir: Path,
         max_ranks: int, connect_wait_s: float = 600.0, user: str | None = None, key_file: str = KEY_FILE,
         container: Container | None = None) -> int:
    """Run trials for the coordinator at `endpoint` until it says stop, with as many ranks on this
    node as the coordinator runs on its own (at most `max_ranks`), as `user` (bench.user:
    trials.credentials), after both ends proved they hold the key in `key_file`; with `container`
    (bench.image) each trial's agent and its ranks run in that image, `python` being the image's.
    Returns the trial count.

    Raises:
        UnavailableError: the coordinator cannot be reached, did not authenticate, refused this
            node, asked for more ranks than `max_ranks` or broke the channel's rules (exit 69).
        InputError: the key file is missing or unsafe, or `user` does not exist or cannot run the
            worker (exit 78).
    """
    key = load_key(key_file)
    rank = credentials.rank_user(user)
    if container is None:
        credentials.check_reachable(python, [Path(rankexec.__file__)], rank)
    host, port = endpoint
    local_addr = "127.0.0.1" if is_loopback(host) else None
    name = f"the coordinator at {host_port(host, port)}"
    peer, nnodes, nproc_per_node = handshake(host, port + CONTROL_PORT_OFFSET, connect_wait_s, name, key,
                                             str(key_file), image=container.image.digest if container else None)
    pending = peer.pending
    trials = 0
    try:
        check_welcome(nnodes, nproc_per_node, max_ranks, name)
        while not peer.closed:
            if not pending:
                pending.extend(peer.read(3600.0))
            while pending:
                msg = pending.pop(0)
                if msg.get("stop") is True:
                    return trials
                if "trial" in msg:
                    if trial_seq(msg) is None:
                        raise UnavailableError(f"{name} sent a trial without a trial number "
                                               f"({str(msg.get('trial'))[:40]!r}); stopping")
                    trials += 1
                    # Messages that arrive during the trial, other than its kill, wait in `pending`.
                    report = _join_trial(msg, peer, pending, python=python, base_env=base_env, work_dir=work_dir,
                                         rank=rank, nnodes=nnodes, nproc_per_node=nproc_per_node, endpoint=endpoint,
                                         local_addr=local_addr, container=container)
                    peer.send(fit_report(report))
        if peer.failure:
            raise UnavailableError(f"{name}: {peer.failure}; stopping")
        log.warning("the coordinator closed the connection")
        return trials
    finally:
        peer.close()


def _join_trial(msg: Mapping[str, Any], peer: Peer, pending: list[dict[str, Any]], *, python: str,
                base_env: Mapping[str, str], work_dir: Path, rank: credentials.RankUser | None, nnodes: int,
                nproc_per_node: int, endpoint: tuple[str, int], local_addr: str | None,
                container: Container | None = None) -> dict[str, Any]:
    seq = int(msg["trial"])
    try:
        order = check_trial(msg)
    except NccltuneError as exc:
        log.error("%s", escaped(exc))
        return {"result": seq, "exit": EXIT_CONFIG,
                "err_tail": f"the joining node refused the trial: {escaped(exc)}"[:MAX_TAIL_CHARS]}
    trial_dir = work_dir / f"trial-{seq:03d}"
    ensure_dir(trial_dir, "trial directory")
    candidate, nccl_debug, timeout_s, rdzv_id, args = (dict(order.env), order.nccl_debug, order.timeout_s,
                                                       order.rdzv_id, order.worker_args)
    topology_file = None
    if TOPO_FILE_VAR in candidate:  # SHIPPED_FILES' file
        # The file this node writes itself, from the text that came; whatever value came stands for
        # it (the marker), so no path from elsewhere reaches a rank.
        topology_file = trial_dir / SHIPPED_FILES[TOPO_FILE_VAR]
        topology_file.write_text(order.files[TOPO_FILE_VAR])
        candidate[TOPO_FILE_VAR] = OWN_TOPOLOGY
    rank_dir = credentials.fresh_rank_dir(trial_dir, rank)
    # This node's fixed part: no rank variable of its caller, and NCCL's log written when the
    # coordinator reads it (nccl_debug, as it runs its own ranks, in this node's trial directory) only.
    fixed = {k: v for k, v in clean_env(base_env).items() if k not in DEBUG_VARIABLES}
    env = TrialEnv(fixed, candidate).for_ranks(RankSide(topology_file, trial_dir, rank_dir,
                                                        credentials.cache_dir(work_dir, rank), rank, nccl_debug))
    argv = torchrun_argv(python, nnodes=nnodes, nproc_per_node=nproc_per_node, endpoint=endpoint,
                         rdzv_id=rdzv_id, is_host=False, timeout_s=timeout_s, args=args,
                         local_addr=local_addr)
    # In the image (bench.image): the runtime starts as root and makes the agent bench.user itself
    # (enroot runs as its caller), named so that a stopped trial's container is removed.
    name = f"nccltune-{os.getpid()}-{seq}-agent" if container is not None else None
    spawn_env, switch = env, rank
    if container is not None:
        argv = container.argv(argv, env, trial_dir, rank_dir, name)
        spawn_env = container.runtime_env(env)
        switch = None if container.switches_user else rank
    started = time.monotonic()
    with open(trial_dir / "agent.out", "wb") as out, open(trial_dir / "agent.err", "wb") as err:
        # The agent dies with this process (as the runner's ranks do with theirs), its workers with it;
        # it runs as the rank user, as the runner's do.
        proc = Child(argv, env=spawn_env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                     cwd=rank_dir, preexec_fn=credentials.rank_preexec(os.getpid(), switch))
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
                _stop(proc, container, name)
                break
    except BaseException:
        _stop(proc, container, name)
        raise
    code = proc.wait()
    err_lines = read_text(trial_dir / "agent.err", tail=True).strip().splitlines()
    rank0_out = _head(trial_dir / "agent.out", MAX_RANK0_OUT_CHARS)
    report: dict[str, Any] = {"result": seq, "exit": code, "wall_s": round(time.monotonic() - started, 2),
                              "rank0_out": rank0_out, "err_tail": err_lines[-1][:MAX_TAIL_CHARS] if err_lines else ""}
    if nccl_debug and rank0_out.strip():
        report.update(_rank0_log_payload(trial_dir, rank0_out))
    return report


def _stop(proc: Child, container: Container | None, name: str | None) -> None:
    """End a trial's agent; in the image, its container too (a killed client may leave it running)."""
    stop_tree(proc)
    if container is not None and name is not None:
        container.remove([name])


def _rank0_log_payload(trial_dir: Path, rank0_out: str) -> dict[str, str]:
    """Rank 0 ran here (its JSON lines are on this agent's stdout): its NCCL log, packed, for the
    coordinator's runner; or why there is none."""
    pid = None
    for line in rank0_out.splitlines():
        with contextlib.suppress(ValueError):
            doc = loads_strict(line)
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
    if len(packed) > MAX_NCCL_LOG_CHARS:
        log.warning("%s: too large to send even compressed (%d bytes)", path, len(packed))
        return {"nccl_log_missing": f"{path} is over {MAX_NCCL_LOG_CHARS} bytes compressed; it stays there"}
    return {"nccl_log": packed}


def _head(path: Path, limit: int) -> str:
    """The first `limit` characters of a file (what a report carries), "" when there is none."""
    try:
        # A character is at most 4 bytes of UTF-8.
        return read_bounded(path, 4 * limit).data.decode(errors="replace")[:limit]
    except OSError:
        return ""
