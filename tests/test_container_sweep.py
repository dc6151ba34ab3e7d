"""bench.image: a CPU-demo sweep whose ranks run the worker in a real image under a real podman
(the image built from Debian packages by .ci/install-test-image, cached under .cache/, and run as
its unpacked root filesystem), and the command lines, refusals and class facts around it."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from demo_state import SHORT_CONFIG, SNAPSHOT
from second_user import MALLORY, mallory_uid

from nccltune.config.schema import BenchConfig
from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.images import parse_image
from nccltune.topology.nodeclass import node_class
from nccltune.topology.source import load_topology
from nccltune.trials.container import COLLECTIVES_MOUNT, WORKER_MOUNT, Container, from_config, pick_runtime

DIGEST = "sha256:" + "ab" * 32
SWEEP_S = 400.0  # five trials, each two containers started on a loaded 2-core machine


def sweep(tmp: Path, bench: dict[str, object], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cfg = {**SHORT_CONFIG, "bench": bench}
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", str(SNAPSHOT), "--json",
                           "--config", str(tmp / "config.yaml"), "--state-dir", str(tmp / "state")],
                          capture_output=True, text=True, timeout=SWEEP_S, stdin=subprocess.DEVNULL,
                          env=env or dict(os.environ))


def test_a_tag_alone_is_refused_at_its_line(tmp_path: Path) -> None:
    got = sweep(tmp_path, {"image": ["docker.io/library/debian:bookworm"]})
    assert got.returncode == EXIT_CONFIG, got.stderr
    assert re.search(r"config\.yaml:\d+: bench\.image: 'docker\.io/library/debian:bookworm' does not name its "
                     r"image by digest", got.stderr), got.stderr


def test_one_image_per_sweep(tmp_path: Path) -> None:
    got = sweep(tmp_path, {"image": [f"a@{DIGEST}", f"b@{DIGEST}"]})
    assert got.returncode == EXIT_CONFIG and "lists 2 images; a sweep measures in one" in got.stderr, got.stderr


def test_a_joining_node_with_an_image_runs_its_agent_in_that_image(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`sweep --join` with bench.image hands join() the container and the image's python, as the
    coordinator's own agent runs (the whole two-node run: bench/container_two_nodes.py)."""
    from nccltune.cli import main
    from nccltune.trials import container as container_mod
    from nccltune.trials.launch import torchrun

    monkeypatch.setattr(container_mod, "runtime_executable", lambda name: f"/usr/bin/{name}")
    got: dict[str, object] = {}

    def join(endpoint: tuple[str, int], **kwargs: object) -> int:
        got.update(kwargs, endpoint=endpoint)
        return 0

    monkeypatch.setattr(torchrun, "join", join)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"bench": {"image": [f"a@{DIGEST}"]}}))
    rc = main(["sweep", "--join", "127.0.0.1:29400", "--demo", "--config", str(tmp_path / "config.yaml"),
               "--state-dir", str(tmp_path / "state")])
    assert rc == 0
    ctr = got["container"]
    assert isinstance(ctr, Container) and ctr.image.digest == DIGEST and ctr.gpus is False
    assert got["python"] == container_mod.IMAGE_PYTHON and got["endpoint"] == ("127.0.0.1", 29400)


def test_parse_image_keeps_the_digest() -> None:
    image = parse_image(f"registry.example/team/train:24.05@{DIGEST}")
    assert image.digest == DIGEST and image.ref.endswith(DIGEST) and image.rootfs is None
    with pytest.raises(InputError, match="by digest"):
        parse_image("registry.example/team/train@sha256:abc")


def test_an_unpacked_root_filesystem_is_an_absolute_directory_by_digest() -> None:
    image = parse_image(f"/srv/images/train@{DIGEST}")
    assert (image.rootfs, image.digest) == ("/srv/images/train", DIGEST)
    assert parse_image(f"srv/images/train@{DIGEST}").rootfs is None  # a relative path is an image name
    for ref in (f"./train@{DIGEST}", f"/srv/images/../train@{DIGEST}", f"/srv/images/train/@{DIGEST}",
                f"/srv//train@{DIGEST}", "/srv/images/train", f"/srv/my images@{DIGEST}"):
        with pytest.raises(InputError, match="by digest"):
            parse_image(ref)


