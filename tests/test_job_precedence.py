"""One precedence rule in every form a job gets the published set through, for every job shape.

The same jobs (no own value, own values that differ, an own empty value, NCCLTUNE_DISABLE, a
marker of what an earlier launch applied that is of another set or no marker at all) are run
through `nccltune exec`, `nccltune env` sourced by each shell, the torchrun wrapper and the Slurm
TaskProlog under each shell, and every form must give what nccltune.delivery.jobenv.decide says,
the marker NCCLTUNE_APPLIED of what it applied included. The set has parts for 1, 2 and 4 nodes,
and each job is run as a job of 1 node, of several (2, 3 or 8: a part, the largest count below, the
largest count) and of unknown size, so every form also follows THE rule by node count
(publish/shapes.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
from conftest import REPO
from publishing import publish_set

from nccltune.delivery.jobenv import JobDecision, decide, filter_text, opted_out
from nccltune.fleet.jsonschema import validate
from nccltune.publish import Provenance, job_env, read_set
from nccltune.publish.applied import APPLIED_VAR
from nccltune.publish.cdi import render_spec

WRAPPER = REPO / "launchers" / "nccltune-torchrun"
PROLOG = REPO / "launchers" / "slurm-prolog.sh"
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="the launchers trust only root-owned files")

EVERY = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_IB_HCA": "^mlx5_2", "NCCL_NVLS_ENABLE": "0"}
SINGLE = {"NCCL_MIN_NCHANNELS": "32", "NCCL_ALGO": "Ring"}
# The parts by node count: NCCL_ALGO in the single-node part too, with its own value.
NODES = {2: {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}, 4: {"NCCL_MIN_NCHANNELS": "16"}}
SHELL_NAMES = [name for name in ("sh", "bash", "dash") if shutil.which(name)]
SHELLS = pytest.mark.parametrize("shell", SHELL_NAMES)

# The jobs: what each sets itself. Every form must respect the same decision for each.
JOBS = {
    "sets-nothing": {},
    "own-values": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_ALGO": "Tree"},
    "own-value-equal-to-published": {"NCCL_IB_HCA": "^mlx5_2"},
    "own-empty-value": {"NCCL_NVLS_ENABLE": "", "NCCL_MIN_NCHANNELS": ""},
    "own-value-with-spaces-and-quotes": {"NCCL_ALGO": "a 'b' $(c)"},
    "disabled": {"NCCLTUNE_DISABLE": "1", "NCCL_ALGO": "Tree"},
    "disabled-any-word": {"NCCLTUNE_DISABLE": "yes"},
    "disable-zero-is-not-disabled": {"NCCLTUNE_DISABLE": "0", "NCCL_ALGO": "Tree"},
    "disable-empty-is-not-disabled": {"NCCLTUNE_DISABLE": ""},
    "marker-of-another-set": {"NCCLTUNE_APPLIED": "7:0123456789abcdef:NCCL_ALGO", "NCCL_ALGO": "Ring"},
    "marker-that-is-not-one": {"NCCLTUNE_APPLIED": "x\nexport NCCL_EVIL=1", "NCCL_NVLS_ENABLE": "1"},
    "marker-and-disabled": {"NCCLTUNE_APPLIED": "7:0123456789abcdef:", "NCCLTUNE_DISABLE": "1"},
}
JOB_PARAMS = pytest.mark.parametrize("job", list(JOBS))
# Each job's shapes beside one node: one multi-node count each, in turn (the Python forms also run
# every job of unknown size), so that every shape meets several jobs without a process per pair.
MULTI = {job: (2, 3, 8)[i % 3] for i, job in enumerate(JOBS)}
# The shell launchers' shapes per job: one node, two, and in turn unknown, 3 or 8.
SHELL_SHAPES = {job: (1, 2, (None, 3, 8)[i % 3]) for i, job in enumerate(JOBS)}


def prov() -> Provenance:
    return Provenance(nccltune_version="0", created_at="now", topology_fingerprint="f", nccl_version=None,
                      backend="nccl", demo=False, profile=None)


def published_state(parent: Path) -> Path:
    parent.chmod(0o755)
    d = parent / "state"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    publish_set(d, EVERY, prov(), topology_xml="<system version=\"1\"/>\n", single_node_env=SINGLE, nodes_env=NODES)
    return d


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return published_state(tmp_path)


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCL", "TORCH_NCCL", "SLURM_")) and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def nccl_part(env: dict[str, str]) -> dict[str, str]:
    """NCCL's and torch's variables, and the marker of what was applied."""
    return {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_")) or k == APPLIED_VAR}


def expected(state: Path, job: str | dict[str, str], nnodes: int | None) -> dict[str, str]:
    got = read_set(state)
    assert got is not None
    own = JOBS[job] if isinstance(job, str) else job
    return nccl_part(decide(job_env(got, nnodes), own, got.set_id).environment(own))


def env_of(shell: str, script: str, env: dict[str, str]) -> dict[str, str]:
    """The NCCL variables of the environment `script` leaves, read NUL-separated (values may hold anything)."""
    out = subprocess.run([shell, "-c", f"{script}\nexec env -0"], capture_output=True, check=True, env=env,
                         timeout=60).stdout
    pairs = (item.decode().partition("=") for item in out.split(b"\0") if item)
    return nccl_part({name: value for name, _, value in pairs})


# -- the rule itself ----------------------------------------------------------------------------


def test_decide_keeps_the_jobs_own_values_and_adds_the_rest() -> None:
    got = decide({"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}, {"NCCL_ALGO": "Tree", "HOME": "/root"})
    assert got == JobDecision(applied={"NCCL_PROTO": "LL"}, kept={"NCCL_ALGO": ("Tree", "Ring")})
    assert got.environment({"NCCL_ALGO": "Tree"}) == {"NCCL_ALGO": "Tree", "NCCL_PROTO": "LL"}
    assert got.notes("x") == ["x: NCCL_ALGO=Tree set by the job is kept (published: Ring)"]


def test_decide_under_disable_applies_nothing() -> None:
    assert opted_out({"NCCLTUNE_DISABLE": "1"}) and opted_out({"NCCLTUNE_DISABLE": "true"})
    assert not opted_out({"NCCLTUNE_DISABLE": "0"}) and not opted_out({"NCCLTUNE_DISABLE": ""})
    assert not opted_out({})
    got = decide({"NCCL_ALGO": "Ring"}, {"NCCLTUNE_DISABLE": "1"})
    assert got.opted_out and got.applied == {} and got.kept == {}


def test_filtered_text_comments_what_is_not_applied_without_an_equals_sign() -> None:
    text = "# nccltune\nexport NCCL_ALGO='Ring'\nexport NCCL_PROTO='LL'\n"
    kept = filter_text(text, decide({"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}, {"NCCL_ALGO": "x=y"}))
    assert kept == "# nccltune\n# NCCL_ALGO: set by the job, its own value is kept\nexport NCCL_PROTO='LL'\n"
    off = filter_text(text, decide({"NCCL_ALGO": "Ring"}, {"NCCLTUNE_DISABLE": "1"}))
    assert "export" not in off and "# NCCL_PROTO: not applied (NCCLTUNE_DISABLE is set)" in off
    assert all("=" not in line for line in off.splitlines())


# -- every form, the same jobs ------------------------------------------------------------------


def nccltune(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nccltune", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.parametrize(("job", "nnodes"), [(job, n) for job in JOBS for n in (None, 1, MULTI[job])])
def test_exec_follows_the_rule(state: Path, job: str, nnodes: int | None) -> None:
    flags = ["--nnodes", str(nnodes)] if nnodes else []
    proc = subprocess.run([sys.executable, "-m", "nccltune", "exec", "--state-dir", str(state), *flags, "--",
                           "env", "-0"], capture_output=True, timeout=120, env=base_env(**JOBS[job]))
    assert proc.returncode == 0, proc.stderr
    pairs = (item.decode().partition("=") for item in proc.stdout.split(b"\0") if item)
    assert nccl_part({n: v for n, _, v in pairs}) == expected(state, job, nnodes)


@dataclass
class Printed:
    """One published state, read only, and what `nccltune env` printed on it for a job and a node
    count: the same text whichever shell sources it, so each is asked for once, of the command
    line's own entry point in this process with the job's environment (the marker tests below run
    it as a process of its own)."""

    state: Path
    text: dict[tuple[str, int | None], str] = field(default_factory=dict)

    def for_job(self, job: str, nnodes: int | None) -> str:
        if (job, nnodes) not in self.text:
            from nccltune.cli import main

            flags = ["--nnodes", str(nnodes)] if nnodes else []
            out = io.StringIO()
            with mock.patch.dict(os.environ, base_env(**JOBS[job]), clear=True), contextlib.redirect_stdout(out):
                assert main(["env", "--state-dir", str(self.state), *flags]) == 0
            self.text[job, nnodes] = out.getvalue()
        return self.text[job, nnodes]


@pytest.fixture(scope="module")
def printed(tmp_path_factory: pytest.TempPathFactory) -> Printed:
    return Printed(published_state(tmp_path_factory.mktemp("printed")))


@SHELLS
@JOB_PARAMS
def test_env_sourced_by_the_job_follows_the_rule(shell: str, printed: Printed, tmp_path: Path, job: str) -> None:
    for nnodes in (None, 1, MULTI[job]):
        script = tmp_path / "printed.sh"
        script.write_text(printed.for_job(job, nnodes))
        assert env_of(shell, f'. "{script}"', base_env(**JOBS[job])) == expected(printed.state, job, nnodes)


def test_env_as_published_ignores_the_calling_environment(state: Path) -> None:
    printed = nccltune("env", "--state-dir", str(state), "--format", "env", "--as-published",
                       env=base_env(NCCLTUNE_DISABLE="1", NCCL_IB_HCA="mlx5_0"))
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith((state / "nccl.env").read_text())
    assert "NCCL_IB_HCA=^mlx5_2\n" in printed.stdout.splitlines(keepends=True)
    assert "not applied" not in printed.stdout and "kept" not in printed.stdout


def test_env_names_what_the_job_keeps(state: Path) -> None:
    printed = nccltune("env", "--state-dir", str(state), "--format", "env",
                       env=base_env(NCCL_IB_HCA="mlx5_0"))
    assert printed.returncode == 0, printed.stderr
    assert "# NCCL_IB_HCA: set by the job, its own value is kept\n" in printed.stdout
    assert "NCCL_IB_HCA=^mlx5_2" not in printed.stdout
    assert "NCCL_NVLS_ENABLE=0\n" in printed.stdout


def run_wrapper(shell: str, tmp_path: Path, state: Path, args: list[str],
                job: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    bindir = tmp_path / "bin"
    if not bindir.exists():
        bindir.mkdir()
        (bindir / "torchrun").write_text("#!/bin/sh\nexec env -0\n")
        (bindir / "torchrun").chmod(0o755)
    return subprocess.run([shell, str(WRAPPER), *args], capture_output=True, timeout=60,
                          env=base_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
                                       NCCLTUNE_ENV_FILE=str(state / "nccl.sh"), **job))


@requires_root
@SHELLS
@JOB_PARAMS
def test_torchrun_wrapper_follows_the_rule(shell: str, tmp_path: Path, state: Path, job: str) -> None:
    for nnodes in SHELL_SHAPES[job]:
        # torchrun's own spellings of a shape: --standalone, --nnodes N, --nnodes=N:N, none.
        args = {None: [], 1: ["--standalone"], 2: ["--nnodes", "2"], 3: ["--nnodes=3"], 8: ["--nnodes", "8:8"]}[nnodes]
        proc = run_wrapper(shell, tmp_path, state, [*args, "train.py"], JOBS[job])
        assert proc.returncode == 0, proc.stderr
        pairs = (item.decode().partition("=") for item in proc.stdout.split(b"\0") if item)
        assert nccl_part({n: v for n, _, v in pairs}) == expected(state, job, nnodes)
        assert b"not using" not in proc.stderr


@requires_root
def test_torchrun_wrapper_names_a_kept_value_that_differs(tmp_path: Path, state: Path) -> None:
    proc = run_wrapper("sh", tmp_path, state, ["train.py"], {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert proc.stderr.decode() == ("nccltune-torchrun: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 set by the job is kept "
                                    "(published: 3)\n")
    same = run_wrapper("sh", tmp_path, state, ["train.py"], {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert same.stderr == b""


@requires_root
def test_torchrun_wrapper_uses_nothing_of_a_file_with_a_line_it_does_not_know(tmp_path: Path, state: Path) -> None:
    gen = state / "generations" / "1" / "nccl.sh"
    gen.write_text(gen.read_text() + "touch /tmp/should-not-run\n")
    proc = run_wrapper("sh", tmp_path, state, ["train.py"], {})
    assert proc.returncode == 0
    pairs = (item.decode().partition("=") for item in proc.stdout.split(b"\0") if item)
    assert nccl_part({n: v for n, _, v in pairs}) == {APPLIED_VAR: "untuned:refused"}
    assert "holds lines other than export NAME='value'" in proc.stderr.decode()


def apply_like_slurm(job: dict[str, str], prolog_stdout: str) -> dict[str, str]:
    """What slurmstepd does with a TaskProlog's stdout: each `export NAME=value` line sets NAME to
    the literal value in the task's environment, over what the job had."""
    env = dict(job)
    for line in prolog_stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value
    return env


