"""The systemd units (systemd-analyze verify), the torchrun wrapper and the Slurm TaskProlog."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

CHECK_UNITS = REPO / ".ci" / "check-units"
WRAPPER = REPO / "launchers" / "nccltune-torchrun"
PROLOG = REPO / "launchers" / "slurm-prolog.sh"

IS_ROOT = os.geteuid() == 0
# A root-owned file can only be made by root; without it the scripts (rightly) refuse everything.
requires_root = pytest.mark.skipif(not IS_ROOT, reason="needs root to own the env file")
HAS_ANALYZE = shutil.which("systemd-analyze") is not None or os.access("/usr/bin/systemd-analyze", os.X_OK)


def _shells() -> list[list[str]]:
    """POSIX shells to run the scripts with: /bin/sh plus the others found, once each."""
    found: dict[str, list[str]] = {}
    for argv in (["/bin/sh"], ["dash"], ["bash", "--posix"], ["busybox", "sh"]):
        exe = shutil.which(argv[0])
        if exe is None:
            continue
        key = os.path.realpath(exe) + " ".join(argv[1:])
        found.setdefault(key, [exe, *argv[1:]])
    return list(found.values())


SHELLS = pytest.mark.parametrize("shell", _shells(), ids=lambda argv: " ".join(map(os.path.basename, argv)))


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL", "TORCH_NCCL"))}
    env.update(extra)
    return env


# --- unit files ---------------------------------------------------------------------------------


def test_scripts_are_executable() -> None:
    for path in (CHECK_UNITS, WRAPPER, PROLOG):
        assert path.stat().st_mode & stat.S_IXUSR, f"{path} is not executable"


@pytest.mark.skipif(not HAS_ANALYZE, reason="systemd-analyze is not installed")
def test_check_units_passes() -> None:
    proc = subprocess.run([str(CHECK_UNITS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok (2 units" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.skipif(not HAS_ANALYZE, reason="systemd-analyze is not installed")
def test_check_units_fails_on_a_mere_warning(tmp_path: Path) -> None:
    unit = tmp_path / "nccltune.service"
    text = (REPO / "systemd" / "nccltune.service").read_text()
    assert "\nLockPersonality=yes\n" in text
    unit.write_text(text.replace("\nLockPersonality=yes\n", "\nLockPersonalty=yes\n"))
    proc = subprocess.run([str(CHECK_UNITS), str(unit)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "LockPersonalty" in proc.stderr
    assert str(unit) in proc.stderr


def test_units_keep_devices_visible() -> None:
    for name in ("nccltune.service", "nccltune-sweep.service"):
        settings = [
            line.split("=", 1)[0]
            for line in (REPO / "systemd" / name).read_text().splitlines()
            if line and not line.startswith("#")
        ]
        # ProtectKernelModules= is not among them: it hides /usr/lib/modules, not /dev.
        for hiding in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "Nice", "IOSchedulingClass"):
            assert hiding not in settings, f"{name} sets {hiding}"


# --- nccltune-torchrun --------------------------------------------------------------------------


@pytest.fixture
def fake_torchrun(tmp_path: Path) -> Path:
    """A `torchrun` that prints its arguments and the NCCL variables it was given."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "torchrun"
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do printf \'ARG:%s\\n\' "$a"; done\n'
        "env | grep -E '^(NCCL|TORCH_NCCL)_' | LC_ALL=C sort\n"
    )
    script.chmod(0o755)
    return bindir


@pytest.fixture
def env_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    return d


