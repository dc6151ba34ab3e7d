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
- the host's network (ranks on several nodes reach each other as host processes do) and the
  host's process ids (`--pid host`): a node's ranks share one PID namespace, as a job's ranks in
  one pod do (NCCL tells its peers apart by process id and namespace), and torchrun's agents,
  which name themselves by address and process id in the rendezvous, never take one another's
  name (in PID namespaces of their own every agent would be the same pid);
- the node's GPUs: CDI `nvidia.com/gpu=all` (podman, docker) or enroot's NVIDIA hook
  (NVIDIA_VISIBLE_DEVICES); CUDA_VISIBLE_DEVICES of the trial's environment picks among them;
- bench.user's uid:gid (the runtime is started by root, the rank process inside is that user);
- exactly the trial's environment (trials.trialenv), passed by name so that values stay out of
  the process list.
The runtime: podman or docker take the image by digest; enroot (Slurm's pyxis) starts a container
it has made of the image before (`enroot create --name NAME`), named here by the digest's hex.
An image given as its unpacked root filesystem (/DIR@sha256:HEX, images.py) runs under podman
alone (`--rootfs DIR`), read-only with a fresh /tmp of its own (`--read-only`): every rank of every
trial shares the one directory, which must pass the trust rule, as bench.python does.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..config.schema import BenchConfig
from ..errors import InputError, UnavailableError
from ..files import trust
from ..files.inputfile import loads_strict, read_output
from ..images import Image, parse_image
from ..logsetup import escaped
from .credentials import rank_user
from .launch import WORKER

log = logging.getLogger(__name__)

RUNTIMES = ("auto", "podman", "docker", "enroot")
# worker.py loads ../collectives.py by path: both mounted where that path holds.
WORKER_MOUNT = "/opt/nccltune/trials"
COLLECTIVES_MOUNT = "/opt/nccltune/collectives.py"
IMAGE_PYTHON = "python3"
PROBE_TIMEOUT_S = 300.0
# The probe answers with one line of JSON of a few hundred bytes; what is kept of its stderr is
# its last line, for the error.
MAX_PROBE_OUT_BYTES = 1 << 20
PROBE_ERR_TAIL_BYTES = 64 << 10
PROBE_SAID_CHARS = 300
REMOVE_TIMEOUT_S = 60.0
RUNTIME_VARS = ("CONTAINERS_", "ENROOT_", "DOCKER_HOST", "XDG_RUNTIME_DIR")
ENROOT_NO_LOGIN = {"ENROOT_LOGIN_SHELL": "false"}


def pick_runtime(configured: str, *, rootfs: bool = False) -> str:
    """The runtime to start containers with: configured, or (auto) podman, else docker, else
    enroot, whichever is on PATH; podman alone for an unpacked root filesystem (`rootfs`).

    Raises:
        InputError: a root filesystem with another runtime configured (exit 78).
        UnavailableError: none of them is installed (exit 69)."""
    if configured not in RUNTIMES:
        raise InputError("bench.runtime", f"{configured!r} is not one of {', '.join(RUNTIMES)}")
    if rootfs and configured not in ("auto", "podman"):
        raise InputError("bench.runtime", f"{configured} cannot run bench.image's unpacked root filesystem",
                         hint="podman runs one (podman run --rootfs): set bench.runtime to podman or auto")
    names = (configured,) if configured != "auto" else ("podman",) if rootfs else ("podman", "docker", "enroot")
    for name in names:
        if shutil.which(name, path=trust.SAFE_PATH):
            return name
    raise UnavailableError(f"bench.runtime {configured}: no {' or '.join(names)} in {trust.SAFE_PATH}",
                           hint="install a container runtime or leave bench.image unset")


def runtime_executable(name: str) -> str:
    """The runtime `name`'s program as root runs it: on trust.SAFE_PATH, every directory and link
    on the way and the file itself passing the trust rule.

    Raises:
        UnavailableError: not installed there (exit 69).
        InputError: another user could change it (exit 78)."""
    try:
        return str(trust.system_program(name, f"container runtime ({name}, bench.runtime)"))
    except FileNotFoundError:
        raise UnavailableError(f"bench.runtime {name}: not in {trust.SAFE_PATH}") from None


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
    # The runtime's program as run: found on trust.SAFE_PATH and its chain checked by the trust
    # rule (root runs it), never whatever a PATH entry of another user's would name.
    executable: str | None = None

    @property
    def command(self) -> str:
        return self.executable or self.runtime

    def _worker_mounts(self, flag: str, how: str, file_how: str | None = None) -> list[str]:
        """The worker's directory and collectives.py beside it, read-only, as `flag SRC:DST{how}`
        (the file's `file_how` where a runtime mounts a file otherwise than a directory)."""
        collectives = self.worker_dir.parent / "collectives.py"
        return [flag, f"{self.worker_dir}:{WORKER_MOUNT}{how}",
                flag, f"{collectives}:{COLLECTIVES_MOUNT}{how if file_how is None else file_how}"]

    @staticmethod
    def _trial_mount(flag: str, trial_dir: Path | None, how: str) -> list[str]:
        """The trial's directory at its own path (none for the probe)."""
        return [flag, f"{trial_dir}:{trial_dir}{how}"] if trial_dir is not None else []

    def worker_argv(self, args: Sequence[str]) -> list[str]:
        """The worker's command line inside the image."""
        return self.in_image(self.launch_argv(args))

    def launch_argv(self, args: Sequence[str]) -> list[str]:
        """The worker's command line as a launch takes it (trials.launch: the worker by its path
        on this host, after which come its arguments), run by the image's python: a launch may put
        its own program before it (torchrun's agent, rankexec.py), and `argv` puts the whole line
        in the image (in_image)."""
        return [IMAGE_PYTHON, "-I", str(self.worker_dir / "worker.py"), *args]

    def in_image(self, inner: Sequence[str]) -> list[str]:
        """`inner` with every path into the worker's directory (worker.py, rankexec.py) where the
        image has it mounted (WORKER_MOUNT)."""
        top = f"{self.worker_dir}/"
        return [f"{WORKER_MOUNT}/{a[len(top):]}" if a.startswith(top) else a for a in inner]

    def argv(self, inner: Sequence[str], env: Mapping[str, str], trial_dir: Path | None, cwd: Path,
             name: str | None = None) -> list[str]:
        """The runtime's command line that runs `inner` in the image with `env` (passed by name: the
        runtime reads the values from its own environment, which is `env`), as the container `name`
        (podman, docker: what `remove` ends); the worker's files as the image has them (in_image)."""
        inner = self.in_image(inner)
        if self.runtime == "enroot":
            return self._enroot(inner, env, trial_dir, cwd)
        out = [self.command, "run", "--rm", *(["--name", name] if name else []), "--network", "host",
               "--ipc", "host", "--pid", "host", "--security-opt", "no-new-privileges",
               *self._worker_mounts("-v", ":ro"), *self._trial_mount("-v", trial_dir, ":rw"),
               "-v", "/sys:/sys:ro", "--workdir", str(cwd)]
        if self.image.rootfs is not None:
            # One directory for every rank of every trial: nothing a rank writes outlives it (a
            # fresh tmpfs on /tmp, /var/tmp and /run; the rest read-only).
            out.append("--read-only")
        if self.uid is not None:
            out += ["--user", f"{self.uid}:{self.gid if self.gid is not None else self.uid}"]
        if self.gpus:
            out += ["--device", "nvidia.com/gpu=all"]
        for name in sorted(env):
            out += ["--env", name]
        image = ["--rootfs", self.image.rootfs] if self.image.rootfs is not None else [self.image.ref]
        return [*out, *image, *inner]

    def _enroot(self, inner: Sequence[str], env: Mapping[str, str], trial_dir: Path | None, cwd: Path) -> list[str]:
        # enroot runs the container as the calling user (remapped root only with --root): the runner
        # switches to bench.user before it execs enroot, as for a rank on the host.
        # enroot-mount fails on a mount point the image lacks ("No such file or directory") where
        # podman makes one: x-create makes it in the container's tree first (the trial's directory
        # is never in the image, nor /opt/nccltune in an image of someone else's).
        out = [self.command, "start",
               *self._worker_mounts("--mount", ":none,x-create=dir,bind,ro", ":none,x-create=file,bind,ro"),
               *self._trial_mount("--mount", trial_dir, ":none,x-create=dir,bind,rw")]
        for name in sorted(env):
            out += ["--env", name]
        return [*out, self.image.enroot_name, "sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", str(cwd), *inner]

    def runtime_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The runtime's own environment: the trial's (which it hands on by name) and the caller's
        settings of the runtime itself (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF, ENROOT_*), which
        the trial's allow-list leaves out and which do not reach the container; for enroot, no
        login shell (ENROOT_LOGIN_SHELL), whatever the caller's settings say."""
        own = {k: v for k, v in os.environ.items() if k.startswith(RUNTIME_VARS)}
        if self.runtime == "enroot":
            # enroot starts the command through the user's login shell of the host's passwd by
            # default: bench.user's is nologin ("This account is currently not available."), and
            # any other's profile would rewrite the trial's environment.
            return {**own, **env, **ENROOT_NO_LOGIN}
        return {**own, **env}

    def remove(self, names: Sequence[str]) -> None:
        """End the containers `names` (podman, docker), whatever became of the client that started
        them: a killed `docker run` leaves its container running under the daemon, and podman's
        container is conmon's, which need not be in the client's process group. enroot's container
        is its caller's process tree, which the runner's group kill ends."""
        if self.runtime == "enroot" or not names:
            return
        try:
            subprocess.run([self.command, "rm", "-f", *names], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=REMOVE_TIMEOUT_S, stdin=subprocess.DEVNULL,
                           env=self.runtime_env({"PATH": os.environ.get("PATH", os.defpath)}))
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("%s rm -f %s: %s", self.runtime, " ".join(names), exc)

    @property
    def switches_user(self) -> bool:
        """The runtime makes the rank bench.user itself (--user); enroot needs the runner to."""
        return self.runtime != "enroot"

    def probe(self, env: Mapping[str, str]) -> dict[str, str]:
        """The image's python, torch, NCCL (and NCCL's library file, a path in the image) and OS, as
        the worker's own `--probe` reports them run once in the image (no GPU needed: torch's NCCL
        version is compiled in). What the image prints is read within MAX_PROBE_OUT_BYTES (stdout)
        and PROBE_ERR_TAIL_BYTES (stderr's end), in PROBE_TIMEOUT_S (files.inputfile.read_output):
        root runs it, and the image may print without end.

        Raises:
            UnavailableError: the image does not start, its python fails or does not answer in
                time (exit 69).
            InputError: it answers with more than MAX_PROBE_OUT_BYTES or with something other
                than a JSON object on its last line (exit 78)."""
        # No trial directory to write to: the probe's mounts are the worker's alone; no GPU either.
        name = f"nccltune-probe-{os.getpid()}-{secrets.token_hex(4)}"
        # enroot, without a login shell, gives the command no PATH but one the image's
        # /etc/environment sets (enroot import writes the image's there; a tree made otherwise
        # has none), and python3 found by sh's default PATH as /bin/python3 takes / for its prefix
        # and misses /usr/local's packages: the probe gets PATH by name, as every rank does.
        inner_env = {"PATH": env["PATH"]} if self.runtime == "enroot" and "PATH" in env else {}
        argv = replace(self, gpus=False).argv(self.worker_argv(["--probe"]), inner_env, None, Path("/"), name)
        what = f"{self.image.ref} ({self.runtime})"
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=self.runtime_env(env), start_new_session=True)
        except OSError as exc:
            raise UnavailableError(f"bench.image {what}: {self.runtime} did not run it ({exc})") from exc
        try:
            done = read_output(proc, limit=MAX_PROBE_OUT_BYTES, err_limit=PROBE_ERR_TAIL_BYTES,
                               timeout_s=PROBE_TIMEOUT_S)
        except BaseException:  # the sweep stopped meanwhile (SIGTERM): the client is killed, so
            self.remove([name])  # is its container
            raise
        if done.killed is not None:
            self.remove([name])  # a killed client may leave its container running
        if done.stdout.cut:
            raise InputError("bench.image", f"{what}: the worker's probe in the image printed more than "
                             f"{MAX_PROBE_OUT_BYTES} bytes; it answers with one line of JSON",
                             hint="the image's python prints on stdout as it starts (a sitecustomize?)")
        if done.returncode != 0:
            said = escaped((done.stderr.lines() or ["(nothing on stderr)"])[-1], PROBE_SAID_CHARS)
            how = done.killed if done.killed is not None else f"exited {done.returncode}"
            raise UnavailableError(f"bench.image {what}: the worker's probe {how}: {said}")
        lines = done.stdout.text().strip().splitlines()
        try:
            got = loads_strict(lines[-1]) if lines else None
        except ValueError:
            got = None
        if not isinstance(got, dict):
            shown = escaped(lines[-1], PROBE_SAID_CHARS) if lines else "nothing"
            raise InputError("bench.image", f"{what}: the worker's probe in the image answered {shown}, "
                             "not a JSON object")
        return {str(k): str(v) for k, v in got.items() if v is not None and k != "event"}