@requires_root
@SHELLS
@pytest.mark.parametrize(("job", "nnodes"), [(job, n) for job in JOBS for n in SHELL_SHAPES[job]])
def test_slurm_task_prolog_follows_the_rule(shell: str, state: Path, job: str, nnodes: int | None) -> None:
    # Slurm's own spellings: SLURM_JOB_NUM_NODES, else SLURM_NNODES; none: the job does not say.
    nodes = {} if nnodes is None else {"SLURM_NNODES" if nnodes == 3 else "SLURM_JOB_NUM_NODES": str(nnodes)}
    proc = subprocess.run([shell, str(PROLOG), str(state / "nccl.env")], capture_output=True, text=True,
                          timeout=60, env=base_env(**nodes, **JOBS[job]))
    assert proc.returncode == 0
    assert "not using" not in proc.stdout + proc.stderr
    got = nccl_part(apply_like_slurm(JOBS[job], proc.stdout))
    assert got == expected(state, job, nnodes)


@requires_root
def test_slurm_task_prolog_names_a_kept_value_that_differs(state: Path) -> None:
    proc = subprocess.run(["sh", str(PROLOG), str(state / "nccl.env")], capture_output=True, text=True, timeout=60,
                          env=base_env(NCCL_IB_HCA="mlx5_0"))
    assert "export NCCL_IB_HCA" not in proc.stdout
    # slurmstepd writes a TaskProlog's "print" lines to the task's stdout.
    assert "print nccltune-task-prolog: NCCL_IB_HCA=mlx5_0 set by the job is kept (published: ^mlx5_2)\n" \
        in proc.stdout


