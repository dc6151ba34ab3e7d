"""The launcher registry is the one table of launchers: the parser, resolve_launcher and make_launch read
it, and a launcher is its own module plus its entry there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nccltune.cli.parser import build_parser
from nccltune.errors import UsageError
from nccltune.trials import rankexec
from nccltune.trials.launch import registry
from nccltune.trials.launch.base import LAUNCHERS, LaunchShape, make_launch, resolve_launcher
from nccltune.trials.launch.registry import CHOICES, LAUNCHER_NAMES


def test_parser_accepts_every_registered_launcher_and_nothing_else():
    parser = build_parser()
    for name in CHOICES:
        assert parser.parse_args(["sweep", "--launcher", name]).launcher == name
    with pytest.raises(UsageError, match="choose from 'auto', 'local', 'torchrun', 'srun'"):
        parser.parse_args(["sweep", "--launcher", "mpirun"])


def test_resolve_launcher_reads_the_registry():
    assert LAUNCHERS == CHOICES == ("auto", *LAUNCHER_NAMES)
    with pytest.raises(UsageError, match="expected one of auto, local, torchrun, srun"):
        resolve_launcher("mpirun", 1, {})


def test_registry_imports_alone_without_the_launch_package():
    code = ("import sys; import nccltune.trials.launch.registry; "
            "assert 'nccltune.trials.launch.torchrun' not in sys.modules; "
            "assert 'nccltune.trials.launch.channel' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_peer_messages_are_read_as_strictly_as_files():
    from nccltune.trials.launch.sealing import strict_json

    assert strict_json(b'{"seq": 1}') == {"seq": 1}
    for bad in (b'{"kill": 1, "kill": 2}', b'{"gain": NaN}', b"[" * 200 + b"]" * 200, b'"\xff"'):
        with pytest.raises(ValueError):
            strict_json(bad)


FAKE_LAUNCHER = '''
from nccltune.trials.launch.base import Launch, ProcSpec


class FakeLaunch(Launch):
    launcher = "fake"

    def start(self, trial):
        return [ProcSpec("rank0", list(trial.worker), dict(trial.env), "rank 0")]


def make(request, shape, *, node_class=None, gpus=False):
    launch = FakeLaunch(shape, node_class)
    launch.request = request
    return launch
'''


def test_a_launcher_is_its_module_and_its_registry_entry(tmp_path, monkeypatch):
    # The launcher's own module, anywhere importable, and one entry in the registry's table: no
    # other file knows of it, and make_launch, resolve_launcher and the choices reach it.
    (tmp_path / "nccltune_fake_launcher.py").write_text(FAKE_LAUNCHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nccltune_fake_launcher", raising=False)
    fake = registry.Launcher("fake", "nccltune_fake_launcher", "make", registry.ENTRIES[0].rank_vars, "launch")
    monkeypatch.setattr(registry, "ENTRIES", (*registry.ENTRIES, fake))
    assert "nccltune_fake_launcher" not in sys.modules  # loaded when chosen, not when registered
    assert registry.choices() == (*CHOICES, "fake")
    assert resolve_launcher("fake", 2, {}) == "fake"
    launch = make_launch(LaunchShape(2, 3), "fake", ("node-a", 29400), node_class="c1", env={"X": "1"})
    assert type(launch).__name__ == "FakeLaunch" and launch.launcher == "fake"
    assert launch.record()["label"] == "2x3" and launch.record()["node_class"] == "c1"
    assert launch.request.endpoint == ("node-a", 29400) and launch.request.env == {"X": "1"}


def test_a_factory_that_makes_no_launch_is_refused(tmp_path, monkeypatch):
    (tmp_path / "nccltune_not_a_launcher.py").write_text("def make(request, shape, **kw):\n    return object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nccltune_not_a_launcher", raising=False)
    bad = registry.Launcher("bad", "nccltune_not_a_launcher", "make", (), "launch")
    monkeypatch.setattr(registry, "ENTRIES", (*registry.ENTRIES, bad))
    with pytest.raises(TypeError, match=r"nccltune_not_a_launcher\.make made object, not a Launch"):
        make_launch(LaunchShape(1, 1), "bad", None, env={})


def test_every_entry_names_its_own_module_and_factory():
    assert LAUNCHER_NAMES == ("local", "torchrun", "srun")
    for entry in registry.ENTRIES:
        factory = entry.load()
        assert factory.__module__ == entry.module == f"nccltune.trials.launch.{entry.name}"
    launch = make_launch(LaunchShape(1, 2), "local", None, env={})
    assert type(launch).__name__ == "LocalLaunch" and launch.shape.nranks == 2


def test_the_rank_variables_each_entry_names_are_the_ones_its_ranks_get():
    local = registry.entry("local")
    srun = registry.entry("srun")
    assert local is not None and srun is not None
    got = make_launch(LaunchShape(1, 2), "local", None, env={}).rank_env({}, 1, 29500)
    assert {src: got[src] for src, _ in local.rank_vars} == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                                                            "LOCAL_WORLD_SIZE": "2"}
    assert srun.rank_vars is rankexec.SLURM_TO_TORCH  # the one table rankexec.py --slurm applies
    slurm_env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2"}
    mapped = rankexec.rank_env(slurm_env, slurm=True)
    assert {dst: mapped[dst] for _, dst in srun.rank_vars} == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                                              "LOCAL_WORLD_SIZE": "2"}
    assert {dst for _, dst in srun.rank_vars} == set(registry.WORKER_RANK_VARS)
