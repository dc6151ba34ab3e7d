"""Trials over several "nodes" on this machine: two torchrun agents joined by c10d rendezvous over
127.0.0.1 (the second one started by `nccltune sweep --join`), gloo, one rank per node, the real
worker; rank 0's NCCL log sent back from the node it ran on (NCCL's logging played by a stand-in:
NCCL cannot run here); workers dying with a killed agent; the srun command line a trial asks for
(trials through real Slurm: test_slurm_real.py); NIC loopback's environment and shape.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nccltune.cli import build_parser, main, sweep_launch_request
from nccltune.errors import EXIT_USAGE, UsageError
from nccltune.hw.procfs import descendants
from nccltune.sweep.plan import JobShape
from nccltune.trials import nccllog
from nccltune.trials.credentials import RANK_DIR
from nccltune.trials.launch.base import RANKEXEC, WORKER, LaunchShape, TrialSpec, make_launch, parse_endpoint
from nccltune.trials.launch.local import LocalLaunch
from nccltune.trials.launch.srun import SrunLaunch
from nccltune.trials.launch.torchrun import TorchrunLaunch, torchrun_argv
from nccltune.trials.runner import Runner, TrialResult
from nccltune.trials.worker import FAULT_VAR
from tests.twonodes import end, kill_under, multinode_key, node_env, port_pair, processes_in, wait_gone

pytest.importorskip("torch")

SIZES = [4096, 16384]


def _base_env(**extra: str) -> dict[str, str]:
    return node_env(**extra)


def _port_pair() -> int:
    return port_pair()


def _run(runner: Runner, candidate: dict[str, str]) -> TrialResult:
    return runner.run(candidate, SIZES, warmup=1, iters=2)


@pytest.fixture
def joiner_env() -> dict[str, str]:
    """Variables of the joining node's own environment (a test parametrizes it)."""
    return {}


@pytest.fixture
def coordinator_env() -> dict[str, str]:
    """Variables of the coordinating node's own environment (a test parametrizes it)."""
    return {}


@pytest.fixture
def coordinator_opts() -> dict[str, Any]:
    """TorchrunLaunch and Runner options of the coordinator (a test parametrizes them)."""
    return {}