# -- the marker of what was applied, through launches inside launches ---------------------------

FORMS = ["exec", "env", "wrapper", "prolog"]


def through(form: str, state: Path, tmp_path: Path, job: dict[str, str], nnodes: int | None) -> dict[str, str]:
    """The NCCL part (marker included) of the environment a job whose own is `job` gets through
    `form` for a job of `nnodes` nodes (None: it does not say), under sh."""
    if form == "exec":
        flags = ["--nnodes", str(nnodes)] if nnodes else []
        proc = subprocess.run([sys.executable, "-m", "nccltune", "exec", "--state-dir", str(state), *flags, "--",
                               "env", "-0"], capture_output=True, timeout=120, env=base_env(**job))
        assert proc.returncode == 0, proc.stderr
        pairs = (item.decode().partition("=") for item in proc.stdout.split(b"\0") if item)
        return nccl_part({n: v for n, _, v in pairs})
    if form == "env":
        flags = ["--nnodes", str(nnodes)] if nnodes else []
        printed = nccltune("env", "--state-dir", str(state), *flags, env=base_env(**job))
        assert printed.returncode == 0, printed.stderr
        script = tmp_path / "printed.sh"
        script.write_text(printed.stdout)
        return env_of("sh", f'. "{script}"', base_env(**job))
    if form == "wrapper":
        args = ["--standalone", "train.py"] if nnodes == 1 else ["--nnodes", str(nnodes), "train.py"] if nnodes \
            else ["train.py"]
        proc = run_wrapper("sh", tmp_path, state, args, job)
        assert proc.returncode == 0, proc.stderr
        pairs = (item.decode().partition("=") for item in proc.stdout.split(b"\0") if item)
        return nccl_part({n: v for n, _, v in pairs})
    nodes = {"SLURM_JOB_NUM_NODES": str(nnodes)} if nnodes else {}
    out = subprocess.run(["sh", str(PROLOG), str(state / "nccl.env")], capture_output=True, text=True, timeout=60,
                         env=base_env(**nodes, **job), check=True).stdout
    return nccl_part(apply_like_slurm(job, out))


