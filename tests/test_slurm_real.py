"""Slurm itself: slurmctld and two slurmd on this machine (tests/slurm/cluster.sh, one cluster for
the session), the TaskProlog installed as slurm.conf's TaskProlog the way docs/slurm.md says, and
sweeps whose trials are srun steps, from sbatch and from salloc.

The nodes are this machine's host name and `localhost`; Slurm lists them in its own order, and
the first of that order is where an allocation's batch script and rank 0 run. Where Slurm cannot
be installed (not root, no apt-get) the tests are skipped, saying why; in CI (CI=true) that fails.
Sweeps use the shortest demo sweep there is (one collective, no variable swept: the defaults, the
topology file, one final), and crash, hang and placement run single trials through the runner
inside an allocation held for the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from twonodes import node_env, processes_in, wait_gone

from nccltune.errors import UnavailableError, UsageError
from nccltune.sweep.space import CATALOGUE
from nccltune.topology.source import bundled_topologies_dir
from nccltune.trials.launch.base import WORKER, LaunchShape, TrialSpec, make_launch
from nccltune.trials.launch.srun import SrunLaunch
from nccltune.trials.launch.srun import task_lines as task_output
from nccltune.trials.runner import Runner
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

TESTS = Path(__file__).resolve().parent
CLUSTER = TESTS / "slurm" / "cluster.sh"
SNAPSHOT = bundled_topologies_dir() / "h200x2-nvswitch-vm.json"
# Nothing swept: the defaults twice, the topology file alone, one final and a last baseline.
SWEEP_CONFIG = {
    "sweep": {"profile": "one", "profiles": {"one": {"all_reduce": {"4KiB": 1, "64KiB": 1}}},
              "baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1, "exclude": sorted(CATALOGUE)},
    "tuner": {"plugin": "keep"},
}
JOB_S = 600  # bound for one job's commands on a loaded 2-core machine


@dataclass(frozen=True)
class Slurm:
    """The running cluster: its directory (slurm.conf, the prolog's published files) and its nodes
    in Slurm's order."""

    root: Path
    nodes: tuple[str, ...]

    @property
    def published(self) -> Path:
        return self.root / "published"

    def env(self, **extra: str) -> dict[str, str]:
        return node_env(SLURM_CONF=str(self.root / "slurm.conf"), **extra)

    def run(self, *argv: str | Path, timeout: float = JOB_S, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                              env=self.env(**extra), stdin=subprocess.DEVNULL)


def free_ports() -> int:
    """A port P below the ephemeral range with P+1 and P+2 free as well (slurmctld, the two slurmd):
    another cluster on this machine keeps its own."""
    for base in range(6917, 7917, 3):
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + 3):
                    s = stack.enter_context(socket.socket())
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no three free ports in 6917-7919")


def _unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the Slurm tests must run in CI: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    installed = subprocess.run(["bash", str(CLUSTER), "install"], capture_output=True, text=True, timeout=900)
    if installed.returncode != 0:
        _unavailable(f"Slurm cannot be installed here: {installed.stderr.strip()[-300:]}")
    if os.geteuid() != 0:
        _unavailable("the Slurm tests run slurmd, which needs root")
    root = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(root)], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "NCCLTUNE_TEST_SLURMCTLD_PORT": str(free_ports())})
    try:
        assert started.returncode == 0, started.stderr
        cluster = Slurm(root, ())
        listed = cluster.run("sinfo", "-h", "-o", "%N", timeout=60)
        hosts = cluster.run("scontrol", "show", "hostnames", listed.stdout.strip(), timeout=60)
        cluster = Slurm(root, tuple(hosts.stdout.split()))
        assert len(cluster.nodes) == 2, (listed, hosts)
        yield cluster
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(root)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def published(slurm: Slurm) -> Iterator[Path]:
    """A published pair in the state directory the cluster's TaskProlog reads, removed after."""
    every, single = slurm.published / "nccl.env", slurm.published / "nccl-single-node.env"
    every.write_text("# nccltune\nNCCL_ALGO=Ring\n")
    single.write_text("# nccltune\nNCCL_MIN_NCHANNELS=32\n")
    for f in (every, single):
        f.chmod(0o644)
    yield every
    for f in (every, single):
        f.unlink(missing_ok=True)