def run_wrapper(shell: list[str], bindir: Path, env_file: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", NCCLTUNE_ENV_FILE=str(env_file))
    return subprocess.run(
        [*shell, str(WRAPPER), "--nproc-per-node", "8", "train.py", "--name", "two words"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


# As nccltune writes nccl.sh: every value single-quoted.
GOOD_SH = "export NCCL_ALGO='Ring'\nexport NCCL_IB_HCA='^mlx5_2'\nexport TORCH_NCCL_ASYNC_ERROR_HANDLING='1'\n"
ARGS = "ARG:--nproc-per-node\nARG:8\nARG:train.py\nARG:--name\nARG:two words\n"


@requires_root
@SHELLS
def test_wrapper_sources_trusted_file(shell: list[str], fake_torchrun: Path, env_dir: Path) -> None:
    env_file = env_dir / "nccl.sh"
    env_file.write_text(GOOD_SH)
    env_file.chmod(0o644)
    proc = run_wrapper(shell, fake_torchrun, env_file)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout == ARGS + "NCCL_ALGO=Ring\nNCCL_IB_HCA=^mlx5_2\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\n"


@requires_root
@SHELLS
@pytest.mark.parametrize(
    ("file_mode", "dir_mode", "why"),
    [
        (0o664, 0o755, "the file is group-writable"),
        (0o646, 0o755, "the file is world-writable"),
        (0o666, 0o755, "the file is world-writable"),
        (0o644, 0o777, "the directory is world-writable"),
        (0o644, 0o775, "the directory is group-writable"),
        (0o644, 0o757, "the directory is world-writable"),
    ],
)
def test_wrapper_refuses_writable_file(
    shell: list[str], fake_torchrun: Path, env_dir: Path, file_mode: int, dir_mode: int, why: str
) -> None:
    env_file = env_dir / "nccl.sh"
    env_file.write_text(GOOD_SH)
    env_file.chmod(file_mode)
    env_dir.chmod(dir_mode)
    proc = run_wrapper(shell, fake_torchrun, env_file)
    # Still launched, without the settings, and saying why.
    assert proc.returncode == 0
    assert proc.stdout == ARGS
    assert f"not using {env_file}: {why}" in proc.stderr


@requires_root
def test_wrapper_accepts_sticky_directory(fake_torchrun: Path, env_dir: Path) -> None:
    env_file = env_dir / "nccl.sh"
    env_file.write_text(GOOD_SH)
    env_dir.chmod(0o1777)
    proc = run_wrapper(["/bin/sh"], fake_torchrun, env_file)
    assert "NCCL_ALGO=Ring" in proc.stdout, proc.stderr


@SHELLS
def test_wrapper_refuses_file_not_owned_by_root(shell: list[str], fake_torchrun: Path, env_dir: Path) -> None:
    env_file = env_dir / "nccl.sh"
    env_file.write_text(GOOD_SH)
    if IS_ROOT:
        os.chown(env_file, 65534, 65534)
    proc = run_wrapper(shell, fake_torchrun, env_file)
    assert proc.returncode == 0
    assert proc.stdout == ARGS
    assert "not root" in proc.stderr


@requires_root
def test_wrapper_refuses_symlink(fake_torchrun: Path, env_dir: Path) -> None:
    target = env_dir / "real.sh"
    target.write_text(GOOD_SH)
    (env_dir / "nccl.sh").symlink_to(target)
    proc = run_wrapper(["/bin/sh"], fake_torchrun, env_dir / "nccl.sh")
    assert proc.stdout == ARGS
    assert "not a regular file" in proc.stderr


def _published_set(state: Path, env: dict[str, str]) -> None:
    from publishing import publish_set

    from nccltune.publish import Provenance

    publish_set(state, env, Provenance("0", "now", "f", None, "nccl", False, None))


@requires_root
@SHELLS
def test_wrapper_sources_a_published_set_through_its_links(
    shell: list[str], fake_torchrun: Path, env_dir: Path
) -> None:
    _published_set(env_dir, {"NCCL_ALGO": "Ring"})
    _published_set(env_dir, {"NCCL_ALGO": "Tree"})
    proc = run_wrapper(shell, fake_torchrun, env_dir / "nccl.sh")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == ARGS + "NCCL_ALGO=Tree\n"
    prolog = run_prolog(shell, env_dir / "nccl.env")
    from nccltune.publish import read_set

    got = read_set(env_dir)
    assert got is not None and got.generation == 2
    # With what it exports, the marker of what it exported (the set's generation and digest).
    marker = f"export NCCLTUNE_APPLIED={got.set_id}:NCCL_ALGO\n"
    assert (prolog.stdout, prolog.stderr) == (f"export NCCL_ALGO=Tree\n{marker}", "")


@requires_root
@SHELLS
def test_launchers_refuse_a_mixed_set(shell: list[str], fake_torchrun: Path, env_dir: Path) -> None:
    _published_set(env_dir, {"NCCL_ALGO": "Ring"})
    _published_set(env_dir, {"NCCL_ALGO": "Tree"})
    for name in ("nccl.sh", "nccl.env"):
        shutil.copy(env_dir / "generations" / "1" / name, env_dir / "generations" / "2" / name)
    proc = run_wrapper(shell, fake_torchrun, env_dir / "nccl.sh")
    assert proc.stdout == ARGS
    assert "not of generation 2" in proc.stderr and "mixed set" in proc.stderr
    prolog = run_prolog(shell, env_dir / "nccl.env")
    assert exports(prolog.stdout) == [REFUSED] and "mixed set" in said(prolog.stdout)


@requires_root
@pytest.mark.parametrize("where", ["generations", "generations/1"])
def test_launchers_check_every_directory_of_the_set(fake_torchrun: Path, env_dir: Path, where: str) -> None:
    _published_set(env_dir, {"NCCL_ALGO": "Ring"})
    (env_dir / where).chmod(0o777)
    proc = run_wrapper(["/bin/sh"], fake_torchrun, env_dir / "nccl.sh")
    assert proc.stdout == ARGS and "world-writable" in proc.stderr
    prolog = run_prolog(["/bin/sh"], env_dir / "nccl.env")
    assert exports(prolog.stdout) == [REFUSED] and "world-writable" in said(prolog.stdout)


@requires_root
def test_wrapper_does_not_half_apply_broken_file(fake_torchrun: Path, env_dir: Path) -> None:
    env_file = env_dir / "nccl.sh"
    env_file.write_text(GOOD_SH + "if then\n")
    proc = run_wrapper(["/bin/sh"], fake_torchrun, env_file)
    assert proc.returncode == 0
    assert proc.stdout == ARGS  # nothing of the file applied, torchrun still runs
    assert "it holds lines other than export NAME='value'" in proc.stderr


def test_wrapper_without_file_runs_torchrun_untuned_and_says_so_once(fake_torchrun: Path, env_dir: Path) -> None:
    proc = run_wrapper(["/bin/sh"], fake_torchrun, env_dir / "absent.sh")
    assert proc.returncode == 0
    assert proc.stdout == ARGS
    assert proc.stderr == (f"nccltune-torchrun: nothing is published at {env_dir / 'absent.sh'}; the job runs "
                           "untuned (NCCL's defaults)\n")


def test_wrapper_passes_torchrun_exit_status(tmp_path: Path, env_dir: Path) -> None:
    bindir = tmp_path / "failbin"
    bindir.mkdir()
    (bindir / "torchrun").write_text("#!/bin/sh\nexit 7\n")
    (bindir / "torchrun").chmod(0o755)
    assert run_wrapper(["/bin/sh"], bindir, env_dir / "absent.sh").returncode == 7


# --- Slurm TaskProlog ---------------------------------------------------------------------------


def run_prolog(shell: list[str], env_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*shell, str(PROLOG), str(env_file)], capture_output=True, text=True, env=clean_env(), timeout=60
    )


# What the prolog exports for a set it refuses (docs/launch-failures.md): the untuned marker only.
REFUSED = "export NCCLTUNE_APPLIED=untuned:refused"


def exports(stdout: str) -> list[str]:
    """The prolog's export lines, in order."""
    return [line for line in stdout.splitlines() if line.startswith("export ")]


def said(stdout: str) -> str:
    """What the prolog told the job: its "print" lines (slurmd discards a TaskProlog's stderr)."""
    lines = stdout.splitlines()
    assert all(line.startswith(("export ", "print ")) for line in lines), stdout
    return "\n".join(line.removeprefix("print ") for line in lines if line.startswith("print "))


@requires_root
@SHELLS
def test_prolog_uses_nothing_of_a_file_with_a_foreign_line_and_runs_nothing(shell: list[str], env_dir: Path) -> None:
    marker = env_dir.parent / "pwned"
    env_file = env_dir / "nccl.env"
    hostile = [
        f"NCCL_X=$(touch {marker})",
        f"NCCL_Y=`touch {marker}`",
        f"NCCL_Z=1;touch {marker}",
        f"NCCL_W=1 && touch {marker}",
        f"NCCL_V=1\ttouch {marker}",
        f'NCCL_Q="$(touch {marker})"',
        "NCCL_CR=1\r",
        "LD_PRELOAD=/tmp/evil.so",
        "PATH=/tmp/evil",
        "nccl_lower=1",
        "NCCL_lower=1",
        "NCCL_EMPTY=",
        "export NCCL_EXPORTED=1",
        " NCCL_INDENTED=1",
        "NCCL_=1",
    ]
    valid = ["NCCL_ALGO=Ring", "NCCL_IB_HCA=^mlx5_2,mlx5_0:1", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
             "NCCL_TOPO_FILE=/var/lib/nccltune/ncclTopology.xml", "NCCLTUNE_PROFILE=llm-training",
             "NCCL_DEBUG_SUBSYS=INIT,ENV", "NCCL_SOCKET_IFNAME=%eth0,=ib0,+eth1@x"]
    env_file.write_text(
        "# published by nccltune\n"
        "NCCL_ALGO=Ring\n"
        + "\n".join(hostile[:4])
        + "\n\nNCCL_IB_HCA=^mlx5_2,mlx5_0:1\n"
        + "\n".join(hostile[4:])
        + "\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\n"
        "NCCL_TOPO_FILE=/var/lib/nccltune/ncclTopology.xml\n"
        "NCCLTUNE_PROFILE=llm-training\n"
        "NCCL_DEBUG_SUBSYS=INIT,ENV\n"
        "NCCL_SOCKET_IFNAME=%eth0,=ib0,+eth1@x"  # no final newline
    )
    env_file.chmod(0o644)
    proc = run_prolog(shell, env_file)
    assert proc.returncode == 0
    # The set is used whole or not at all (docs/launch-failures.md): nothing of it, one line why.
    assert exports(proc.stdout) == [REFUSED]
    assert said(proc.stdout).count("\n") == 0 and proc.stderr == ""
    assert f"holds {len(hostile)} line(s) that are not NAME=value with a plain value" in said(proc.stdout)
    assert "the job runs untuned" in said(proc.stdout)
    assert not marker.exists()
    # Only the valid lines: all of them exported.
    env_file.write_text("".join(line + "\n" for line in valid))
    proc = run_prolog(shell, env_file)
    assert exports(proc.stdout) == [f"export {line}" for line in valid] and proc.stdout.count("print ") == 0


@requires_root
@SHELLS
def test_prolog_refuses_group_writable_file(shell: list[str], env_dir: Path) -> None:
    env_file = env_dir / "nccl.env"
    env_file.write_text("NCCL_ALGO=Ring\n")
    env_file.chmod(0o664)
    proc = run_prolog(shell, env_file)
    assert proc.returncode == 0
    assert exports(proc.stdout) == [REFUSED]
    assert "group-writable" in said(proc.stdout)


def test_prolog_refuses_file_not_owned_by_root(env_dir: Path) -> None:
    env_file = env_dir / "nccl.env"
    env_file.write_text("NCCL_ALGO=Ring\n")
    if IS_ROOT:
        os.chown(env_file, 65534, 65534)
    proc = run_prolog(["/bin/sh"], env_file)
    assert proc.returncode == 0
    assert exports(proc.stdout) == [REFUSED]
    assert "not root" in said(proc.stdout)


def test_prolog_without_file_marks_the_task_untuned_and_prints_nothing(env_dir: Path) -> None:
    # Its only voice is every task's stdout: a node that has published nothing yet is not said.
    proc = run_prolog(["/bin/sh"], env_dir / "absent.env")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "export NCCLTUNE_APPLIED=untuned:nothing-published\n", "")


def _trust_check(script: Path) -> str:
    """The shell functions that decide whether a published file may be used (how each launcher
    warns differs: the prolog's warnings must be print lines, slurmd discards its stderr)."""
    text = script.read_text()
    start = text.index("nccltune_mode_ok() {")
    end = text.index("\n}\n", text.index("nccltune_trusted() {")) + 3
    return text[start:end]


def test_the_launchers_share_one_trust_check_word_for_word() -> None:
    # Each launcher installs as a single file, so each carries the check; they must not drift.
    prolog = _trust_check(REPO / "launchers" / "slurm-prolog.sh")
    wrapper = _trust_check(REPO / "launchers" / "nccltune-torchrun")
    assert "nccltune_mode_ok" in prolog and "nccltune_ls" in prolog
    assert prolog == wrapper