def file_marker(state: Path, name: str) -> str:
    """The marker line's value of a published file."""
    [value] = [line.split("=", 1)[1] for line in (state / name).read_text().splitlines()
               if line.startswith(APPLIED_VAR)]
    return value


@requires_root
@pytest.mark.parametrize("form", FORMS)
def test_a_marker_of_the_same_set_keeps_its_names_and_gets_the_applied_ones_after_them(
        state: Path, tmp_path: Path, form: str) -> None:
    got = read_set(state)
    assert got is not None
    job = {APPLIED_VAR: f"{got.set_id}:NCCL_NVLS_ENABLE,NCCL_OTHER", "NCCL_NVLS_ENABLE": "0", "NCCL_ALGO": "Tree"}
    ran = through(form, state, tmp_path, job, 1)
    assert ran == expected(state, job, 1)
    assert ran[APPLIED_VAR] == (f"{got.set_id}:NCCL_NVLS_ENABLE,NCCL_OTHER,NCCL_IB_HCA,NCCL_TOPO_FILE,"
                                "TORCH_NCCL_ASYNC_ERROR_HANDLING,NCCL_MIN_NCHANNELS")


@requires_root
@pytest.mark.parametrize("outer", FORMS)
@pytest.mark.parametrize("inner", FORMS)
def test_a_launch_inside_another_adds_what_it_applies_to_the_marker(
        state: Path, tmp_path: Path, outer: str, inner: str) -> None:
    """The every-job part from one form, the part of the job's shape (one node, or 3 nodes: the
    part for 2) from another inside it: the marker names both parts, as the part's files' own
    marker does; a form inside that adds nothing leaves the marker as it was."""
    nnodes = (1, 3)[(FORMS.index(outer) + FORMS.index(inner)) % 2]
    part, name = (SINGLE, "nccl-single-node.env") if nnodes == 1 else (NODES[2], "current/nccl-nodes-2.env")
    every = through(outer, state, tmp_path, {}, None)
    assert every[APPLIED_VAR] == file_marker(state, "nccl.env")
    both = through(inner, state, tmp_path, every, nnodes)
    assert both == {**every, **part, APPLIED_VAR: file_marker(state, name)}
    assert through(outer, state, tmp_path, both, nnodes) == both


