"""A real container runtime applies nccltune's CDI spec, with no kubelet: the device plugin answers
a fake kubelet's Allocate with a CDI device name, and that very name goes to podman (Debian's 4.3,
runc, built with the CDI library containerd and CRI-O use; .ci/install-podman), which starts a
container from a busybox root filesystem with the device: the container sees the published env
and marker, and the generation directory mounted read-only.

podman 4.3 reads CDI specs from /etc/cdi and /var/run/cdi only, so the spec is published to
/var/run/cdi (root only) and removed afterwards; a machine that already has nccltune's spec there
(a real node) skips these tests rather than touch it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from fakekubelet import FakeKubelet, compile_api

from nccltune.k8s.deviceplugin import DEVICES, DevicePlugin
from nccltune.publish.cdi import KIND, SPEC_NAME, write_spec

REPO = Path(__file__).resolve().parents[1]
RUNTIME_CDI_DIR = Path("/var/run/cdi")
EVERY = {"NCCL_ALGO": "Ring", "NCCL_TOPO_FILE": "GEN/ncclTopology.xml"}
SINGLE = {"NCCL_P2P_LEVEL": "NVL"}
SET_ID = "7:0123456789abcdef"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="podman runs rootful, the spec goes to /var/run/cdi")


@pytest.fixture(scope="module")
def podman() -> str:
    got = subprocess.run(["bash", str(REPO / ".ci" / "install-podman")], capture_output=True, text=True,
                         timeout=900)
    if got.returncode == 69:
        pytest.skip(f"podman is not available here: {got.stderr.strip()}")
    assert got.returncode == 0, got.stderr
    return got.stdout.strip()


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A container's root filesystem: busybox and its applets, nothing else."""
    root = tmp_path_factory.mktemp("rootfs")
    (root / "bin").mkdir()
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "env", "cat", "touch"):
        (root / "bin" / applet).symlink_to("busybox")
    return root


@pytest.fixture(scope="module")
def generation() -> Iterator[Path]:
    """A published generation's directory, at a path that is the same on the host and in the
    container (the spec mounts it at its own path)."""
    d = Path(tempfile.mkdtemp(prefix="nccltune-gen", dir="/tmp"))
    (d / "nccl.sh").write_text("export NCCL_ALGO=Ring\n")
    (d / "ncclTopology.xml").write_text("<system/>\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def spec(podman: str, generation: Path) -> Iterator[Path]:
    target = RUNTIME_CDI_DIR / SPEC_NAME
    if target.exists():
        pytest.skip(f"{target} exists (this machine's own): left alone")
    every = {k: v.replace("GEN", str(generation)) for k, v in EVERY.items()}
    path = write_spec(RUNTIME_CDI_DIR, generation, every, SINGLE, SET_ID)
    yield path
    path.unlink(missing_ok=True)


def run_with(podman: str, rootfs: Path, device: str, script: str) -> subprocess.CompletedProcess[str]:
    # Limits below this machine's: podman's defaults (nofile 1048576) are above what a sandbox
    # without CAP_SYS_RESOURCE may set, and lowering needs nothing.
    argv = [podman, "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024",
            "--ulimit", "nproc=1000:1000", "--device", device, "--rootfs", str(rootfs), "/bin/sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def container_env(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def test_the_device_plugins_answer_is_what_the_runtime_applies(
        podman: str, rootfs: Path, generation: Path, spec: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    api: tuple[ModuleType, ModuleType] = compile_api(tmp_path_factory.mktemp("pb"))
    pb, _ = api
    plugins = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    plugin = DevicePlugin(RUNTIME_CDI_DIR, plugins, units=2, interval_s=0.1)
    thread = threading.Thread(target=plugin.run, daemon=True)
    thread.start()
    kubelet = FakeKubelet(api, plugins)
    try:
        kubelet.registrations(len(DEVICES))
        answer = kubelet.stub("nccltune.io/every-job").Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=["every-job-1"])]), timeout=5)
        (container,) = answer.container_responses
        (device,) = [c.name for c in container.cdi_devices]
    finally:
        kubelet.stop()
        plugin.stop()
        thread.join(timeout=20)
        shutil.rmtree(plugins, ignore_errors=True)
    assert device == f"{KIND}=every-job"
    ran = run_with(podman, rootfs, device, f"env; cat {generation}/nccl.sh")
    assert ran.returncode == 0, ran.stderr
    env = container_env(ran.stdout)
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_TOPO_FILE"] == f"{generation}/ncclTopology.xml"
    assert env["NCCLTUNE_APPLIED"] == f"{SET_ID}:NCCL_ALGO,NCCL_TOPO_FILE"
    assert "NCCL_P2P_LEVEL" not in env  # the single-node part is single-node's only
    assert "export NCCL_ALGO=Ring" in ran.stdout


def test_each_device_in_a_real_container(podman: str, rootfs: Path, generation: Path, spec: Path) -> None:
    single = run_with(podman, rootfs, f"{KIND}=single-node", "env")
    assert single.returncode == 0, single.stderr
    env = container_env(single.stdout)
    assert env["NCCL_P2P_LEVEL"] == "NVL" and env["NCCL_ALGO"] == "Ring"
    assert env["NCCLTUNE_APPLIED"] == f"{SET_ID}:NCCL_ALGO,NCCL_TOPO_FILE,NCCL_P2P_LEVEL"
    files = run_with(podman, rootfs, f"{KIND}=files", f"env; touch {generation}/planted")
    assert files.returncode != 0 and "Read-only file system" in files.stderr + files.stdout
    env = container_env(files.stdout)
    assert env["NCCLTUNE_ENV_FILE"] == f"{generation}/nccl.sh" and "NCCL_ALGO" not in env
    assert not (generation / "planted").exists()


def test_a_device_no_spec_has_fails_the_container(podman: str, rootfs: Path, spec: Path) -> None:
    ran = run_with(podman, rootfs, f"{KIND}=no-such-device", "env")
    assert ran.returncode != 0 and "unresolvable CDI devices" in ran.stderr