def from_config(bench: BenchConfig, *, demo: bool) -> Container:
    """The container bench.image and bench.runtime describe, the ranks as bench.user (as root),
    the node's GPUs passed unless `demo` (a CPU node has none).

    Raises:
        InputError: bench.image not by digest, an unpacked root filesystem that is not a directory
            root may trust or with a runtime other than podman, bench.user unknown (exit 78).
        UnavailableError: no runtime on PATH (exit 69)."""
    assert bench.image, "from_config without bench.image"
    image = parse_image(bench.image[0])
    if image.rootfs is not None:
        try:
            trust.check_dir(image.rootfs, "bench.image root filesystem")
        except OSError as exc:
            raise InputError("bench.image", f"{image.rootfs}: {exc.strerror or exc}") from None
    user = rank_user(bench.user)
    runtime = pick_runtime(bench.runtime, rootfs=image.rootfs is not None)
    return Container(runtime, image, WORKER.parent, uid=user.uid if user else None, gid=user.gid if user else None,
                     gpus=not demo, executable=runtime_executable(runtime))


def probe_image(bench: BenchConfig) -> tuple[Container, dict[str, str]]:
    """bench.image's container and what its probe found (Container.probe): for the class and the
    daemon's NCCL version, which must be the image's as the sweep's is.

    Raises:
        InputError, UnavailableError: as from_config and Container.probe."""
    c = from_config(bench, demo=False)
    return c, c.probe({"PATH": os.environ.get("PATH", os.defpath)})


def provenance(c: Container, probed: Mapping[str, str]) -> dict[str, str]:
    """What a run records of the image it measured in, and what the node's class key takes."""
    out = {"image": c.image.ref, "image_digest": c.image.digest, "runtime": c.runtime}
    if c.image.rootfs is not None:
        out["image_rootfs"] = c.image.rootfs  # run as unpacked there, its digest as bench.image names it
    for key in ("torch_version", "nccl_version", "nccl_lib", "python", "os"):
        if key in probed:
            out[f"image_{key}"] = probed[key]
    return out