@requires_root
@pytest.mark.parametrize("form", FORMS)
def test_a_form_that_applies_nothing_leaves_the_jobs_marker_as_it_is(state: Path, tmp_path: Path, form: str) -> None:
    everything = {**EVERY, **SINGLE, "NCCL_TOPO_FILE": "/own.xml", APPLIED_VAR: "not a marker"}
    assert through(form, state, tmp_path, everything, 1) == everything


# -- a sweep started from a job that got the set: what nccltune published is never a pin ---------

STATIC_FORMS = ["systemd-environment-file", "sourced-nccl.sh", "cdi-every-job", "cdi-single-node"]


def static_form(form: str, state: Path, job: dict[str, str]) -> dict[str, str]:
    """What the forms that never see the job's environment give it: the files or a CDI device's env
    applied over the job's own (a later EnvironmentFile= of the service's own is not modelled)."""
    got = read_set(state)
    assert got is not None
    if form.startswith("cdi-"):
        spec = render_spec(got.directory, got.env, got.single_node_env, got.set_id)
        [device] = [d for d in spec["devices"] if d["name"] == form.removeprefix("cdi-")]
        return nccl_part({**job, **dict(e.split("=", 1) for e in device["containerEdits"]["env"])})
    if form == "sourced-nccl.sh":
        return env_of("sh", f'. "{state / "nccl.sh"}"; . "{state / "nccl-single-node.sh"}"', base_env(**job))
    # systemd's EnvironmentFile=: NAME=value lines, comments skipped; a later file overrides an earlier one.
    env = dict(job)
    for name in ("nccl.env", "nccl-single-node.env"):
        for line in (state / name).read_text().splitlines():
            if line and not line.startswith(("#", ";")):
                key, _, value = line.partition("=")
                env[key] = value
    return nccl_part(env)


