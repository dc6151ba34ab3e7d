"""Trials over several "nodes" on this machine: two torchrun agents joined by c10d rendezvous over
127.0.0.1 (the second one started by `nccltune sweep --join`), gloo, one rank per node, the real
worker; srun through a stand-in that starts the tasks here the way srun does (Slurm itself cannot
run here), with the command line it was given checked; NIC loopback's environment and shape.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nccltune.cli import build_parser, main, sweep_launch_request
from nccltune.errors import EXIT_USAGE, UsageError
from nccltune.sweep.plan import JobShape
from nccltune.trials.launch import (
    RANKEXEC,
    WORKER,
    LaunchShape,
    LocalLaunch,
    SrunLaunch,
    TorchrunLaunch,
    TrialSpec,
    _descendants,
    make_launch,
    parse_endpoint,
    torchrun_argv,
)
from nccltune.trials.runner import Runner, TrialResult
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
SIZES = [4096, 16384]


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "SLURM_")) and k != FAULT_VAR}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", **extra)
    return env


def _port_pair() -> int:
    """A port P with P+1 free too (rendezvous and control channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair")


def _run(runner: Runner, candidate: dict[str, str]) -> TrialResult:
    return runner.run(candidate, SIZES, warmup=1, iters=2)


@pytest.fixture
def joiner_env() -> dict[str, str]:
    """Variables of the joining node's own environment (a test parametrizes it)."""
    return {}


@pytest.fixture
def two_nodes(tmp_path: Path, joiner_env: dict[str, str]) -> Iterator[tuple[Runner, subprocess.Popen[bytes], Path]]:
    """A coordinator (this process's Runner) and a joining node (`nccltune sweep --join`)."""
    extra = joiner_env
    port = _port_pair()
    join_state = tmp_path / "joiner"
    with open(tmp_path / "joiner.err", "wb") as err:
        joiner = subprocess.Popen(
            [sys.executable, "-m", "nccltune", "sweep", "--join", f"127.0.0.1:{port}", "--state-dir", str(join_state),
             "--python", sys.executable, "-v"],
            env=_base_env(**extra), stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    launch = TorchrunLaunch(2, 1, ("127.0.0.1", port), node_class="cpu-test", join_wait_s=120)
    runner = Runner(python=sys.executable, backend="gloo", nranks=1, base_env=_base_env(), work_dir=tmp_path / "work",
                    timeout_s=120, launch=launch)
    try:
        yield runner, joiner, join_state
    finally:
        launch.close()
        try:
            joiner.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(joiner.pid, signal.SIGKILL)
            joiner.wait()
        if joiner.stdout:
            joiner.stdout.close()


def _left_below(pid: int, keep: set[int], wait_s: float = 15.0) -> set[int]:
    """Processes below `pid` other than `keep`, once they had `wait_s` to go (reaping takes a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = set(_descendants(pid)) - keep
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_one_trial_across_two_torchrun_agents(two_nodes: tuple[Runner, subprocess.Popen[bytes], Path],
                                              tmp_path: Path) -> None:
    runner, joiner, join_state = two_nodes
    topo = tmp_path / "ncclTopology.xml"
    topo.write_text("<system version=\"1\"/>\n")
    result = _run(runner, {"NCCL_ALGO": "Ring", "NCCL_TOPO_FILE": str(topo)})
    assert result.status == "ok", result.reason
    assert result.start["world_size"] == 2 and result.start["backend"] == "gloo"
    assert [s.size_bytes for s in result.sizes] == SIZES and all(s.correct for s in result.sizes)
    assert result.shape == {"label": "2x1", "nnodes": 2, "ranks_per_node": 1, "loopback": False,
                            "launcher": "torchrun", "node_class": "cpu-test"}
    # The joining node ran the same trial id, with the topology file's text written on its side.
    copied = join_state / "join" / "trial-001" / "ncclTopology.xml"
    assert copied.read_text() == topo.read_text()

    # The candidate reaches the ranks of both nodes: a wrong result forced on rank 0, then on rank
    # 1, is seen each time, wherever the rendezvous placed that rank.
    for rank in (0, 1):
        wrong = _run(runner, {FAULT_VAR: f"wrong_sum@{rank}"})
        assert wrong.status == "wrong_result", (rank, wrong.status, wrong.reason)
        assert wrong.reason == "all-reduce result check failed"
    runner.launch.close()
    out, _ = joiner.communicate(timeout=60)
    assert joiner.returncode == 0
    assert b"Ran 3 trial(s)" in out


@pytest.mark.parametrize("joiner_env", [{FAULT_VAR: "hang"}])
def test_a_hang_on_one_node_is_killed_on_both_and_the_sweep_goes_on(
        two_nodes: tuple[Runner, subprocess.Popen[bytes], Path]) -> None:
    runner, joiner, join_state = two_nodes
    runner.timeout_s = 25
    hung = _run(runner, {"NCCL_ALGO": "Ring"})
    assert hung.status == "timeout"
    assert "no result within 25 s" in (hung.reason or "")
    assert hung.shape["label"] == "2x1"
    # Nothing of the trial is left on either node: here only the joining node's own process.
    assert _left_below(os.getpid(), {joiner.pid}) == set()
    assert _left_below(joiner.pid, set()) == set()
    # The joining node was told to stop its agent, and did so (its agent's exit went back).
    assert (join_state / "join" / "trial-001" / "agent.out").exists()

    # The next trial runs on both nodes again; its candidate sets the fault variable to a rank that
    # does not exist, which wins over the joining node's own value.
    runner.timeout_s = 120
    after = _run(runner, {FAULT_VAR: "hang@7"})
    assert after.status == "ok", after.reason
    assert after.start["world_size"] == 2


@pytest.mark.parametrize("joiner_env", [{FAULT_VAR: "crash"}])
def test_a_crash_on_one_node_ends_the_trial_on_both(two_nodes: tuple[Runner, subprocess.Popen[bytes], Path]) -> None:
    runner, joiner, _join_state = two_nodes
    crashed = _run(runner, {"NCCL_ALGO": "Ring"})
    # Whichever node tells first: the joining node's report, or this node's agent losing its peer.
    assert crashed.status == "crashed", crashed.reason
    assert "torchrun" in (crashed.reason or "")
    assert "no result within" not in (crashed.reason or "")
    assert _left_below(os.getpid(), {joiner.pid}) == set()
    assert _left_below(joiner.pid, set()) == set()


def test_the_torchrun_command_line() -> None:
    argv = torchrun_argv("/opt/py/bin/python", nnodes=4, nproc_per_node=8, endpoint=("node-a", 29400),
                         rdzv_id="nccltune-ab12cd34-7", is_host=False, timeout_s=180,
                         args=["--backend", "nccl", "--sizes", "1024"])
    assert argv == ["/opt/py/bin/python", "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "8",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "node-a:29400", "--rdzv-id", "nccltune-ab12cd34-7",
                    "--rdzv-conf", "is_host=0,join_timeout=180,read_timeout=10", "--max-restarts", "0",
                    "--monitor-interval", "0.5", str(RANKEXEC), str(WORKER), "--backend", "nccl", "--sizes", "1024"]
    v6 = torchrun_argv("py", nnodes=2, nproc_per_node=1, endpoint=("fe80::1", 5), rdzv_id="x", is_host=True,
                       timeout_s=10, args=[], local_addr="127.0.0.1")
    assert v6[v6.index("--rdzv-endpoint") + 1] == "[fe80::1]:5"
    assert v6[v6.index("--rdzv-conf") + 1].startswith("is_host=1,join_timeout=30,")
    assert v6[v6.index("--local-addr") + 1] == "127.0.0.1"


# -- Slurm -----------------------------------------------------------------------------------------

SRUN_STANDIN = """\
#!{python}
# Stands in for srun: records its argv and environment, then starts the tasks here as srun does
# (SLURM_PROCID etc. per task, stdout and stderr passed through), killing the rest on a bad exit.
import json, os, subprocess, sys
argv = sys.argv[1:]
with open({record!r}, "w") as fh:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, fh)
opts, i = {{}}, 0
while argv[i].startswith("--"):
    name, _, value = argv[i][2:].partition("=")
    if not value and name in ("nodes", "ntasks", "ntasks-per-node"):
        i += 1
        value = argv[i]
    opts[name] = value
    i += 1
cmd, ntasks, per_node = argv[i:], int(opts["ntasks"]), int(opts["ntasks-per-node"])
procs = []
for task in range(ntasks):
    env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task % per_node),
               SLURM_NODEID=str(task // per_node), SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(per_node))
    procs.append(subprocess.Popen(cmd, env=env))
codes = [p.wait() for p in procs]
sys.exit(max(abs(c) for c in codes))
"""

SCONTROL_STANDIN = """\
#!/bin/sh
# Stands in for `scontrol show hostnames LIST`: the allocation's first node is this machine.
[ "$1 $2" = "show hostnames" ] || exit 1
printf 'localhost\\nnode-b\\n'
"""


@pytest.fixture
def slurm_bin(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(SRUN_STANDIN.format(python=sys.executable, record=str(tmp_path / "srun.json")))
    (bindir / "scontrol").write_text(SCONTROL_STANDIN)
    for name in ("srun", "scontrol"):
        (bindir / name).chmod(0o755)
    return bindir


def test_srun_inside_an_allocation_builds_the_command_and_runs_the_trial(slurm_bin: Path, tmp_path: Path) -> None:
    path = f"{slurm_bin}:{os.environ.get('PATH', '')}"
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]", "PATH": path}
    launch = make_launch(LaunchShape(2, 1), "auto", None, node_class="cpu-test", env=slurm)
    assert isinstance(launch, SrunLaunch) and launch.master_addr == "localhost"
    runner = Runner(python=sys.executable, backend="gloo", nranks=1, base_env=_base_env(PATH=path, RANK="9"),
                    work_dir=tmp_path / "work", timeout_s=120, launch=launch)
    candidate = {"NCCL_ALGO": "Ring", "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1"}
    result = _run(runner, candidate)
    assert result.status == "ok", result.reason
    assert result.start["world_size"] == 2
    assert result.shape == {"label": "2x1", "nnodes": 2, "ranks_per_node": 1, "loopback": False,
                            "launcher": "srun", "node_class": "cpu-test"}
    seen = json.loads((tmp_path / "srun.json").read_text())
    worker_args = ["--backend", "gloo", "--sizes", "4096,16384", "--warmup", "1", "--iters", "2", "--timeout-s", "120"]
    assert seen["argv"] == [
        str(slurm_bin / "srun"), "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
        "--export=ALL,MASTER_ADDR,MASTER_PORT,NCCL_ALGO,NCCL_IB_HCA", "--time=4",
        sys.executable, str(RANKEXEC), "--slurm", str(WORKER), *worker_args]
    env = seen["env"]
    assert env["NCCL_IB_HCA"] == "mlx5_0:1,mlx5_1:1" and env["NCCL_ALGO"] == "Ring"
    assert env["MASTER_ADDR"] == "localhost" and env["MASTER_PORT"].isdigit()
    assert "RANK" not in env  # an enclosing launch's rank never reaches srun's tasks


def test_srun_refuses_a_candidate_that_is_not_safe(slurm_bin: Path, tmp_path: Path) -> None:
    launch = SrunLaunch(2, 1, master_addr="localhost", master_port=29500)
    trial = TrialSpec(1, tmp_path, [sys.executable, str(WORKER)], {}, {"NCCL_ALGO": "Ring;reboot"}, 60)
    with pytest.raises(Exception, match="NCCL_ALGO"):
        launch.start(trial)


# -- NIC loopback ----------------------------------------------------------------------------------


def test_loopback_ranks_get_p2p_and_shm_off_and_a_shape_of_their_own(tmp_path: Path) -> None:
    launch = LocalLaunch(2, loopback=True)
    env = {"NCCL_NET_DISABLE_INTRA": "1", "NCCL_P2P_DISABLE": "0", "NCCL_ALGO": "Ring"}
    specs = launch.start(TrialSpec(1, tmp_path, [sys.executable, str(WORKER)], env, {"NCCL_ALGO": "Ring"}, 60))
    assert [s.name for s in specs] == ["rank0", "rank1"]
    for rank, spec in enumerate(specs):
        assert spec.env["NCCL_P2P_DISABLE"] == "1" and spec.env["NCCL_SHM_DISABLE"] == "1"
        assert "NCCL_NET_DISABLE_INTRA" not in spec.env
        assert spec.env["NCCL_ALGO"] == "Ring" and spec.env["RANK"] == str(rank) and spec.env["WORLD_SIZE"] == "2"
    assert launch.shape == LaunchShape(nnodes=2, ranks_per_node=1, loopback=True)
    assert launch.shape.label == "2x1-nic-loopback"
    assert launch.shape.label != LaunchShape(2, 1).label  # never applied to a real two-node job
    assert launch.shape.plan_shape() == JobShape(nnodes=1, loopback=True)
    plain = LocalLaunch(2).start(TrialSpec(1, tmp_path, [sys.executable, str(WORKER)], env, {}, 60))
    assert plain[0].env["NCCL_P2P_DISABLE"] == "0" and "NCCL_SHM_DISABLE" not in plain[0].env


def test_a_loopback_trial_is_recorded_with_its_shape(tmp_path: Path) -> None:
    runner = Runner(python=sys.executable, backend="gloo", nranks=2, base_env=_base_env(), work_dir=tmp_path,
                    timeout_s=120, launch=make_launch(LaunchShape(2, 1, loopback=True), "auto", None))
    result = _run(runner, {})
    assert result.status == "ok", result.reason
    assert result.shape["label"] == "2x1-nic-loopback" and result.shape["loopback"] is True


# -- the command line ------------------------------------------------------------------------------


def _args(*argv: str) -> object:
    return build_parser().parse_args(["sweep", *argv])


def test_launch_options_are_checked_together() -> None:
    assert sweep_launch_request(_args(), {}) is None  # today's sweep
    req = sweep_launch_request(_args("--nodes", "2", "--rdzv-endpoint", "node-a:29400"), {})
    assert req is not None and req.nodes == 2 and req.endpoint == ("node-a", 29400)
    assert req.shape(8) == LaunchShape(2, 8)
    loop = sweep_launch_request(_args("--loopback"), {})
    assert loop is not None and loop.shape(4).label == "4x1-nic-loopback"
    slurm = {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2"}
    assert sweep_launch_request(_args(), slurm) is not None  # auto: srun in an allocation of two nodes
    for bad, words in ((("--loopback", "--nodes", "2"), "does not go with --nodes 2"),
                       (("--loopback", "--launcher", "torchrun"), "does not go with --launcher torchrun"),
                       (("--nodes", "2", "--launcher", "local"), "--launcher local"),
                       (("--nodes", "0"), "--nodes 0"),
                       (("--nodes", "2", "--rdzv-endpoint", "node-a"), "HOST:PORT"),
                       (("--nodes", "2", "--rdzv-endpoint", "node-a:65535"), "HOST:PORT"),
                       (("--rdzv-endpoint", "node-a:29400"), "several nodes"),
                       (("--launcher", "srun"), "Slurm allocation")):
        with pytest.raises(UsageError, match=words):
            sweep_launch_request(_args(*bad), {})
    assert parse_endpoint("[fe80::1]:29400") == ("fe80::1", 29400)


def test_join_refuses_shape_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--join", "node-a:29400", "--nodes", "2"]) == EXIT_USAGE
    assert "--join takes its shape from the coordinator: drop --nodes" in capsys.readouterr().err


def test_rankexec_maps_slurm_variables() -> None:
    from nccltune.trials.rankexec import rank_env

    env = rank_env({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)",
                    "RANK": "0"}, slurm=True)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("5", "1", "8", "4")
    with pytest.raises(KeyError):
        rank_env({}, slurm=True)
    assert rank_env({"RANK": "3"}, slurm=False) == {"RANK": "3"}



def test_a_joining_node_refuses_a_candidate_outside_nccls_variables(tmp_path: Path) -> None:
    """The receiving end validates too: a peer on the control port cannot set LD_PRELOAD."""
    import threading

    from nccltune import __version__
    from nccltune.trials.launch import join

    port = _port_pair()
    server = socket.create_server(("127.0.0.1", port + 1))
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(join(
        ("127.0.0.1", port), python=sys.executable, base_env={}, work_dir=tmp_path, connect_wait_s=30)))
    thread.start()
    conn, _ = server.accept()
    with conn, conn.makefile("rwb") as stream:
        assert json.loads(stream.readline()) == {"hello": socket.gethostname(), "version": __version__}
        for doc in ({"welcome": 2, "nproc_per_node": 1},
                    {"trial": 1, "rdzv_id": "x-1", "env": {"LD_PRELOAD": "/tmp/evil.so"}, "worker_args": []}):
            stream.write(json.dumps(doc).encode() + b"\n")
        stream.flush()
        got = json.loads(stream.readline())
        stream.write(b'{"stop": true}\n')
        stream.flush()
    thread.join(30)
    server.close()
    assert got["result"] == 1 and got["exit"] == 78
    assert "LD_PRELOAD" in got["err_tail"]
    assert done == [1]
