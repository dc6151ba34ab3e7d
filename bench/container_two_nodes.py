"""A sweep over two "nodes" on this machine with bench.image: `nccltune sweep --nodes 2 --launcher
torchrun` and `nccltune sweep --join`, each with its own state directory, both configs naming the
test image (.ci/install-test-image: Debian bookworm and the CPU torch, run as its unpacked root
filesystem under podman), gloo over the loopback, two ranks per node, as bench.user when
--user names one.

Shown: both commands' exit status and time; on each node, every trial's agent ran in the image
(the image's marker `nccltune-test-image uid=N` on the agent's stderr, N being bench.user's uid);
the sweep's JSON names the image; no container of the sweep is left in podman's list.

    python bench/container_two_nodes.py                  # as root, podman and the test image
    python bench/container_two_nodes.py --user nccltune-test-mallory

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--user", help="bench.user: the ranks' user on both nodes (default: root)")
    ap.add_argument("--deadline-s", type=float, default=900.0)
    args = ap.parse_args()
    uid = pwd.getpwnam(args.user).pw_uid if args.user else 0
    env = node_env()
    ref = _image(env)
    root = Path(tempfile.mkdtemp(prefix="nccltune-ctr-2n-"))
    key_file, _ = multinode_key(root)
    exclude = [name for name, t in CATALOGUE.items() if t.kind == "perf" and name != "NCCL_ALGO"]
    bench = {"trial_timeout_s": 120, "image": [ref], "runtime": "podman", **({"user": args.user} if args.user else {})}
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
    left = subprocess.run(["podman", "ps", "-a", "--filter", "name=^nccltune-", "--format", "{{.Names}}"],
                          capture_output=True, text=True, env=env, check=False).stdout.split()
    print(f"containers left: {left or 'none'}")
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