def planned(state: Path, job: dict[str, str]) -> dict[str, object]:
    """`nccltune sweep --plan --json --demo` in the environment `job` (the NCCL part of a job's)."""
    proc = nccltune("sweep", "--plan", "--json", "--demo", "--state-dir", str(state), env=base_env(**job))
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, object] = json.loads(proc.stdout)
    validate(doc, json.loads((REPO / "schemas" / "plan.schema.json").read_text()))
    return doc


def would_pin(env: dict[str, str]) -> dict[str, str]:
    """Of a published part, what the plan would take from the environment as pins (nccltune's own
    topology file never)."""
    return {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_")) and k != "NCCL_TOPO_FILE"}


@requires_root
@pytest.mark.parametrize("form", FORMS + STATIC_FORMS)
def test_a_sweep_from_a_job_that_got_the_set_pins_none_of_it(state: Path, tmp_path: Path, form: str) -> None:
    ran = static_form(form, state, {}) if form in STATIC_FORMS else through(form, state, tmp_path, {}, 1)
    single = form != "cdi-every-job"
    published = would_pin({**EVERY, **(SINGLE if single else {})})
    assert {k: ran[k] for k in published} == published
    doc = planned(state, ran)
    assert doc["pinned"] == {}
    assert doc["from_published"] == {"generation": 1, "env": published}


@requires_root
@pytest.mark.parametrize("form", FORMS)
def test_a_sweep_from_a_job_with_its_own_values_keeps_them_as_pins(state: Path, tmp_path: Path, form: str) -> None:
    """The job's own values, one that differs from the published and one equal to it, are kept by
    the launch and stay pins; the rest of the set is swept."""
    own = {"NCCL_ALGO": "Tree", "NCCL_IB_HCA": "^mlx5_2"}
    doc = planned(state, through(form, state, tmp_path, own, 1))
    assert {n: p["value"] for n, p in doc["pinned"].items()} == own  # type: ignore[attr-defined]
    assert doc["from_published"] == {"generation": 1, "env": would_pin(
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_NVLS_ENABLE": "0", "NCCL_MIN_NCHANNELS": "32"})}


@requires_root
@pytest.mark.parametrize("form", FORMS + STATIC_FORMS)
def test_a_value_the_job_overrode_after_the_launch_stays_a_pin(state: Path, tmp_path: Path, form: str) -> None:
    ran = static_form(form, state, {}) if form in STATIC_FORMS else through(form, state, tmp_path, {}, 1)
    doc = planned(state, {**ran, "NCCL_NVLS_ENABLE": "1"})
    assert {n: p["value"] for n, p in doc["pinned"].items()} == {"NCCL_NVLS_ENABLE": "1"}  # type: ignore[attr-defined]
    assert "NCCL_NVLS_ENABLE" not in doc["from_published"]["env"]  # type: ignore[index]


def test_a_value_of_a_part_by_node_count_named_by_the_marker_is_no_pin(state: Path) -> None:
    """NCCL_ALGO is Ring for one node and Tree for 2 nodes: the value of the part a launch applied
    is the set's, never a pin; a value of no part stays the job's own."""
    from nccltune.delivery.jobenv import from_published

    got = read_set(state)
    assert got is not None
    ran = decide(job_env(got, 3), {}, got.set_id).environment({})
    assert ran["NCCL_ALGO"] == "Tree" and from_published(ran, state).values == {
        k: v for k, v in ran.items() if k != APPLIED_VAR}
    assert "NCCL_ALGO" not in from_published({**ran, "NCCL_ALGO": "NVLS"}, state).values


@requires_root
def test_a_forged_or_stale_marker_makes_every_value_a_pin_and_says_why(state: Path, tmp_path: Path) -> None:
    ran = through("prolog", state, tmp_path, {}, 1)
    got = read_set(state)
    assert got is not None
    for marker in (f"{got.generation}:{'0' * 16}:{ran[APPLIED_VAR].rsplit(':', 1)[1]}",
                   f"{got.generation + 1}:{got.digest}:NCCL_IB_HCA"):
        proc = nccltune("sweep", "--plan", "--json", "--demo", "--state-dir", str(state),
                        env=base_env(**{**ran, APPLIED_VAR: marker}))
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert set(doc["pinned"]) == set(would_pin(ran)) and doc["from_published"] is None
        assert "WARNING" in proc.stderr and f"the set published in {state} is generation 1" in proc.stderr
        assert any("ignored" in note for note in doc["notes"])