@dataclass(frozen=True)
class Allocation:
    job: str
    env: dict[str, str]


@contextlib.contextmanager
def allocation(slurm: Slurm, *flags: str) -> Iterator[Allocation]:
    """An allocation held without a shell (salloc --no-shell), and the environment salloc's shell
    would have in it; cancelled on the way out."""
    got = slurm.run("salloc", "--no-shell", *flags, timeout=120)
    assert got.returncode == 0, got.stderr
    job = got.stderr.split("Granted job allocation")[1].split()[0]
    try:
        fields = slurm.run("squeue", "-h", "-j", job, "-o", "%N %D", timeout=60).stdout.split()
        nodelist, count = fields
        cpus = slurm.run("scontrol", "show", "job", job, timeout=60).stdout
        per_node = cpus.split("NumCPUs=")[1].split()[0]
        env = slurm.env(SLURM_JOB_ID=job, SLURM_JOB_NODELIST=nodelist, SLURM_JOB_NUM_NODES=count,
                        SLURM_JOB_CPUS_PER_NODE=f"{int(per_node) // int(count)}(x{count})")
        yield Allocation(job, env)
    finally:
        slurm.run("scancel", job, timeout=60)


def steps_of(slurm: Slurm, job: str) -> list[str]:
    return slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%i", timeout=60).stdout.split()


# The states of a job that has ended; COMPLETING is still ending (its steps are being cleaned up).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}


def sbatch_wait(slurm: Slurm, *argv: str | Path) -> subprocess.CompletedProcess[str]:
    """`sbatch --wait ARGV` without sbatch's own wait, which looks at the job after 2, 10, 42, 74 s
    (and so on): the job submitted, then its state asked every 0.25 s until it has ended (a record
    slurmctld keeps MinJobAge = 60 s). sbatch's output, with the job's exit status as sbatch --wait
    gives it (128 + the signal of a job killed by one)."""
    got = slurm.run("sbatch", "--parsable", *argv, timeout=120)
    if got.returncode != 0:
        return got
    job = got.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_S
    while True:
        shown = slurm.run("scontrol", "-o", "show", "job", job, timeout=60).stdout
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        if fields.get("JobState") in ENDED:
            status, _, sig = fields["ExitCode"].partition(":")
            got.returncode = 128 + int(sig) if int(sig) else int(status)
            return got
        assert time.monotonic() < deadline, f"job {job} still {fields.get('JobState')} after {JOB_S} s"
        time.sleep(0.25)


def task_lines(stdout: str) -> list[list[str]]:
    return sorted(line.split() for line in stdout.splitlines() if line.startswith("task "))


# "task PROCID NODE NCCL_ALGO NCCL_MIN_NCHANNELS" for each task, "-" for an unset variable.
SHOW = 'echo "task $SLURM_PROCID $SLURMD_NODENAME ${NCCL_ALGO:--} ${NCCL_MIN_NCHANNELS:--}"'


# -- the TaskProlog -------------------------------------------------------------------------------


def test_prolog_gives_one_node_jobs_both_parts_and_multi_node_jobs_and_steps_the_every_job_part(
        slurm: Slurm, published: Path) -> None:
    first, second = slurm.nodes
    one = slurm.run("srun", "-N1", "-n1", "sh", "-c", SHOW)
    assert one.returncode == 0, one.stderr
    assert [t[3:] for t in task_lines(one.stdout)] == [["Ring", "32"]]
    two = slurm.run("srun", "-N2", "-n2", "sh", "-c", SHOW)
    assert two.returncode == 0, two.stderr
    assert task_lines(two.stdout) == [["task", "0", first, "Ring", "-"], ["task", "1", second, "Ring", "-"]]
    step = slurm.run("salloc", "-N2", "srun", "-N1", "-n1", "sh", "-c", SHOW)
    assert step.returncode == 0, step.stderr
    assert [t[3:] for t in task_lines(step.stdout)] == [["Ring", "-"]]