def test_a_root_filesystem_runs_read_only_under_podman_alone(tmp_path: Path) -> None:
    worker = REPO / "nccltune" / "trials"
    c = Container("podman", parse_image(f"{tmp_path}@{DIGEST}"), worker, uid=990, gid=991, gpus=False)
    argv = c.argv(c.worker_argv(["--probe"]), {"PATH": "/usr/bin"}, None, Path("/"))
    assert "--read-only" in argv and f"img@{DIGEST}" not in " ".join(argv)
    at = argv.index("--rootfs")
    assert argv[at + 1] == str(tmp_path) and argv[at + 2:] == ["python3", "-I", f"{WORKER_MOUNT}/worker.py", "--probe"]
    for runtime in ("docker", "enroot"):
        with pytest.raises(InputError, match=r"cannot run bench\.image's unpacked root filesystem"):
            pick_runtime(runtime, rootfs=True)
    # The directory must pass the trust rule: the ranks of every trial run what is in it.
    shared = tmp_path / "shared"
    (shared / "rootfs").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(InputError, match="world-writable"):
        from_config(BenchConfig(image=[f"{shared / 'rootfs'}@{DIGEST}"], runtime="podman"), demo=True)
    with pytest.raises(InputError, match=r"cannot run bench\.image's unpacked root filesystem"):
        from_config(BenchConfig(image=[f"{tmp_path}@{DIGEST}"], runtime="docker"), demo=True)


def test_podman_command_line_mounts_only_the_worker_and_the_trial(tmp_path: Path) -> None:
    worker = REPO / "nccltune" / "trials"
    c = Container("podman", parse_image(f"img@{DIGEST}"), worker, uid=990, gid=991, gpus=True)
    argv = c.argv(c.worker_argv(["--backend", "nccl"]), {"NCCL_ALGO": "Ring", "PATH": "/usr/bin"},
                  tmp_path, tmp_path / "rank")
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert mounts == [f"{worker}:{WORKER_MOUNT}:ro", f"{worker.parent / 'collectives.py'}:{COLLECTIVES_MOUNT}:ro",
                      f"{tmp_path}:{tmp_path}:rw", "/sys:/sys:ro"]
    assert argv[argv.index("--user") + 1] == "990:991"
    assert argv[argv.index("--network") + 1] == "host"
    assert argv[argv.index("--pid") + 1] == "host" and "--init" not in argv
    assert argv[argv.index("--device") + 1] == "nvidia.com/gpu=all"
    # Values stay out of the process list: the runtime hands each variable on by name.
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--env"] == ["NCCL_ALGO", "PATH"]
    assert argv[argv.index(f"img@{DIGEST}") + 1:] == ["python3", "-I", f"{WORKER_MOUNT}/worker.py", "--backend", "nccl"]
    cpu = Container("docker", parse_image(f"img@{DIGEST}"), worker, gpus=False).argv(["true"], {}, tmp_path, tmp_path)
    assert cpu[0] == "docker" and "--device" not in cpu and "--user" not in cpu


def test_a_torchrun_agent_runs_in_the_image_with_the_workers_files_where_they_are_mounted(tmp_path: Path) -> None:
    """A launch puts its own program before the worker (torchrun's agent, rankexec.py): the whole
    line runs in the image, every path into the worker's directory where the image mounts it."""
    from nccltune.trials.launch import TrialSpec
    from nccltune.trials.launch.torchrun import TorchrunLaunch

    worker = REPO / "nccltune" / "trials"
    c = Container("podman", parse_image(f"img@{DIGEST}"), worker, uid=990, gid=991, gpus=False)
    cmd = c.launch_argv(["--backend", "gloo"])
    (spec,) = TorchrunLaunch(1, 2, ("127.0.0.1", 29400)).start(TrialSpec(1, tmp_path, cmd, {"PATH": "/usr/bin"}, {},
                                                                         60.0))
    argv = c.argv(spec.argv, spec.env, tmp_path, tmp_path / "rank", "nccltune-1-1-agent")
    inner = argv[argv.index(f"img@{DIGEST}") + 1:]
    assert inner[:4] == ["python3", "-I", "-m", "torch.distributed.run"]
    assert inner[-4:] == [f"{WORKER_MOUNT}/rankexec.py", f"{WORKER_MOUNT}/worker.py", "--backend", "gloo"]
    assert not [a for a in argv if a.startswith(f"{worker}/")]  # only in the mounts' SRC:DST
    assert argv[argv.index("--network") + 1] == "host" and argv[argv.index("--name") + 1] == "nccltune-1-1-agent"
    assert c.worker_argv(["--probe"]) == ["python3", "-I", f"{WORKER_MOUNT}/worker.py", "--probe"]


