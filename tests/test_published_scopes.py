"""The two scopes of a published set: every job, and jobs known to run on this one node.

Each form a job can get the set through is run for real under each job shape: the files sourced by
sh and bash, the torchrun wrapper and the Slurm TaskProlog (with a fake torchrun and Slurm's
variables), `nccltune exec` and `nccltune env`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from publishing import publish_set

from nccltune.errors import InputError
from nccltune.publish import (
    CONF_SCOPE_LINE,
    Provenance,
    Tuner,
    job_env,
    job_nnodes,
    read_set,
    update_nccl_conf,
)

WRAPPER = REPO / "launchers" / "nccltune-torchrun"
PROLOG = REPO / "launchers" / "slurm-prolog.sh"
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="the launchers trust only root-owned files")

EVERY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_IB_HCA": "^mlx5_2"}
SINGLE = {"NCCL_MIN_NCHANNELS": "32", "NCCL_ALGO": "Ring"}
SHELLS = pytest.mark.parametrize("shell", [["/bin/sh"], ["bash"]], ids=["sh", "bash"])


def prov(**kw: object) -> Provenance:
    base: dict[str, object] = dict(nccltune_version="0", created_at="now", topology_fingerprint="f",
                                   nccl_version=None, backend="nccl", demo=False, profile=None)
    base.update(kw)
    return Provenance(**base)  # type: ignore[arg-type]


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    tmp_path.chmod(0o755)
    publish_set(d, EVERY, prov(), topology_xml="<system version=\"1\"/>\n", single_node_env=SINGLE)
    return d


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCL", "TORCH_NCCL", "SLURM_")) and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def nccl_vars(text: str, prefix: str = "") -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.removeprefix(prefix)
        name, eq, value = line.partition("=")
        if eq and name.startswith(("NCCL_", "TORCH_NCCL_")):
            out[name] = value
    return out


def every_job(state: Path) -> dict[str, str]:
    return {**EVERY, "NCCL_TOPO_FILE": str(state / "generations" / "1" / "ncclTopology.xml")}


# -- the files ------------------------------------------------------------------------------------


def test_nccl_json_labels_both_parts_and_says_which_jobs_get_them(state: Path) -> None:
    doc = json.loads((state / "nccl.json").read_text())
    assert doc["env"] == every_job(state)
    assert doc["single_node_env"] == SINGLE
    assert doc["scopes"]["every_job"]["env"] == every_job(state)
    assert doc["scopes"]["single_node"]["env"] == SINGLE
    assert doc["scopes"]["every_job"]["files"] == ["nccl.sh", "nccl.env"]
    assert doc["scopes"]["single_node"]["files"] == ["nccl-single-node.sh", "nccl-single-node.env"]
    assert "whatever its shape" in doc["scopes"]["every_job"]["applies_to"]
    assert "--nnodes 1" in doc["scopes"]["single_node"]["applies_to"]
    for name in ("nccl.sh", "nccl.env"):
        assert "# scope: every_job: " in (state / name).read_text()
    for name in ("nccl-single-node.sh", "nccl-single-node.env"):
        assert "# scope: single_node: only jobs known to run on this one node" in (state / name).read_text()


def test_read_set_returns_the_every_job_part_and_the_single_node_part_beside_it(state: Path) -> None:
    got = read_set(state)
    assert got is not None
    assert got.env == every_job(state)
    assert got.single_node_env == SINGLE
    assert job_env(got, None) == every_job(state)
    assert job_env(got, 4) == every_job(state)
    assert job_env(got, 1) == {**every_job(state), **SINGLE}


def test_read_set_refuses_an_edited_single_node_file(state: Path) -> None:
    path = state / "generations" / "1" / "nccl-single-node.env"
    path.write_text(path.read_text().replace("NCCL_MIN_NCHANNELS=32", "NCCL_MIN_NCHANNELS=64"))
    with pytest.raises(InputError, match=r"nccl-single-node.env.*does not hold the variables"):
        read_set(state)


@SHELLS
def test_sourcing_the_files_gives_each_part_in_sh_and_bash(shell: list[str], state: Path) -> None:
    def sourced(*files: Path) -> dict[str, str]:
        script = "".join(f'. "{f}"; ' for f in files) + "env"
        return nccl_vars(subprocess.run([*shell, "-c", script], capture_output=True, text=True, check=True,
                                        env=clean_env()).stdout)

    assert sourced(state / "nccl.sh") == every_job(state)
    assert sourced(state / "nccl.sh", state / "nccl-single-node.sh") == {**every_job(state), **SINGLE}


def test_the_nccl_conf_block_carries_the_every_job_part_only(state: Path, tmp_path: Path) -> None:
    got = read_set(state)
    assert got is not None
    conf = tmp_path / "nccl.conf"
    update_nccl_conf(conf, got.env, prov())
    text = conf.read_text()
    assert CONF_SCOPE_LINE in text and "cannot know a job's shape" in text
    assert "NCCL_IB_HCA=^mlx5_2" in text
    assert "NCCL_MIN_NCHANNELS" not in text.replace(CONF_SCOPE_LINE, "")
    # NCCL's conf parser takes any line with '=' as a variable in older releases: none in comments.
    assert all("=" not in line for line in text.splitlines() if line.startswith("#"))


def test_a_variable_in_both_parts_or_a_file_in_the_single_node_part_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="NCCL_ALGO: also in the part for every job"):
        publish_set(tmp_path, {"NCCL_ALGO": "Tree"}, prov(), single_node_env={"NCCL_ALGO": "Ring"})
    with pytest.raises(InputError, match="NCCL_TOPO_FILE: files, plugins"):
        publish_set(tmp_path, {}, prov(), single_node_env={"NCCL_TOPO_FILE": "/x.xml"})
    with pytest.raises(InputError, match="NCCLTUNE_JOB_NNODES"):
        publish_set(tmp_path, {"NCCLTUNE_JOB_NNODES": "1"}, prov())
    assert not (tmp_path / "current").exists()


def test_the_tuner_is_published_as_files_of_the_generation(tmp_path: Path) -> None:
    plugin = tmp_path / "built.so"
    plugin.write_bytes(b"\x7fELF not really")
    files = publish_set(tmp_path / "s", {"NCCL_TUNER_PLUGIN": "/elsewhere.so"}, prov(tuning_fingerprint="abc123"),
                    tuner=Tuner(plugin=plugin, table_text="nccltune-tuner-table 1\n"),
                    single_node_env={"NCCL_MIN_NCHANNELS": "32"})
    gen = tmp_path / "s" / "generations" / "1"
    assert files.tuner_plugin_path == gen / "libnccl-tuner-nccltune.so"
    assert (gen / "libnccl-tuner-nccltune.so").read_bytes() == b"\x7fELF not really"
    assert (gen / "tuner-table.txt").read_text() == "nccltune-tuner-table 1\n"
    got = read_set(tmp_path / "s")
    assert got is not None
    assert got.env == {"NCCL_TUNER_PLUGIN": str(gen / "libnccl-tuner-nccltune.so"),
                       "NCCLTUNE_TUNER_TABLE": str(gen / "tuner-table.txt"),
                       "NCCLTUNE_TUNER_FINGERPRINT": "abc123"}
    assert got.single_node_env == {"NCCL_MIN_NCHANNELS": "32"}


def test_tuner_variables_are_refused_unless_they_are_the_generations_own(tmp_path: Path) -> None:
    for name in ("NCCL_TUNER_PLUGIN", "NCCLTUNE_TUNER_TABLE"):
        with pytest.raises(InputError, match=f"{name}: nccltune does not publish"):
            publish_set(tmp_path / "s", {name: "/opt/x"}, prov())
    publish_set(tmp_path / "s", {}, prov(), tuner=Tuner(plugin=b"so", table_text="t\n"))
    gen = tmp_path / "s" / "generations" / "1"
    doc = json.loads((gen / "nccl.json").read_text())
    doc["env"]["NCCLTUNE_TUNER_TABLE"] = doc["scopes"]["every_job"]["env"]["NCCLTUNE_TUNER_TABLE"] = "/tmp/t.txt"
    (gen / "nccl.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"NCCLTUNE_TUNER_TABLE: /tmp/t\.txt is not the published generation.s own"):
        read_set(tmp_path / "s")


def test_job_nnodes_reads_the_explicit_variable() -> None:
    assert job_nnodes({}) is None
    assert job_nnodes({"NCCLTUNE_JOB_NNODES": "1"}) == 1
    assert job_nnodes({"NCCLTUNE_JOB_NNODES": "8"}) == 8
    with pytest.raises(Exception, match="not a positive whole number"):
        job_nnodes({"NCCLTUNE_JOB_NNODES": "one"})


# -- the torchrun wrapper -------------------------------------------------------------------------


def run_wrapper(shell: list[str], tmp_path: Path, state: Path, args: list[str],
                **env: str) -> subprocess.CompletedProcess[str]:
    bindir = tmp_path / "bin"
    if not bindir.exists():
        bindir.mkdir()
        (bindir / "torchrun").write_text("#!/bin/sh\nenv\n")
        (bindir / "torchrun").chmod(0o755)
    return subprocess.run([*shell, str(WRAPPER), *args], capture_output=True, text=True, timeout=60,
                          env=clean_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
                                        NCCLTUNE_ENV_FILE=str(state / "nccl.sh"), **env))


SINGLE_NODE_RUNS = [
    (["--standalone", "--nproc-per-node", "8", "train.py"], {}),
    (["--nnodes", "1", "--nproc-per-node", "8", "train.py"], {}),
    (["--nnodes=1", "train.py"], {}),
    (["--nnodes", "1:1", "train.py"], {}),
    (["--nnodes=1:1", "-m", "pkg.train"], {}),
    (["--nproc-per-node=8", "train.py"], {"NCCLTUNE_JOB_NNODES": "1"}),
]
MULTI_NODE_RUNS = [
    (["--nnodes", "2", "--nproc-per-node", "8", "train.py"], {}),
    (["--nnodes=1:4", "train.py"], {}),
    (["--nnodes", "4", "train.py"], {"NCCLTUNE_JOB_NNODES": "1"}),  # torchrun's own option decides
    (["train.py"], {"NCCLTUNE_JOB_NNODES": "16"}),
]
UNKNOWN_RUNS = [
    (["--nproc-per-node", "8", "train.py"], {}),
    # The training script's own arguments are not torchrun's.
    (["--nproc-per-node", "8", "train.py", "--nnodes", "1", "--standalone"], {}),
    (["train.py", "--nnodes=1"], {}),
]


@requires_root
@SHELLS
@pytest.mark.parametrize(("args", "extra"), SINGLE_NODE_RUNS)
def test_wrapper_adds_the_single_node_part_for_a_known_single_node_job(
        shell: list[str], tmp_path: Path, state: Path, args: list[str], extra: dict[str, str]) -> None:
    proc = run_wrapper(shell, tmp_path, state, args, **extra)
    assert proc.returncode == 0 and proc.stderr == ""
    assert nccl_vars(proc.stdout) == {**every_job(state), **SINGLE}


@requires_root
@SHELLS
@pytest.mark.parametrize(("args", "extra"), MULTI_NODE_RUNS + UNKNOWN_RUNS)
def test_wrapper_gives_a_multi_node_or_unknown_job_the_every_job_part_only(
        shell: list[str], tmp_path: Path, state: Path, args: list[str], extra: dict[str, str]) -> None:
    proc = run_wrapper(shell, tmp_path, state, args, **extra)
    assert proc.returncode == 0 and proc.stderr == ""
    assert nccl_vars(proc.stdout) == every_job(state)


@requires_root
def test_wrapper_refuses_a_single_node_file_of_another_generation(tmp_path: Path, state: Path) -> None:
    publish_set(state, EVERY, prov(), single_node_env={"NCCL_MIN_NCHANNELS": "16"})
    shutil.copy(state / "generations" / "1" / "nccl-single-node.sh", state / "generations" / "2")
    proc = run_wrapper(["/bin/sh"], tmp_path, state, ["--standalone", "train.py"])
    assert "NCCL_MIN_NCHANNELS" not in nccl_vars(proc.stdout)
    assert "mixed set" in proc.stderr


# -- the Slurm TaskProlog -------------------------------------------------------------------------


def run_prolog(shell: list[str], state: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*shell, str(PROLOG), str(state / "nccl.env")], capture_output=True, text=True,
                          timeout=60, env=clean_env(**env))


@requires_root
@SHELLS
@pytest.mark.parametrize("slurm", [{"SLURM_JOB_NUM_NODES": "1"}, {"SLURM_NNODES": "1"},
                                   {"NCCLTUNE_JOB_NNODES": "1"}])
def test_prolog_adds_the_single_node_part_for_a_one_node_job(shell: list[str], state: Path,
                                                             slurm: dict[str, str]) -> None:
    proc = run_prolog(shell, state, **slurm)
    assert proc.stderr == ""
    assert nccl_vars(proc.stdout, "export ") == {**every_job(state), **SINGLE}


@requires_root
@SHELLS
@pytest.mark.parametrize("slurm", [{"SLURM_JOB_NUM_NODES": "2"}, {"SLURM_JOB_NUM_NODES": "64", "SLURM_NNODES": "1"},
                                   {"SLURM_NNODES": "3", "NCCLTUNE_JOB_NNODES": "1"}, {}])
def test_prolog_gives_a_multi_node_or_unknown_job_the_every_job_part_only(shell: list[str], state: Path,
                                                                          slurm: dict[str, str]) -> None:
    proc = run_prolog(shell, state, **slurm)
    assert proc.stderr == ""
    assert nccl_vars(proc.stdout, "export ") == every_job(state)


# -- nccltune exec and env ------------------------------------------------------------------------


def nccltune(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True, timeout=120,
                          env=clean_env(**env))


@pytest.mark.parametrize(("flags", "extra", "single"), [
    (["--nnodes", "1"], {}, True),
    ([], {"NCCLTUNE_JOB_NNODES": "1"}, True),
    (["--nnodes", "2"], {}, False),
    (["--nnodes", "2"], {"NCCLTUNE_JOB_NNODES": "1"}, False),  # the flag decides
    ([], {}, False),
])
def test_exec_adds_the_single_node_part_only_for_a_single_node_job(
        state: Path, flags: list[str], extra: dict[str, str], single: bool) -> None:
    proc = nccltune("exec", "--state-dir", str(state), *flags, "--", "env", **extra)
    assert proc.returncode == 0, proc.stderr
    assert nccl_vars(proc.stdout) == ({**every_job(state), **SINGLE} if single else every_job(state))


@SHELLS
@pytest.mark.parametrize("nnodes", [None, "1", "3"])
def test_env_prints_the_single_node_part_as_assignments_only_for_one_node(shell: list[str], state: Path,
                                                                          tmp_path: Path, nnodes: str | None) -> None:
    flags = ["--nnodes", nnodes] if nnodes else []
    proc = nccltune("env", "--state-dir", str(state), *flags)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "printed.sh"
    script.write_text(proc.stdout)
    got = subprocess.run([*shell, "-c", f'. "{script}"; env'], capture_output=True, text=True, check=True,
                         env=clean_env()).stdout
    if nnodes == "1":
        assert nccl_vars(got) == {**every_job(state), **SINGLE}
    else:
        assert nccl_vars(got) == every_job(state)
        # Shown, with which jobs get it, but not applied.
        assert "#   NCCL_MIN_NCHANNELS=32" in proc.stdout
        assert ("does not say how many nodes" if nnodes is None else "spans 3 nodes") in proc.stdout
    env_form = nccltune("env", "--state-dir", str(state), "--format", "env", *flags).stdout
    assert ("NCCL_MIN_NCHANNELS=32\n" in env_form.splitlines(keepends=True)) == (nnodes == "1")


def test_env_json_gives_both_parts(state: Path) -> None:
    proc = nccltune("env", "--state-dir", str(state), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["scopes"]["single_node"]["env"] == SINGLE and doc["env"] == every_job(state)
