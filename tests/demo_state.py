"""A finished CPU-demo sweep shared by the daemon, verify and env/exec tests.

One small demo sweep (7 short trials) is made once per test session and copied by the tests that
need something published, so that each of them does not pay for its own sweep.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nccltune.topology.source import bundled_topologies_dir

SNAPSHOT = bundled_topologies_dir() / "h200x2-nvswitch-vm.json"
# The defaults twice, NCCL_ALGO=Ring and the topology file alone, then one round of finalists.
BASE_CONFIG: dict[str, Any] = {
    "sweep": {
        "baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1,
        "variables": {"NCCL_ALGO": ["Ring"]},
        "exclude": ["NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_NTHREADS",
                    "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"],
    },
    # gloo on two shared cores varies by tens of percent between runs: a wide drift threshold
    # keeps the daemon's verify from asking for re-sweeps in the middle of a test.
    "daemon": {"quiet_period_s": 0, "drift_threshold_pct": 90},
    "publish": {"metrics_dir": "metrics"},
}
SWEEP_S = 180.0  # generous bound for one demo sweep on a loaded 2-core machine


def clean_env(**extra: str) -> dict[str, str]:
    # NCCL variables of whoever runs the tests would be pinned into the plan; a watchdog or
    # notify socket of the calling service must not reach the processes under test.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCL", "TORCH_NCCL", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(extra)
    return env


def seeded_state(factory: pytest.TempPathFactory) -> Path:
    """State dir of one finished demo sweep with BASE_CONFIG over the bundled 2-GPU snapshot."""
    root = factory.getbasetemp() / "seeded-demo-sweep"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        (root / "config.yaml").write_text(yaml.safe_dump(BASE_CONFIG, sort_keys=False))
        got = subprocess.run(
            [sys.executable, "-m", "nccltune", "sweep", "--demo", str(SNAPSHOT), "--config", str(root / "config.yaml"),
             "--state-dir", str(root / "state")],
            capture_output=True, text=True, env=clean_env(), timeout=SWEEP_S, cwd=root)
        assert got.returncode == 0, got.stderr
        (root / "done").touch()
    return root / "state"