def test_enroot_starts_the_container_made_of_the_digest(tmp_path: Path) -> None:
    c = Container("enroot", parse_image(f"img@{DIGEST}"), REPO / "nccltune" / "trials")
    argv = c.argv(["python3", "-V"], {"NCCL_ALGO": "Ring"}, tmp_path, tmp_path / "rank")
    assert argv[:2] == ["enroot", "start"] and f"nccltune-{'ab' * 16}" in argv
    assert argv[-2:] == ["python3", "-V"] and str(tmp_path / "rank") in argv
    assert not c.switches_user  # enroot runs as its caller: the runner becomes bench.user first


def test_enroot_makes_each_mount_point_the_image_lacks(tmp_path: Path) -> None:
    """enroot-mount refuses a mount point missing from the container's tree, and the trial's
    directory never is in it: every mount creates its own (x-create), a directory or a file as
    its source is."""
    worker = REPO / "nccltune" / "trials"
    c = Container("enroot", parse_image(f"img@{DIGEST}"), worker, gpus=False)
    argv = c.argv(["python3", "-V"], {}, tmp_path, tmp_path / "rank")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"] == [
        f"{worker}:{WORKER_MOUNT}:none,x-create=dir,bind,ro",
        f"{worker.parent / 'collectives.py'}:{COLLECTIVES_MOUNT}:none,x-create=file,bind,ro",
        f"{tmp_path}:{tmp_path}:none,x-create=dir,bind,rw"]
    probe = c.argv(c.worker_argv(["--probe"]), {}, None, Path("/"))
    assert [probe[i + 1].rsplit(":", 1)[1] for i, a in enumerate(probe) if a == "--mount"] == [
        "none,x-create=dir,bind,ro", "none,x-create=file,bind,ro"]


def test_enroot_runs_the_rank_without_a_login_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """enroot's default runs the command through the user's login shell, and bench.user's is
    nologin: enroot's environment turns it off, over the caller's own setting; podman's has none."""
    monkeypatch.setenv("ENROOT_LOGIN_SHELL", "true")
    monkeypatch.setenv("ENROOT_DATA_PATH", "/var/lib/enroot/data")
    worker = REPO / "nccltune" / "trials"
    got = Container("enroot", parse_image(f"img@{DIGEST}"), worker).runtime_env({"NCCL_ALGO": "Ring"})
    assert got["ENROOT_LOGIN_SHELL"] == "false" and got["ENROOT_DATA_PATH"] == "/var/lib/enroot/data"
    assert got["NCCL_ALGO"] == "Ring"
    podman = Container("podman", parse_image(f"img@{DIGEST}"), worker).runtime_env({"NCCL_ALGO": "Ring"})
    assert podman["ENROOT_LOGIN_SHELL"] == "true"  # the caller's, which podman ignores


def test_the_image_is_a_fact_of_the_class() -> None:
    topo = load_topology(str(SNAPSHOT))
    host = node_class(topo, nccl_version="2.28.9")
    in_image = node_class(topo, nccl_version="2.28.9", image_digest=DIGEST)
    other = node_class(topo, nccl_version="2.28.9", image_digest="sha256:" + "cd" * 32)
    assert "image_digest" not in host.facts and in_image.facts["image_digest"] == DIGEST
    assert len({host.id, in_image.id, other.id}) == 3


