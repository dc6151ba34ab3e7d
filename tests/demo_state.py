"""A finished CPU-demo sweep shared by the daemon, verify and env/exec tests.

One small demo sweep (7 short trials) is made once per test run and copied by the tests that
need something published, so that each of them does not pay for its own sweep. Under pytest-xdist
the workers share it: the first to ask sweeps under a file lock, the others wait and read it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from nccltune.sweep.space import CATALOGUE
from nccltune.topology.source import bundled_topologies_dir

SNAPSHOT = bundled_topologies_dir() / "h200x2-nvswitch-vm.json"
# Everything but NCCL_ALGO that could be measured on one node (network knobs are pruned anyway).
EXCLUDE = [name for name, t in CATALOGUE.items() if t.kind == "perf" and t.scope == "node" and name != "NCCL_ALGO"]
# The defaults twice, NCCL_ALGO=Ring and the topology file alone, then one round of finalists.
BASE_CONFIG: dict[str, Any] = {
    "sweep": {
        "baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1,
        "variables": {"NCCL_ALGO": ["Ring"]},
        "exclude": EXCLUDE,
    },
    # gloo on two shared cores varies by tens of percent between runs: a wide drift threshold
    # keeps the daemon's verify from asking for re-sweeps in the middle of a test.
    "daemon": {"quiet_period_s": 0, "drift_threshold_pct": 90},
    "publish": {"metrics_dir": "metrics"},
    # The environment-only sweep these tests rely on; the per-size table has its own demo sweep
    # (test_sweep_tablestage.py).
    "tuner": {"plugin": "keep"},
}
SWEEP_S = 180.0  # generous bound for one demo sweep on a loaded 2-core machine
# Nothing searched: the defaults twice, the topology file alone, one final and a last baseline (five
# short trials). For tests of what a finished sweep does (store, publish, refuse to publish), which
# does not depend on what was searched.
SHORT_CONFIG: dict[str, Any] = {
    "sweep": {"baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1,
              "exclude": [name for name, t in CATALOGUE.items() if t.kind == "perf"]},
    "daemon": BASE_CONFIG["daemon"], "publish": BASE_CONFIG["publish"], "tuner": {"plugin": "keep"},
}

# A profile of all seven collectives (gloo has every one on two ranks), and nothing swept: the
# defaults twice, the topology file alone, one round of finals. Every collective goes through the
# real trials, choice, store and reports in one sweep of five short trials.
EVERY_COLLECTIVE = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
EVERY_COLLECTIVE_CONFIG: dict[str, Any] = {
    "sweep": {
        "profile": "every",
        "profiles": {"every": {c: {"1MiB": 1, "4KiB": 0.5} for c in EVERY_COLLECTIVE}},
        "baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1,
        "exclude": [*EXCLUDE, "NCCL_ALGO"],
    },
    "daemon": {"drift_threshold_pct": 90},
}
EVERY_COLLECTIVE_SWEEP_S = 420.0  # seven collectives per trial


def clean_env(**extra: str) -> dict[str, str]:
    # NCCL variables of whoever runs the tests would be pinned into the plan; a watchdog or
    # notify socket of the calling service must not reach the processes under test.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCL", "TORCH_NCCL", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(extra)
    return env


@dataclass
class DemoSweep:
    """The shared demo sweep: its directory, config, state, the JSON document it printed and its stderr."""

    root: Path
    config: Path
    state: Path
    doc: dict[str, Any]
    stderr: str

    def args(self, state: Path | None = None) -> list[str | Path]:
        """--config and --state-dir for a command on this state (or a copy of it)."""
        return ["--config", self.config, "--state-dir", state or self.state]


def demo_sweep_in(factory: pytest.TempPathFactory, name: str = "seeded-demo-sweep",
                  config: dict[str, Any] | None = None, timeout_s: float = SWEEP_S) -> DemoSweep:
    """One finished demo sweep with BASE_CONFIG (or `config`) over the bundled 2-GPU snapshot,
    made once per test session (the conftest's `demo_sweep` fixture; test modules that cannot
    take the fixture call `seeded_state`)."""
    root = shared_dir(factory) / name
    with open(root.with_name(f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first pytest worker sweeps, the others wait for it
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            (root / "config.yaml").write_text(yaml.safe_dump(config or BASE_CONFIG, sort_keys=False))
            got = subprocess.run(
                [sys.executable, "-m", "nccltune", "sweep", "--demo", str(SNAPSHOT), "--json",
                 "--config", str(root / "config.yaml"), "--state-dir", str(root / "state")],
                capture_output=True, text=True, env=clean_env(), timeout=timeout_s, cwd=root)
            assert got.returncode == 0, got.stderr
            (root / "sweep.json").write_text(got.stdout)
            (root / "sweep.err").write_text(got.stderr)
            (root / "done").touch()
    return DemoSweep(root, root / "config.yaml", root / "state", json.loads((root / "sweep.json").read_text()),
                     (root / "sweep.err").read_text())


def copy_state(src: Path, dst: Path) -> Path:
    """A copy of a shared state directory for a test that changes it (links kept). SQLite's `-wal`
    and `-shm` files are left out: the sweep that wrote the history closed it (its last connection
    folded the log into history.db), and a reader of the shared state in another worker makes and
    removes them at any moment, mid-copy."""
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("history.db-wal", "history.db-shm"))
    return dst


def shared_dir(factory: pytest.TempPathFactory) -> Path:
    """The directory all workers of one test run share: the base temporary directory, or under
    pytest-xdist the one above the workers' own (`popen-gw0`, ...). A pytest that a test starts
    inherits PYTEST_XDIST_WORKER but has a base of its own, which it keeps."""
    base = factory.getbasetemp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return base.parent if worker and base.name == f"popen-{worker}" else base


def seeded_state(factory: pytest.TempPathFactory) -> Path:
    """State dir of the shared demo sweep (see demo_sweep_in)."""
    return demo_sweep_in(factory).state
