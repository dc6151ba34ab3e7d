"""A sweep over two "nodes" on this machine with bench.image: `nccltune sweep --nodes 2 --launcher
torchrun` and `nccltune sweep --join`, each with its own state directory, both configs naming the
test image (.ci/install-test-image: Debian bookworm and the CPU torch, run as its unpacked root
filesystem under podman), gloo over the loopback, two ranks per node, as bench.user when
--user names one.

Shown: both commands' exit status and time; on each node, every trial's agent ran in the image
(the image's marker `nccltune-test-image uid=N` on the agent's stderr, N being bench.user's uid);
the sweep's JSON names the image; no container of the sweep is left in podman's list (enroot: no
process in `enroot list -f` of the ranks' user).

    python bench/container_two_nodes.py                  # as root, podman and the test image
    python bench/container_two_nodes.py --user nccltune-test-mallory
    python bench/container_two_nodes.py --runtime enroot [--user ...]

With --runtime enroot, bench.image is the test image by its digest (NAME@sha256:HEX), and the
container nccltune starts (images.Image.enroot_name) must have been made of the same tree by the
ranks' user, as pyxis's users make theirs: `mksquashfs ROOTFS test-image.sqsh` and `enroot create
--name nccltune-HEX32 test-image.sqsh`, HEX32 the digest's first 32 hex digits; the script says so
where `enroot list` lacks it.

Exit status 1 when either command failed, a trial's agent ran outside the image, or a container
was left.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from twonodes import end, kill_under, multinode_key, node_env, port_pair  # noqa: E402

from nccltune.images import parse_image  # noqa: E402
from nccltune.sweep.variables import CATALOGUE  # noqa: E402

MARKER = "nccltune-test-image uid="


def _image(env: dict[str, str]) -> str:
    """The test image's reference (built when missing), its podman settings put into `env`."""
    got = subprocess.run(["bash", str(REPO / ".ci" / "install-test-image")], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHON": sys.executable})
    for line in (REPO / ".cache" / "test-image" / "env").read_text().split("export ", 1)[1].split():
        name, _, value = line.partition("=")
        env[name] = value
    return got.stdout.strip().splitlines()[-1]


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(f"{log}.out", "wb") as out, open(f"{log}.err", "wb") as err:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _agents(trial_dirs: list[Path], uid: int) -> tuple[int, list[str]]:
    """How many trials' agents said the image's marker as `uid`, and the trials whose did not."""
    outside = [d.name for d in trial_dirs if f"{MARKER}{uid}" not in (d / "agent.err").read_text(errors="replace")]
    return len(trial_dirs) - len(outside), outside


def _enroot(user: str | None, args: list[str]) -> subprocess.CompletedProcess[str]:
    """`enroot ARGS` as `user` (None: root), a system user with a HOME of its own for the call:
    enroot makes its cache under HOME, and a system user's home does not exist."""
    if not user:
        return subprocess.run(["enroot", *args], capture_output=True, text=True, check=False, cwd="/")
    with tempfile.TemporaryDirectory(prefix="nccltune-enroot-home-") as home:
        entry = pwd.getpwnam(user)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        return subprocess.run(["runuser", "-u", user, "--", "env", f"HOME={home}", "enroot", *args],
                              capture_output=True, text=True, check=False, cwd="/")


def _enroot_ref(rootfs_ref: str, user: str | None) -> str | None:
    """The test image by digest as enroot runs it, or None (said why) where the ranks' user has
    no container made of it."""
    image = parse_image(f"nccltune-test-image@{rootfs_ref.rsplit('@', 1)[1]}")
    got = _enroot(user, ["list"])
    if image.enroot_name not in got.stdout.split():
        print(f"no enroot container {image.enroot_name} of {user or 'root'}: make it of the test image first "
              f"(mksquashfs {rootfs_ref.rsplit('@', 1)[0]} test-image.sqsh; enroot create --name "
              f"{image.enroot_name} test-image.sqsh){got.stderr.strip() and ': ' + got.stderr.strip()}")
        return None
    return image.ref


def _left(runtime: str, user: str | None, env: dict[str, str]) -> list[str]:
    """The sweep's containers still running: podman's by name, enroot's by process."""
    if runtime == "enroot":
        rows = _enroot(user, ["list", "-f"]).stdout.splitlines()[1:]
        return [f"{row.split()[0]} pid {row.split()[1]}" for row in rows if len(row.split()) > 1]
    return subprocess.run(["podman", "ps", "-a", "--filter", "name=^nccltune-", "--format", "{{.Names}}"],
                          capture_output=True, text=True, env=env, check=False).stdout.split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--user", help="bench.user: the ranks' user on both nodes (default: root)")
    ap.add_argument("--runtime", choices=("podman", "enroot"), default="podman", help="bench.runtime")
    ap.add_argument("--deadline-s", type=float, default=900.0)
    args = ap.parse_args()
    uid = pwd.getpwnam(args.user).pw_uid if args.user else 0
    env = node_env()
    ref: str | None = _image(env)
    if args.runtime == "enroot":
        ref = _enroot_ref(ref, args.user)
        if ref is None:
            return 1
    root = Path(tempfile.mkdtemp(prefix="nccltune-ctr-2n-"))
    if args.runtime == "enroot" and args.user:
        # enroot runs as bench.user on the host (podman's client as root): its way to the trial's
        # directory and the ranks' cache in the state directories must be open to that user, as
        # a state directory under /var/lib is.
        root.chmod(0o711)
    key_file, _ = multinode_key(root)
    exclude = [name for name, t in CATALOGUE.items() if t.kind == "perf" and name != "NCCL_ALGO"]
    bench = {"trial_timeout_s": 120, "image": [ref], "runtime": args.runtime,
             **({"user": args.user} if args.user else {})}
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "sweep": {"baseline_repeats": 2, "finalist_repeats": 1, "max_finalists": 1,
                  "variables": {"NCCL_ALGO": ["Ring"]}, "exclude": exclude},
        "bench": bench, "tuner": {"plugin": "keep"}, "multinode": {"key_file": str(key_file)}}))
    port = port_pair()
    py = sys.executable
    started = time.monotonic()
    joiner = _spawn([py, "-m", "nccltune", "sweep", "--join", f"127.0.0.1:{port}", "--demo", "--state-dir",
                     str(root / "joiner"), "--config", str(config), "-v"], env, root / "joiner")
    coordinator = _spawn([py, "-m", "nccltune", "sweep", "--demo", "--nodes", "2", "--launcher", "torchrun",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--config", str(config), "--state-dir",
                          str(root / "coordinator"), "--json"], env, root / "coordinator")
    try:
        deadline = started + args.deadline_s
        # A joiner that stops early (it refuses the trials or its config) leaves the coordinator
        # waiting for it: its exit ends the run.
        while coordinator.poll() is None and joiner.poll() in (None, 0) and time.monotonic() < deadline:
            time.sleep(1.0)
        if coordinator.poll() is None and joiner.poll() is None:
            print(f"not finished in {args.deadline_s:g} s")
        elif coordinator.poll() is not None:
            joiner.wait(timeout=120)
    except subprocess.TimeoutExpired:
        print("the joiner did not stop after the coordinator")
    finally:
        for proc in (coordinator, joiner):  # nccltune's own stop first: it removes its containers
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end(coordinator, 60)
        end(joiner, 60)
        kill_under(root)
    wall = time.monotonic() - started
    print(f"state and logs: {root}")
    print(f"coordinator exit {coordinator.returncode}, joiner exit {joiner.returncode}, {wall:.0f} s")
    if joiner.returncode not in (0, None):
        print("joiner: " + " ".join((root / "joiner.err").read_text(errors="replace").strip().splitlines()[-2:]))
    ok = coordinator.returncode == 0 and joiner.returncode == 0
    for node, dirs in (("coordinator", sorted((root / "coordinator").glob("runs/*/trial-*"))),
                       ("joiner", sorted((root / "joiner").glob("join/trial-*")))):
        inside, outside = _agents(dirs, uid)
        print(f"{node}: {inside} of {len(dirs)} trials' agents ran in the image as uid {uid}"
              + (f"; not: {', '.join(outside)}" if outside else ""))
        ok = ok and bool(dirs) and not outside
    try:
        image = json.loads((root / "coordinator.out").read_text()).get("image")
    except ValueError:
        image = None
    print(f"sweep --json image: {image}")
    ok = ok and bool(image) and image.get("image") == ref
    left = _left(args.runtime, args.user, env)
    print(f"containers left: {left or 'none'}")
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