def test_prolog_warnings_reach_the_jobs_output(slurm: Slurm, published: Path) -> None:
    published.chmod(0o664)
    got = slurm.run("srun", "-N1", "-n1", "sh", "-c", SHOW)
    assert got.returncode == 0, got.stderr
    assert f"nccltune-task-prolog: not using {published}: the file is group-writable" in got.stdout
    assert [t[3:] for t in task_lines(got.stdout)] == [["-", "-"]]


# -- a sweep in a job that got the published set through the TaskProlog ----------------------------

EVERY = {"NCCL_IB_HCA": "^mlx5_2", "NCCL_NVLS_ENABLE": "0"}
SINGLE = {"NCCL_ALGO": "Ring"}


@pytest.fixture
def published_set(slurm: Slurm) -> Iterator[Path]:
    """A real published set (generations, links, the marker line) where the cluster's TaskProlog
    reads nccl.env; everything of it removed after."""
    from publishing import publish_set

    from nccltune.publish import Provenance

    publish_set(slurm.published, EVERY, Provenance("0", "now", "f", None, "nccl", False, None), single_node_env=SINGLE)
    yield slurm.published
    for entry in slurm.published.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def plan_in_job(slurm: Slurm, state: Path, *argv: str) -> dict[str, object]:
    got = slurm.run(*argv, sys.executable, "-m", "nccltune", "sweep", "--plan", "--json", "--demo", str(SNAPSHOT),
                    "--state-dir", str(state))
    assert got.returncode == 0, got.stderr
    doc: dict[str, object] = json.loads(got.stdout)
    return doc


def test_a_sweep_in_a_job_pins_nothing_the_task_prolog_gave_it(slurm: Slurm, published_set: Path) -> None:
    doc = plan_in_job(slurm, published_set, "srun", "-N1", "-n1")
    assert doc["pinned"] == {}
    assert doc["from_published"] == {"generation": 1, "env": {**EVERY, **SINGLE}}


def test_a_value_the_batch_script_sets_stays_a_pin_in_its_steps(slurm: Slurm, published_set: Path,
                                                                 tmp_path: Path) -> None:
    """The batch step gets the set from the prolog; the script then sets NCCL_IB_HCA itself, and a
    step's prolog keeps it (and the marker the batch step got): the step's sweep pins that one only."""
    script = tmp_path / "job.sh"
    argv = [sys.executable, "-m", "nccltune", "sweep", "--plan", "--json", "--demo", str(SNAPSHOT),
            "--state-dir", str(published_set)]
    script.write_text("#!/bin/sh\nexport NCCL_IB_HCA=mlx5_0\nexec srun -N1 -n1 " + " ".join(argv) + "\n")
    got = sbatch_wait(slurm, "-N1", f"--chdir={tmp_path}", f"--output={tmp_path / 'out'}",
                      f"--error={tmp_path / 'err'}", script)
    assert got.returncode == 0, (got.stderr, (tmp_path / "err").read_text())
    out = (tmp_path / "out").read_text()
    # The step's prolog says what it keeps in a print line, which Slurm writes before the task's output.
    said, _, document = out.partition("\n{")
    assert said == "nccltune-task-prolog: NCCL_IB_HCA=mlx5_0 set by the job is kept (published: ^mlx5_2)"
    doc = json.loads("{" + document)
    assert {n: p["value"] for n, p in doc["pinned"].items()} == {"NCCL_IB_HCA": "mlx5_0"}
    assert doc["from_published"] == {"generation": 1, "env": {"NCCL_NVLS_ENABLE": "0", **SINGLE}}


# -- sweeps through srun --------------------------------------------------------------------------


def sweep_argv(root: Path) -> list[str]:
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(SWEEP_CONFIG))
    return [sys.executable, "-m", "nccltune", "sweep", "--demo", str(SNAPSHOT), "--launcher", "srun", "--nodes", "2",
            "--json", "--config", str(config), "--state-dir", str(root / "state")]