@pytest.fixture(scope="module")
def standin_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter that loads tests/ncclstandin at every start, isolated (-I) or not: a .pth line
    puts it on sys.path, and site imports its sitecustomize; torch comes from this interpreter's
    site-packages. Ranks run isolated, so PYTHONPATH no longer reaches them."""
    venv = tmp_path_factory.mktemp("standin") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    (site,) = venv.glob("lib/python*/site-packages")
    mine = [p for p in sys.path if p.endswith("site-packages")]
    (site / "nccltune-standin.pth").write_text("\n".join([str(STANDIN), *mine]) + "\n")
    return str(venv / "bin" / "python")


@pytest.fixture
def two_nodes(tmp_path: Path, joiner_env: dict[str, str], coordinator_env: dict[str, str],
              coordinator_opts: dict[str, Any],
              standin_python: str) -> Iterator[tuple[Runner, subprocess.Popen[bytes], Path]]:
    """A coordinator (this process's Runner) and a joining node (`nccltune sweep --join`), their
    ranks run by standin_python."""
    extra = joiner_env
    port = _port_pair()
    join_state = tmp_path / "joiner"
    key_file, config = multinode_key(tmp_path)
    with open(tmp_path / "joiner.err", "wb") as err:
        # --demo: the joining node has no GPU here; it runs up to the demo's ranks.
        joiner = subprocess.Popen(
            [sys.executable, "-m", "nccltune", "sweep", "--join", f"127.0.0.1:{port}", "--demo", "--state-dir",
             str(join_state), "--config", str(config), "--python", standin_python, "-v"],
            env=_base_env(**extra), stdout=subprocess.PIPE, stderr=err, start_new_session=True, cwd=tmp_path)
    launch = TorchrunLaunch(2, 1, ("127.0.0.1", port), node_class="cpu-test", join_wait_s=120,
                            local_addr=coordinator_opts.get("local_addr"), key_file=str(key_file))
    runner = Runner(python=standin_python, backend="gloo", nranks=1, base_env=_base_env(**coordinator_env),
                    work_dir=tmp_path / "work", timeout_s=120, launch=launch,
                    nccl_debug=coordinator_opts.get("nccl_debug"))
    try:
        yield runner, joiner, join_state
    finally:
        launch.close()
        end(joiner)
        if joiner.stdout:
            joiner.stdout.close()
        kill_under(tmp_path)


def _left_below(pid: int, keep: set[int], wait_s: float = 15.0) -> set[int]:
    """Processes below `pid` other than `keep`, once they had `wait_s` to go (reaping takes a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = descendants(pid) - keep
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
    # The bound is waited out in full (the hang is only seen by its timeout): a short one.
    runner.timeout_s = 15
    hung = _run(runner, {"NCCL_ALGO": "Ring"})
    assert hung.status == "timeout"
    assert "no result within 15 s" in (hung.reason or "")
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


# -- rank 0's NCCL log, from the node it ran on ----------------------------------------------------

STANDIN = Path(__file__).resolve().parent / "ncclstandin"  # sitecustomize.py: writes logs as NCCL would
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("joiner_env", "coordinator_env", "coordinator_opts"), [(
    {"PYTHONPATH": f"{STANDIN}:{REPO}", "STANDIN_NCCL_VERSION": "2.28.9"},
    {"PYTHONPATH": f"{STANDIN}:{REPO}", "STANDIN_NCCL_VERSION": "2.27.3"},
    # torchrun numbers the nodes in the order of their addresses: the joining node (127.0.0.1)
    # before this one, so global rank 0 runs on the joining node.
    {"local_addr": "127.0.0.2", "nccl_debug": True})])
def test_rank_0s_nccl_log_comes_back_from_the_node_it_ran_on(
        two_nodes: tuple[Runner, subprocess.Popen[bytes], Path], tmp_path: Path) -> None:
    runner, _joiner, join_state = two_nodes
    result = _run(runner, {"NCCL_ALGO": "Ring"})
    assert result.status == "ok", result.reason
    here, there = tmp_path / "work" / "trial-001", join_state / "join" / "trial-001"
    assert (here / "agent.out").read_text() == "" and (there / "agent.out").read_text().strip()
    # Both nodes ran their ranks with the coordinator's debug variables, each log in its own
    # node's rank directory: rank 1 here, rank 0 (the pid its start record names) there.
    rank0 = there / RANK_DIR / f"nccl.{result.start['pid']}.log"
    (rank1,) = (here / RANK_DIR).glob("nccl.*.log")
    for log_file, version in ((rank0, "2.28.9"), (rank1, "2.27.3")):
        text = log_file.read_text()
        assert f"NCCL version {version}+cuda12.9" in text
        assert f"NCCL_DEBUG_SUBSYS set by environment to {nccllog.NCCL_DEBUG_SUBSYS}\n" in text
    assert "Bytes -> Algo" not in rank1.read_text()  # NCCL's TUNING lines come from rank 0 only
    # Rank 0's log came back with the joining node's report and is the one the trial was read from.
    assert (here / nccllog.RANK0_LOG).read_bytes() == rank0.read_bytes()
    assert result.nccl["version"] == "2.28.9"
    assert [(m.size_bytes, m.algo, m.proto, m.channels) for m in result.sizes] == [
        (size, "RING", "SIMPLE", 2) for size in SIZES]


STRAY_LOG = "/tmp/nccltune-test-stray-nccl.%p.log"


@pytest.mark.parametrize(("joiner_env", "coordinator_opts"), [(
    # The joining node's own environment asks for NCCL's log; the coordinator reads none.
    {"PYTHONPATH": f"{STANDIN}:{REPO}", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": STRAY_LOG},
    {"nccl_debug": False})])
def test_a_joining_node_writes_no_nccl_log_when_the_coordinator_reads_none(
        two_nodes: tuple[Runner, subprocess.Popen[bytes], Path], tmp_path: Path) -> None:
    runner, _joiner, join_state = two_nodes
    before = set(Path("/tmp").glob("nccltune-test-stray-nccl.*.log"))
    result = _run(runner, {"NCCL_ALGO": "Ring"})
    assert result.status == "ok", result.reason
    assert (join_state / "join" / "trial-001" / "agent.out").exists()
    assert set(Path("/tmp").glob("nccltune-test-stray-nccl.*.log")) == before
    assert not list((join_state / "join").rglob("nccl.*.log"))


def test_a_packed_nccl_log_unpacks_to_its_bytes_and_no_further(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"node-a:7001:7001 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}\n" * 2000
    packed = nccllog.pack(data)
    assert nccllog.unpack(packed) == data and len(packed) < len(data) // 10
    monkeypatch.setattr(nccllog, "MAX_LOG_BYTES", 1000)  # a peer's message must not unpack without bound
    assert nccllog.unpack(packed) == data[:1000]
    for bad in ("not base64 at all!", "aGVsbG8="):  # not base64; base64 of something not compressed
        with pytest.raises(ValueError, match="not a packed NCCL log"):
            nccllog.unpack(bad)


def test_rank_0s_log_is_the_one_sent_else_its_own_pid(tmp_path: Path) -> None:
    assert nccllog.rank0_log(tmp_path, 22) is None
    (tmp_path / RANK_DIR).mkdir()
    for pid in (11, 22):
        (tmp_path / RANK_DIR / f"nccl.{pid}.log").write_text(str(pid))
    assert nccllog.rank0_log(tmp_path, 22) == tmp_path / RANK_DIR / "nccl.22.log"
    # nccl-tests: one process, another pid
    assert nccllog.rank0_log(tmp_path, 99) == tmp_path / RANK_DIR / "nccl.11.log"
    (tmp_path / nccllog.RANK0_LOG).write_text("sent")
    assert nccllog.rank0_log(tmp_path, 22) == tmp_path / nccllog.RANK0_LOG
    env = nccllog.debug_env(tmp_path)
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": nccllog.NCCL_DEBUG_SUBSYS,
                   "NCCL_DEBUG_FILE": str(tmp_path / RANK_DIR / "nccl.%p.log")}


# -- workers die with their agent --------------------------------------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def test_workers_die_with_a_torchrun_agent_killed_by_sigkill(tmp_path: Path) -> None:
    import threading

    launch = TorchrunLaunch(1, 2, ("127.0.0.1", _port_pair()))
    runner = Runner(python=sys.executable, backend="gloo", nranks=2, base_env=_base_env(**{FAULT_VAR: "hang"}),
                    work_dir=tmp_path / "work", timeout_s=600, launch=launch)
    results: list[TrialResult] = []
    thread = threading.Thread(target=lambda: results.append(_run(runner, {})), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        agents: list[int] = []
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            procs = {pid: _cmdline(pid) for pid in processes_in(tmp_path)}
            agents = [pid for pid, argv in procs.items() if "torch.distributed.run" in argv]
            # After rankexec's exec: [python, -I, worker.py, ...], the death signal armed.
            workers = [pid for pid, argv in procs.items() if argv[1:3] == ["-I", str(WORKER)]]
        assert len(agents) == 1 and len(workers) == 2, (agents, workers)
        os.kill(agents[0], signal.SIGKILL)
        left = wait_gone(tmp_path, wait_s=60)
        assert not left, f"workers outlived their agent: {left}"
        thread.join(120)
        assert results and results[0].status == "crashed"
        assert "killed by signal SIGKILL" in (results[0].reason or "")
    finally:
        kill_under(tmp_path)
        thread.join(30)


def test_the_torchrun_command_line() -> None:
    argv = torchrun_argv("/opt/py/bin/python", nnodes=4, nproc_per_node=8, endpoint=("node-a", 29400),
                         rdzv_id="nccltune-ab12cd34-7", is_host=False, timeout_s=180,
                         args=["--backend", "nccl", "--sizes", "1024"])
    assert argv == ["/opt/py/bin/python", "-I", "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "8",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "node-a:29400", "--rdzv-id", "nccltune-ab12cd34-7",
                    "--rdzv-conf", "is_host=0,join_timeout=180,read_timeout=10", "--max-restarts", "0",
                    "--monitor-interval", "0.1", str(RANKEXEC), str(WORKER), "--backend", "nccl", "--sizes", "1024"]
    v6 = torchrun_argv("py", nnodes=2, nproc_per_node=1, endpoint=("fe80::1", 5), rdzv_id="x", is_host=True,
                       timeout_s=10, args=[], local_addr="127.0.0.1")
    assert v6[v6.index("--rdzv-endpoint") + 1] == "[fe80::1]:5"
    assert v6[v6.index("--rdzv-conf") + 1].startswith("is_host=1,join_timeout=30,")
    assert v6[v6.index("--local-addr") + 1] == "127.0.0.1"


# -- Slurm -----------------------------------------------------------------------------------------

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
    (bindir / "scontrol").write_text(SCONTROL_STANDIN)
    (bindir / "scontrol").chmod(0o755)
    return bindir


def test_srun_binds_one_gpu_per_task_and_gives_every_task_the_log_settings(slurm_bin: Path, tmp_path: Path) -> None:
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "node-[a-c]",
             "PATH": f"{slurm_bin}:{os.environ.get('PATH', '')}"}
    launch = make_launch(LaunchShape(2, 4), "srun", None, node_class="gpu-test", env=slurm, gpus=True)
    assert isinstance(launch, SrunLaunch) and launch.gpus_per_task == 1
    assert launch.nodelist == ["localhost", "node-b"] and launch.master_addr == "localhost"
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/usr/bin", "RANK": "3", **nccllog.debug_env(tmp_path)}
    worker = ["/opt/py/bin/python", str(WORKER), "--backend", "nccl", "--sizes", "1024"]
    (spec,) = launch.start(TrialSpec(5, tmp_path, worker, env, {"NCCL_ALGO": "Ring"}, 300, nccl_log=True))
    assert spec.argv == [
        "srun", "--nodes", "2", "--ntasks", "8", "--ntasks-per-node", "4", "--nodelist=localhost,node-b",
        "--distribution=block", "--gpus-per-task=1", "--kill-on-bad-exit=1", "--wait=60", "--label",
        "--export=ALL,MASTER_ADDR,MASTER_PORT,NCCLTUNE_DISABLE,NCCL_ALGO,NCCL_DEBUG,NCCL_DEBUG_FILE,NCCL_DEBUG_SUBSYS",
        "--time=7",
        "/opt/py/bin/python", "-I", str(RANKEXEC), "--slurm", str(WORKER), "--backend", "nccl", "--sizes", "1024"]
    # Slurm sets CUDA_VISIBLE_DEVICES for each task from its binding; an enclosing rank never leaks.
    assert "CUDA_VISIBLE_DEVICES" not in spec.env and "RANK" not in spec.env
    assert spec.env["NCCL_ALGO"] == "Ring" and spec.env["NCCL_DEBUG"] == "INFO"
    assert spec.env["NCCL_DEBUG_FILE"] == str(tmp_path / RANK_DIR / "nccl.%p.log")
    without = make_launch(LaunchShape(2, 4), "srun", None, env=slurm)
    assert isinstance(without, SrunLaunch) and without.gpus_per_task == 0
    plain = without.start(TrialSpec(5, tmp_path, worker, {"CUDA_VISIBLE_DEVICES": "0"}, {}, 300))[0]
    assert "--gpus-per-task=1" not in plain.argv and plain.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "--export=ALL,MASTER_ADDR,MASTER_PORT,NCCLTUNE_DISABLE" in plain.argv  # no candidate, no log settings


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


def test_a_fault_can_hit_one_candidate_on_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from nccltune.trials.worker import fault_for

    monkeypatch.setenv(FAULT_VAR, "hang:NCCL_ALGO=Ring")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    assert fault_for(0) is None
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert fault_for(0) == "hang" and fault_for(1) == "hang"
    monkeypatch.setenv(FAULT_VAR, "crash@1:NCCL_IB_HCA=mlx5_0:1")  # the value may hold a colon
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0:1")
    assert fault_for(1) == "crash" and fault_for(0) is None
    monkeypatch.delenv("NCCL_IB_HCA")
    assert fault_for(1) is None
    monkeypatch.setenv(FAULT_VAR, "wrong_sum@0")
    assert fault_for(0) == "wrong_sum" and fault_for(1) is None


def test_rankexec_maps_slurm_variables() -> None:
    from nccltune.trials.rankexec import rank_env

    env = rank_env({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)",
                    "RANK": "0"}, slurm=True)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("5", "1", "8", "4")
    with pytest.raises(KeyError):
        rank_env({}, slurm=True)
    assert rank_env({"RANK": "3"}, slurm=False) == {"RANK": "3"}
