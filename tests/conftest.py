"""What the tests share: where the fixture files live, and the one finished CPU-demo sweep.

Test modules import the paths from here (`from conftest import TOPOLOGIES`); the demo sweep is
the `demo_sweep` fixture (made once per test session, see demo_state.py) and `seeded`, its
state directory; `every_collective_sweep` is a second one whose profile measures every collective.
"""

from __future__ import annotations

import os
import subprocess
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
