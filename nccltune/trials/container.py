"""The worker inside the job's image (bench.image): the container runtime's command line for one
rank, and what the image's own torch and NCCL are.

Jobs load the NCCL of their image, not the host's; a trial measured with the host's bench.python
measures an NCCL the jobs may not load. With bench.image every rank is the runtime running the
image by digest (a tag can move under the results, so it is refused) with:
- the worker's directory (worker.py, standard library and torch only) bind-mounted read-only at
  WORKER_MOUNT and run with the image's python3 (-I: nothing of the image's working directory);
- the trial's directory read-write at its own path (the rank writes its output and NCCL's log
  there), and no other host path but /sys read-only (NCCL reads the PCI and NIC topology there;
  with the host's network the runtime cannot mount a sysfs of its own);
- the host's network (ranks on several nodes reach each other as host processes do);
- the node's GPUs: CDI `nvidia.com/gpu=all` (podman, docker) or enroot's NVIDIA hook
  (NVIDIA_VISIBLE_DEVICES); CUDA_VISIBLE_DEVICES of the trial's environment picks among them;
- bench.user's uid:gid (the runtime is started by root, the rank process inside is that user);
- exactly the trial's environment (trials.trialenv), passed by name so that values stay out of
  the process list.
The runtime: podman or docker take the image by digest; enroot (Slurm's pyxis) starts a container
it has made of the image before (`enroot create --name NAME`), named here by the digest's hex.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config.schema import BenchConfig
from ..errors import InputError, UnavailableError
from ..images import Image, parse_image
from .credentials import rank_user
from .launch import WORKER

RUNTIMES = ("auto", "podman", "docker", "enroot")
# worker.py loads ../collectives.py by path: both mounted where that path holds.
WORKER_MOUNT = "/opt/nccltune/trials"
COLLECTIVES_MOUNT = "/opt/nccltune/collectives.py"
IMAGE_PYTHON = "python3"
PROBE_TIMEOUT_S = 300.0
RUNTIME_VARS = ("CONTAINERS_", "ENROOT_", "DOCKER_HOST", "XDG_RUNTIME_DIR")
# Printed by the image's python: its torch, torch's NCCL (a tuple, or missing on a CPU build), the
# image's distribution. Standard library first, so that an image without torch still answers.
_PROBE = (
    "import json, platform\n"
    "out = {'python': platform.python_version()}\n"
    "try:\n"
    "    out['os_release'] = open('/etc/os-release').read()\n"
    "except OSError:\n"
    "    pass\n"
    "try:\n"
    "    import torch\n"
    "    out['torch_version'] = torch.__version__\n"
    "    v = torch.cuda.nccl.version() if torch.cuda.is_available() else None\n"
    "    out['nccl_version'] = '.'.join(str(p) for p in v) if isinstance(v, tuple) else v\n"
    "except Exception as exc:\n"
    "    out['torch_error'] = repr(exc)\n"
    "print(json.dumps(out))\n"
)


def pick_runtime(configured: str) -> str:
    """The runtime to start containers with: configured, or (auto) enroot inside a Slurm job that
    has it, else podman, else docker, whichever is on PATH.

    Raises:
        UnavailableError: none of them is installed (exit 69)."""
    if configured not in RUNTIMES:
        raise InputError("bench.runtime", f"{configured!r} is not one of {', '.join(RUNTIMES)}")
    names = (configured,) if configured != "auto" else ("podman", "docker", "enroot")
    for name in names:
        if shutil.which(name):
            return name
    raise UnavailableError(f"bench.runtime {configured}: no {' or '.join(names)} on PATH",
                           hint="install a container runtime or leave bench.image unset")


@dataclass(frozen=True)
class Container:
    """How every rank of a sweep runs in the image: `runtime` (podman, docker or enroot), `image`,
    `worker_dir` (the host directory of worker.py), `uid`/`gid` (bench.user's; None: root),
    `gpus` (pass the node's GPUs: false on a CPU node)."""

    runtime: str
    image: Image
    worker_dir: Path
    uid: int | None = None
    gid: int | None = None
    gpus: bool = True

    def _worker_mounts(self, flag: str, how: str) -> list[str]:
        """The worker's directory and collectives.py beside it, read-only, as `flag SRC:DST{how}`."""
        collectives = self.worker_dir.parent / "collectives.py"
        return [flag, f"{self.worker_dir}:{WORKER_MOUNT}{how}", flag, f"{collectives}:{COLLECTIVES_MOUNT}{how}"]

    def worker_argv(self, args: Sequence[str]) -> list[str]:
        """The worker's command line inside the image."""
        return [IMAGE_PYTHON, "-I", f"{WORKER_MOUNT}/worker.py", *args]

    def argv(self, inner: Sequence[str], env: Mapping[str, str], trial_dir: Path, cwd: Path) -> list[str]:
        """The runtime's command line that runs `inner` in the image with `env` (passed by name: the
        runtime reads the values from its own environment, which is `env`)."""
        if self.runtime == "enroot":
            return self._enroot(inner, env, trial_dir, cwd)
        out = [self.runtime, "run", "--rm", "--network", "host", "--ipc", "host", "--init",
               "--security-opt", "no-new-privileges",
               *self._worker_mounts("-v", ":ro"), "-v", f"{trial_dir}:{trial_dir}:rw",
               "-v", "/sys:/sys:ro", "--workdir", str(cwd)]
        if self.uid is not None:
            out += ["--user", f"{self.uid}:{self.gid if self.gid is not None else self.uid}"]
        if self.gpus:
            out += ["--device", "nvidia.com/gpu=all"]
        for name in sorted(env):
            out += ["--env", name]
        return [*out, self.image.ref, *inner]

    def _enroot(self, inner: Sequence[str], env: Mapping[str, str], trial_dir: Path, cwd: Path) -> list[str]:
        # enroot runs the container as the calling user (remapped root only with --root): the runner
        # switches to bench.user before it execs enroot, as for a rank on the host.
        out = ["enroot", "start", *self._worker_mounts("--mount", ":none,bind,ro"),
               "--mount", f"{trial_dir}:{trial_dir}:none,bind,rw"]
        for name in sorted(env):
            out += ["--env", name]
        return [*out, self.image.enroot_name, "sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", str(cwd), *inner]

    def runtime_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The runtime's own environment: the trial's (which it hands on by name) and the caller's
        settings of the runtime itself (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF, ENROOT_*), which
        the trial's allow-list leaves out and which do not reach the container."""
        own = {k: v for k, v in os.environ.items() if k.startswith(RUNTIME_VARS)}
        return {**own, **env}

    @property
    def switches_user(self) -> bool:
        """The runtime makes the rank bench.user itself (--user); enroot needs the runner to."""
        return self.runtime != "enroot"

    def probe(self, env: Mapping[str, str]) -> dict[str, str]:
        """The image's python, torch and NCCL versions and /etc/os-release, read once by running
        the image's python (no GPU needed: torch's NCCL version is compiled in).

        Raises:
            UnavailableError: the image does not start or its python does not answer (exit 69)."""
        inner = [IMAGE_PYTHON, "-I", "-c", _PROBE]
        if self.runtime == "enroot":
            argv = ["enroot", "start", self.image.enroot_name, *inner]
        else:
            argv = [self.runtime, "run", "--rm", "--network", "host", "-v", "/sys:/sys:ro"]
            if self.uid is not None:
                argv += ["--user", f"{self.uid}:{self.gid if self.gid is not None else self.uid}"]
            argv += [self.image.ref, *inner]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, env=self.runtime_env(env))
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UnavailableError(f"bench.image {self.image.ref}: {self.runtime} did not run it ({exc})") from exc
        lines = done.stdout.strip().splitlines()
        try:
            got = json.loads(lines[-1]) if done.returncode == 0 and lines else None
        except json.JSONDecodeError:
            got = None
        if not isinstance(got, dict):
            said = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise UnavailableError(f"bench.image {self.image.ref}: {self.runtime} exited {done.returncode}: {said}")
        return {str(k): str(v) for k, v in got.items() if v is not None}


def from_config(bench: BenchConfig, *, demo: bool) -> Container:
    """The container bench.image and bench.runtime describe, the ranks as bench.user (as root),
    the node's GPUs passed unless `demo` (a CPU node has none).

    Raises:
        InputError: bench.image not by digest, bench.user unknown (exit 78).
        UnavailableError: no runtime on PATH (exit 69)."""
    assert bench.image, "from_config without bench.image"
    user = rank_user(bench.user)
    return Container(pick_runtime(bench.runtime), parse_image(bench.image[0]), WORKER.parent,
                     uid=user.uid if user else None, gid=user.gid if user else None, gpus=not demo)


def provenance(c: Container, probed: Mapping[str, str]) -> dict[str, str]:
    """What a run records of the image it measured in, and what the node's class key takes."""
    out = {"image": c.image.ref, "image_digest": c.image.digest, "runtime": c.runtime}
    for key in ("torch_version", "nccl_version", "python"):
        if key in probed:
            out[f"image_{key}"] = probed[key]
    pretty = next((line.split("=", 1)[1].strip('"') for line in probed.get("os_release", "").splitlines()
                   if line.startswith("PRETTY_NAME=")), None)
    if pretty:
        out["image_os"] = pretty
    return out