def check_sweep(doc: dict[str, object], state: Path) -> None:
    assert doc["failed_trials"] == [] and isinstance(doc["trials"], int) and doc["trials"] >= 4, doc
    history = subprocess.run([sys.executable, "-m", "nccltune", "history", "--json", "--state-dir", str(state)],
                             capture_output=True, text=True, timeout=120, env=node_env())
    run = json.loads(history.stdout)["runs"][0]
    assert run["status"] == "ok"
    assert {k: run["summary"]["job"][k] for k in ("label", "launcher")} == {"label": "2x2", "launcher": "srun"}


def test_sweep_from_sbatch_runs_every_trial_as_an_srun_step(slurm: Slurm, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexec " + " ".join(sweep_argv(tmp_path)) + "\n")
    got = sbatch_wait(slurm, "-N2", "--ntasks-per-node=2", f"--chdir={tmp_path}",
                      f"--output={tmp_path / 'out'}", f"--error={tmp_path / 'err'}", script)
    err = (tmp_path / "err").read_text()
    assert got.returncode == 0, (got.stderr, err)
    check_sweep(json.loads((tmp_path / "out").read_text()), tmp_path / "state")
    # The batch script runs on the allocation's first node, rank 0's: SLURMD_NODENAME says so even
    # where every node has this machine's host name.
    assert "rank 0 runs on" not in err


def test_sweep_from_salloc(slurm: Slurm, tmp_path: Path) -> None:
    got = slurm.run("salloc", "-N2", "--ntasks-per-node=2", *sweep_argv(tmp_path))
    assert got.returncode == 0, got.stderr
    check_sweep(json.loads(got.stdout), tmp_path / "state")


def test_an_allocation_too_small_for_the_trials_is_one_error_before_any_trial(slurm: Slurm, tmp_path: Path) -> None:
    got = slurm.run("salloc", "-N2", *sweep_argv(tmp_path))  # one CPU per node, two tasks per node wanted
    assert got.returncode == UsageError.exit_code, got.stderr
    assert "--ntasks-per-node=2" in got.stderr and "Traceback" not in got.stderr
    assert got.stderr.count("error:") == 1, got.stderr
    assert not list((tmp_path / "state").glob("runs/*/trial-*"))


def test_sigterm_to_the_sweep_ends_every_task_and_records_the_run_as_terminated(slurm: Slurm, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with allocation(slurm, "-N2", "--ntasks-per-node=2") as alloc:
        proc = subprocess.Popen(sweep_argv(tmp_path), env={**alloc.env, FAULT_VAR: "hang"}, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while len(workers_in(state)) < 4:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the trial's four tasks never started"
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            _out, err = proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 143, err
        assert wait_gone(state, 30) == {}
        assert steps_of(slurm, alloc.job) == []
    history = subprocess.run([sys.executable, "-m", "nccltune", "history", "--json", "--state-dir", str(state)],
                             capture_output=True, text=True, timeout=120, env=node_env())
    run = json.loads(history.stdout)["runs"][0]
    assert run["status"] == "interrupted" and "terminated (SIGTERM)" in json.dumps(run)


def workers_in(state: Path) -> list[int]:
    """The worker processes running in a trial directory under `state` (srun's tasks, not srun)."""
    out = []
    for pid in processes_in(state):
        with contextlib.suppress(OSError):
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            if Path(argv[0]).name != "srun" and str(WORKER) in argv:
                out.append(pid)
    return out


# -- single trials: a crash, a hang, where the ranks run ------------------------------------------


def runner_in(alloc: Allocation, work: Path, timeout_s: float, **extra: str) -> Runner:
    launch = make_launch(LaunchShape(2, 2), "srun", None, env=alloc.env)
    work.mkdir()
    return Runner(python=sys.executable, backend="gloo", nranks=4, base_env={**alloc.env, **extra}, work_dir=work,
                  timeout_s=timeout_s, nccl_debug=False, launch=launch)


def test_a_crashing_rank_is_reported_with_its_own_task_line(slurm: Slurm, tmp_path: Path) -> None:
    with allocation(slurm, "-N2", "--ntasks-per-node=2") as alloc:
        runner = runner_in(alloc, tmp_path / "work", 120, **{FAULT_VAR: "crash@3"})
        result = runner.run({}, [4096], warmup=1, iters=1)
        assert steps_of(slurm, alloc.job) == []
    assert result.status == "crashed"
    assert result.reason is not None and "143" not in result.reason
    assert f"rank 3 on {slurm.nodes[1]} was killed by signal SIGABRT" in result.reason


def test_a_step_srun_cannot_start_is_reported_with_sruns_own_error(slurm: Slurm, tmp_path: Path) -> None:
    with allocation(slurm, "-N2", "--ntasks-per-node=2") as alloc:
        # Three tasks per node in an allocation of two: what the allocation check refuses up front.
        launch = SrunLaunch(2, 3, master_addr=slurm.nodes[0], nodelist=slurm.nodes)
        (tmp_path / "work").mkdir()
        runner = Runner(python=sys.executable, backend="gloo", nranks=6, base_env=alloc.env, work_dir=tmp_path / "work",
                        timeout_s=60, nccl_debug=False, launch=launch)
        result = runner.run({}, [4096], warmup=1, iters=1)
    assert result.status == "crashed"
    assert result.reason is not None and result.reason.startswith("srun: "), result.reason
    assert "More processors requested than permitted" in result.reason


def test_a_hanging_rank_is_ended_on_every_node_at_the_timeout(slurm: Slurm, tmp_path: Path) -> None:
    with allocation(slurm, "-N2", "--ntasks-per-node=2") as alloc:
        runner = runner_in(alloc, tmp_path / "work", 10, **{FAULT_VAR: "hang@1"})
        result = runner.run({}, [4096], warmup=1, iters=1)
        assert result.status == "timeout", result.reason
        assert wait_gone(tmp_path / "work", 30) == {}
        assert steps_of(slurm, alloc.job) == []


PROBE = """\
import json, os
print(json.dumps({k: os.environ.get(k) for k in
                  ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURMD_NODENAME", "MASTER_ADDR", "NCCL_ALGO")}))
"""


def test_rank_0_runs_on_the_allocations_first_node_and_ranks_fill_nodes_in_blocks(
        slurm: Slurm, tmp_path: Path, published: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    with allocation(slurm, "-N2", "--ntasks-per-node=2") as alloc:
        launch = make_launch(LaunchShape(2, 2), "srun", None, env=alloc.env)
        assert isinstance(launch, SrunLaunch)
        trial = TrialSpec(1, tmp_path, [sys.executable, str(WORKER)], alloc.env, {}, 60.0)
        [spec] = launch.start(trial)
        # The launch's own srun command line, with the probe where the worker would be.
        argv = [str(probe) if a == str(WORKER) else a for a in spec.argv]
        got = subprocess.run(argv, env=spec.env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    # srun labels every line with its task (--label); the ranks but 0 write to stderr (rankexec).
    ranks = [json.loads(task_output(got.stdout + got.stderr, task)[0]) for task in range(4)]
    first, second = slurm.nodes
    assert [(r["RANK"], r["LOCAL_RANK"], r["SLURMD_NODENAME"]) for r in ranks] == [
        ("0", "0", first), ("1", "1", first), ("2", "0", second), ("3", "1", second)]
    assert {r["WORLD_SIZE"] for r in ranks} == {"4"} and {r["MASTER_ADDR"] for r in ranks} == {first}
    # The TaskProlog leaves a trial's tasks alone: they run exactly the candidate.
    assert {r["NCCL_ALGO"] for r in ranks} == {None}


def test_a_first_node_that_does_not_resolve_fails_at_once_with_its_name(slurm: Slurm) -> None:
    name = "n" * 70  # longer than a DNS label may be: refused here, no resolver asked
    env = slurm.env(SLURM_JOB_ID="1", SLURM_JOB_NODELIST=f"{name},{slurm.nodes[1]}", SLURM_JOB_NUM_NODES="2",
                    SLURM_JOB_CPUS_PER_NODE="2(x2)")
    with pytest.raises(UnavailableError, match=name):
        make_launch(LaunchShape(2, 2), "srun", None, env=env)
