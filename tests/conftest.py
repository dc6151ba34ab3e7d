"""What the tests share: where the fixture files live, and the one finished CPU-demo sweep.

Test modules import the paths from here (`from conftest import TOPOLOGIES`); the demo sweep is
the `demo_sweep` fixture (made once per test session, see demo_state.py) and `seeded`, its
state directory; `every_collective_sweep` is a second one whose profile measures every collective.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from demo_state import EVERY_COLLECTIVE_CONFIG, EVERY_COLLECTIVE_SWEEP_S, DemoSweep, demo_sweep_in

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
TOPOLOGIES = REPO / "topologies"  # the recorded and synthetic snapshots
EXAMPLES = REPO / "examples"
GOLDEN = TESTS / "golden"  # expected renderings of the snapshots
FIXTURES = TESTS / "fixtures"
NCCL_LOGS = FIXTURES / "nccllog"  # NCCL_DEBUG=INFO logs
NCCL_TESTS_OUTPUT = FIXTURES / "nccl-tests"  # all_reduce_perf output

# Recorded trees hold no tests, and a recorded sysfs holds the kernel's own symlink cycles
# (class/net/eth0/device/net/eth0/...): collection never walks into them.
collect_ignore = ["fixtures", "golden"]


# The slowest test files, slowest first (seconds each on a quiet two-core machine, from
# --durations=0): pytest-xdist hands the files out in this order, so that no long file is the last
# one a worker starts while the other has nothing left to do. The other files follow in their own
# order. Keep it roughly true when a file's time changes much; an outdated order costs time only.
SLOWEST_FIRST = (
    "test_alert_workflows.py",  # ~120: the metric writers at every scrape of simulated months, promtool
    "test_slurm_real.py",  # ~85: a Slurm cluster, two sweeps through srun
    "test_sweep_shapes.py",  # ~75: a two-node sweep with a hang waited out
    "test_multinode.py",  # ~65: trials over two torchrun agents
    "test_daemon.py",  # ~65: daemons that sweep
    "test_one_gpu_nodes.py",  # ~35: a two-node sweep of one-GPU nodes
    "test_fleet.py",  # ~35: two demo nodes swept
    "test_killed_after_publish.py",  # ~30: demo sweeps killed and run again
    "test_forked_ranks.py",  # ~20: the rank server's trials, a hang waited out
    "test_profile_scale.py",  # ~20: a profile of 1000 nodes
    "test_trial_env.py",  # ~15: demo sweeps and publishes of the topology file
    "test_runner.py",  # ~15: ranks by exec, a hang waited out
    "test_collective_sweep.py",  # ~15: the every-collective demo sweep
    "test_one_gpu.py",  # ~10: one-GPU sweeps
    "test_sweep_tablestage.py",  # ~7: a demo sweep with the per-size stage
    "test_bad_input.py",  # ~5: a process per malformed input, forked from one interpreter
    "test_verify_one_gpu.py",
    "test_job_precedence.py",
    "test_verify.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist would otherwise order the files by their number of tests, which says little about
    # how long they take (the slowest have a handful of tests each).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


@pytest.fixture(autouse=True)
def work_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test runs in an empty directory of its own: the CLI reads ./nccltune-demo, and what
    the checkout's working directory holds (a demo left by bringup.sh) must not change a result."""
    path = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(path)
    return path


@pytest.fixture(scope="session")
def demo_sweep(tmp_path_factory: pytest.TempPathFactory) -> DemoSweep:
    """One finished demo sweep (`sweep --demo --json`), shared read-only: copy its state to change it."""
    return demo_sweep_in(tmp_path_factory)


@pytest.fixture(scope="session")
def every_collective_sweep(tmp_path_factory: pytest.TempPathFactory) -> DemoSweep:
    """One finished demo sweep whose profile measures all seven collectives, shared read-only."""
    return demo_sweep_in(tmp_path_factory, "every-collective-sweep", EVERY_COLLECTIVE_CONFIG,
                         EVERY_COLLECTIVE_SWEEP_S)


@pytest.fixture(scope="session")
def seeded(demo_sweep: DemoSweep) -> Path:
    """The demo sweep's state directory: something published, one sweep in the history."""
    return demo_sweep.state


@pytest.fixture(scope="module")
def nccl_probed_once() -> Iterator[None]:
    """The plans of a GPU node ask the worker interpreter for its NCCL version (a probe that starts
    it and imports torch), which answers the same for every plan of a module: the real probe, run
    once for the module that asks for this, not once per pipeline."""
    import functools

    from nccltune.pipeline import stages

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stages, "probe_nccl", functools.cache(stages.probe_nccl))
        yield


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB tmpfs (root only; skipped where it cannot be mounted), for full-disk tests."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mnt)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(mnt: Path) -> None:
    """Write zeros into `mnt` until its file system has no block left."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from nccltune.files.atomicfile import write_temp
for target in sys.argv[1:]:
    write_temp(Path(target), b"half a fi", 0o644)
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_writer(*targets: Path) -> list[Path]:
    """What a writer killed mid-write leaves: a real process writes a temp file for each of
    `targets` (nccltune's own atomicfile.write_temp) and is killed (SIGKILL) before any rename;
    the temp files it left, which name its pid."""
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, *map(str, targets)], capture_output=True,
                          check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -9, proc.stderr
    left = sorted(p for t in targets for p in t.parent.glob(f".{t.name}.tmp-*"))
    assert len(left) == len(targets), left
    return left
