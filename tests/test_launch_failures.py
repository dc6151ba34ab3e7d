"""One failure policy in every launch form (docs/launch-failures.md).

Each form (`nccltune exec`, `nccltune env` sourced, the torchrun wrapper, the Slurm TaskProlog, and
the CDI `files` device, which starts through the wrapper) meets each failure of the published set
(nothing published, a world-writable or another user's state directory, an edited file, a
generation that is gone, a single-node file of another generation, a part by node count's file
missing): the job still runs, with
nothing of the set, the form says so once, and NCCLTUNE_APPLIED=untuned:REASON records it; a job
that already has a marker keeps it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO
from second_user import give, mallory_uid
from test_job_precedence import apply_like_slurm, base_env, env_of, expected, nccl_part, published_state

from nccltune.delivery.jobenv import from_published
from nccltune.publish import read_set
from nccltune.publish.applied import APPLIED_VAR, untuned_reason

WRAPPER = REPO / "launchers" / "nccltune-torchrun"
PROLOG = REPO / "launchers" / "slurm-prolog.sh"
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="the launchers trust only root-owned files")
FORMS = ["exec", "env", "wrapper", "prolog", "cdi-files"]


def world_writable(where: Path) -> None:
    where.chmod(0o777)


def owned_by_another_user(where: Path) -> None:
    give(where, mallory_uid())


def nothing_published(state: Path) -> None:
    shutil.rmtree(state)
    state.mkdir(mode=0o755)
    state.chmod(0o755)


def edited_file(state: Path) -> None:
    for name in ("nccl.sh", "nccl.env"):
        with open(state / "generations" / "1" / name, "a") as fh:
            fh.write("touch /tmp/nccltune-should-not-run\n")


def generation_gone(state: Path) -> None:
    # `current` names a generation that is no longer there (pruned by hand, a disk restored).
    shutil.rmtree(state / "generations" / "1")


def single_node_part_of_another_generation(state: Path) -> None:
    for name in ("nccl-single-node.sh", "nccl-single-node.env"):
        path = state / "generations" / "1" / name
        path.write_text(path.read_text().replace("# generation: 1\n", "# generation: 0\n"))


def part_by_node_count_missing(state: Path) -> None:
    # nccl.sh and nccl.env list the part for 4 nodes: a one-node job's launch refuses the set too.
    for name in ("nccl-nodes-4.sh", "nccl-nodes-4.env"):
        (state / "generations" / "1" / name).unlink()


def pod_view(form: str, state: Path) -> Path:
    """The directory whose trust a form relies on: the state directory, or for the CDI `files`
    device the generation directory it mounts."""
    return state / "generations" / "1" if form == "cdi-files" else state


FAILURES: dict[str, tuple[Callable[[Path], None], str]] = {
    "world-writable-state-dir": (world_writable, "refused"),
    "state-dir-of-another-user": (owned_by_another_user, "refused"),
    "nothing-published": (nothing_published, "nothing-published"),
    "edited-file": (edited_file, "refused"),
    "generation-gone": (generation_gone, "refused"),
    "single-node-file-of-another-generation": (single_node_part_of_another_generation, "refused"),
    "part-by-node-count-missing": (part_by_node_count_missing, "refused"),
}


def through(form: str, state: Path, tmp_path: Path, job: dict[str, str],
            nnodes: int = 1) -> tuple[int, dict[str, str], str]:
    """(exit status, the NCCL part of what the job ran with, what it was told) for a job `job` of
    `nnodes` nodes launched through `form` under sh."""
    if form == "exec":
        proc = subprocess.run([sys.executable, "-m", "nccltune", "exec", "--state-dir", str(state), "--nnodes",
                               str(nnodes), "--", "env", "-0"], capture_output=True, timeout=120, env=base_env(**job))
        pairs = (item.decode().partition("=") for item in proc.stdout.split(b"\0") if item)
        return proc.returncode, nccl_part({n: v for n, _, v in pairs}), proc.stderr.decode()
    if form == "env":
        printed = subprocess.run([sys.executable, "-m", "nccltune", "env", "--state-dir", str(state), "--nnodes",
                                  str(nnodes)], capture_output=True, text=True, timeout=120, env=base_env(**job))
        script = tmp_path / "printed.sh"
        script.write_text(printed.stdout)
        # The job sources what was printed whatever the status (eval "$(nccltune env)").
        return 0, env_of("sh", f'. "{script}"', base_env(**job)), printed.stderr
    if form in ("wrapper", "cdi-files"):
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        (bindir / "torchrun").write_text("#!/bin/sh\nexec env -0\n")
        (bindir / "torchrun").chmod(0o755)
        # The CDI `files` device names the generation's own nccl.sh (publish/cdi.py).
        env_file = state / "generations" / "1" / "nccl.sh" if form == "cdi-files" else state / "nccl.sh"
        proc = subprocess.run(["sh", str(WRAPPER), "--nnodes", str(nnodes), "train.py"], capture_output=True,
                              timeout=60, env=base_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
                                           NCCLTUNE_ENV_FILE=str(env_file), **job))
        pairs = (item.decode().partition("=") for item in proc.stdout.split(b"\0") if item)
        return proc.returncode, nccl_part({n: v for n, _, v in pairs}), proc.stderr.decode()
    proc = subprocess.run(["sh", str(PROLOG), str(state / "nccl.env")], capture_output=True, text=True, timeout=60,
                          env=base_env(SLURM_JOB_NUM_NODES=str(nnodes), **job))
    told = "\n".join(line.removeprefix("print ") for line in proc.stdout.splitlines() if line.startswith("print "))
    return proc.returncode, nccl_part(apply_like_slurm(job, proc.stdout)), told + proc.stderr


@requires_root
@pytest.mark.parametrize("nnodes", [1, 3, 8])
@pytest.mark.parametrize("form", FORMS)
def test_a_usable_set_is_applied_by_every_form(tmp_path: Path, form: str, nnodes: int) -> None:
    state = published_state(tmp_path)
    got = read_set(state)
    assert got is not None
    rc, env, told = through(form, state, tmp_path, {}, nnodes)
    assert rc == 0 and "untuned" not in told, told
    # The part of the job's shape: the single-node part, the part for 2 nodes, the part for 4.
    assert (env.get("NCCL_ALGO"), env.get("NCCL_MIN_NCHANNELS")) == {1: ("Ring", "32"), 3: ("Tree", None),
                                                                    8: (None, "16")}[nnodes]
    assert env == expected(state, {}, nnodes) and env[APPLIED_VAR].startswith(f"{got.set_id}:")


@requires_root
@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("form", FORMS)
def test_every_form_runs_the_job_untuned_says_so_once_and_marks_it(tmp_path: Path, form: str, failure: str) -> None:
    state = published_state(tmp_path)
    break_it, reason = FAILURES[failure]
    if form == "cdi-files" and failure in ("nothing-published", "generation-gone"):
        pytest.skip("the CDI spec names a generation's directory: without it the runtime has nothing to mount")
    # A pod sees the generation directory only (the device's mount): its directory is the state's.
    break_it(pod_view(form, state) if break_it in (world_writable, owned_by_another_user) else state)
    rc, env, told = through(form, state, tmp_path, {"NCCL_ALGO": "Tree"})
    assert rc == 0, told
    # Nothing of the set, the job's own value kept, and the marker of an untuned launch.
    assert env == {"NCCL_ALGO": "Tree", APPLIED_VAR: f"untuned:{reason}"}, told
    # Said once; the prolog, whose only voice is the task's stdout, says a refused set only.
    said = 0 if (form, reason) == ("prolog", "nothing-published") else 1
    assert told.count("the job runs untuned (NCCL's defaults)") == said, told
    assert len([line for line in told.splitlines() if line]) == said, told
    assert not Path("/tmp/nccltune-should-not-run").exists()


@requires_root
@pytest.mark.parametrize("form", FORMS)
def test_a_marker_of_an_earlier_launch_stays_when_the_set_cannot_be_used(tmp_path: Path, form: str) -> None:
    state = published_state(tmp_path)
    world_writable(pod_view(form, state))
    earlier = {APPLIED_VAR: "7:0123456789abcdef:NCCL_ALGO", "NCCL_ALGO": "Ring"}
    rc, env, told = through(form, state, tmp_path, earlier)
    assert rc == 0 and env == earlier and "runs untuned" in told


@requires_root
@pytest.mark.parametrize("form", FORMS)
def test_an_opted_out_job_reads_nothing_and_is_told_nothing(tmp_path: Path, form: str) -> None:
    state = published_state(tmp_path)
    world_writable(state)
    rc, env, told = through(form, state, tmp_path, {"NCCLTUNE_DISABLE": "1"})
    assert rc == 0 and env == {} and "untuned" not in told and "not using" not in told


def test_env_prints_the_untuned_job_and_exits_with_the_failures_code(tmp_path: Path) -> None:
    state = published_state(tmp_path)
    world_writable(state)
    got = subprocess.run([sys.executable, "-m", "nccltune", "env", "--state-dir", str(state), "--format", "env"],
                         capture_output=True, text=True, timeout=120, env=base_env())
    assert got.returncode == 78 and "world-writable" in got.stderr
    assert got.stdout.splitlines()[-1] == "NCCLTUNE_APPLIED=untuned:refused"
    assert all("=" not in line for line in got.stdout.splitlines() if line.startswith("#"))
    # Inspection is no launch: the files as they are, or the error.
    shown = subprocess.run([sys.executable, "-m", "nccltune", "env", "--state-dir", str(state), "--json"],
                           capture_output=True, text=True, timeout=120, env=base_env())
    assert shown.returncode == 78 and shown.stdout == ""


def test_an_untuned_marker_is_no_foreign_marker_for_a_sweep(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = published_state(tmp_path)
    assert untuned_reason("untuned:refused") == "refused" and untuned_reason("untuned:other") is None
    got = from_published({APPLIED_VAR: "untuned:refused", "NCCL_ALGO": "Tree"}, state)
    assert got.values == {} and got.own({APPLIED_VAR: "untuned:refused", "NCCL_ALGO": "Tree"}) == {"NCCL_ALGO": "Tree"}
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