@pytest.fixture(scope="module")
def test_image() -> tuple[str, dict[str, str]]:
    """The image by digest and the environment podman needs on this machine (.ci/install-test-image,
    which tests/run starts before its lint steps: this call then waits for that build)."""
    if os.geteuid() != 0 or (shutil.which("apt-get") is None and shutil.which("podman") is None):
        pytest.skip("the test image is built as root, with podman from apt-get")
    got = subprocess.run(["bash", str(REPO / ".ci" / "install-test-image")], capture_output=True, text=True,
                         timeout=900, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHON": sys.executable})
    assert got.returncode == 0, got.stderr[-3000:]
    ref = got.stdout.strip().splitlines()[-1]
    env = dict(os.environ)
    for line in (REPO / ".cache" / "test-image" / "env").read_text().split("export ", 1)[1].split():
        name, _, value = line.partition("=")
        env[name] = value
    return ref, env


def test_a_demo_sweep_runs_its_ranks_in_the_image(tmp_path: Path, test_image: tuple[str, dict[str, str]]) -> None:
    ref, env = test_image
    uid = mallory_uid()
    got = sweep(tmp_path, {"image": [ref], "runtime": "podman", "user": MALLORY}, env)
    assert got.returncode == 0, got.stderr[-3000:]
    state = tmp_path / "state"
    # The marker only the image has, said by the worker's own interpreter, as bench.user.
    rank0 = sorted(state.glob("runs/*/trial-001/rank0.err"))
    assert rank0 and f"nccltune-test-image uid={uid}" in rank0[0].read_text(), rank0
    with sqlite3.connect(state / "history.db") as db:
        summary = json.loads(db.execute("SELECT summary_json FROM runs").fetchone()[0])
    image = summary["image"]
    rootfs = parse_image(ref).rootfs
    assert rootfs is not None and image["image_rootfs"] == rootfs
    assert image["image"] == ref and image["image_digest"] == ref.split("@", 1)[1]
    assert image["image_os"] == "Debian GNU/Linux 12 (bookworm)" and image["runtime"] == "podman"
    # torch's NCCL library file as the worker found it mapped: a path in the image (CPU torch: none).
    assert "image_nccl_lib" not in image
    assert image["image_torch_version"] == summary["torch_version"] == "2.13.0+cpu"
    # The python the probe found is the image's (Debian's), whatever the host's is.
    rootfs_python = subprocess.run(["chroot", rootfs, "python3", "-c",
                                    "import platform; print(platform.python_version())"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    assert image["image_python"] == rootfs_python
    published = json.loads((state / "nccl.json").read_text())
    assert published["provenance"]["image"] == image
    assert json.loads(got.stdout)["image"] == image  # sweep --json says it too


def test_a_killed_rank_leaves_no_container(tmp_path: Path, test_image: tuple[str, dict[str, str]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What the runner does at a timeout: SIGKILL to the client's group, then `remove` by name. The
    container's root cannot write the shared root filesystem, only its own /tmp."""
    ref, env = test_image
    rootfs = Path(str(parse_image(ref).rootfs))
    for name in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF"):
        monkeypatch.setenv(name, env[name])  # the runtime's own settings come from nccltune's environment
    c = Container("podman", parse_image(ref), REPO / "nccltune" / "trials", gpus=False)
    name = f"nccltune-test-{os.getpid()}"
    script = "touch /etc/planted; touch /tmp/own && exec sleep 300"
    argv = c.argv(["sh", "-c", script], {"PATH": "/usr/bin:/bin"}, tmp_path, tmp_path, name)
    client = subprocess.Popen(argv, env=c.runtime_env({"PATH": os.environ["PATH"]}), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def running() -> list[str]:
        got = subprocess.run(["podman", "ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Names}}"],
                             capture_output=True, text=True, env=env, check=True)
        return got.stdout.split()

    try:
        for _ in range(120):
            if running():
                break
            subprocess.run(["sleep", "0.5"], check=True)
        assert running() == [name]
    finally:
        os.killpg(client.pid, 9)
        client.wait()
        c.remove([name])
    assert running() == []
    assert not (rootfs / "etc" / "planted").exists() and not (rootfs / "tmp" / "own").exists()


def test_root_runs_the_runtime_only_from_the_safe_path_and_only_if_no_other_user_can_change_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nccltune.errors import UnavailableError
    from nccltune.files import trust
    from nccltune.trials.container import runtime_executable

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "podman"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setattr(trust, "SAFE_PATH", str(bin_dir))
    assert runtime_executable("podman") == str(fake.resolve())
    # The same program made writable by every user: root does not run it.
    fake.chmod(0o757)
    with pytest.raises(InputError, match="world-writable"):
        runtime_executable("podman")
    # A runtime on the caller's PATH but not on the safe path is not found at all.
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '')}")
    monkeypatch.setattr(trust, "SAFE_PATH", str(tmp_path / "empty"))
    with pytest.raises(UnavailableError, match="not in"):
        runtime_executable("podman")
    with pytest.raises(UnavailableError):
        pick_runtime("podman")
