"""Run by root, the benchmark ranks run as bench.user: its uid, gid and groups, no capabilities,
no_new_privs, an environment without root's, a working directory of their own (trials.credentials).

The demo trial here is real (gloo, two ranks): the test reads each rank's /proc/<pid>/status while
it runs. CI runs as root; the rank user is created here when missing.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from nccltune.errors import EXIT_CONFIG, InputError
from nccltune.trials import credentials
from nccltune.trials.credentials import RANK_DIR, RankUser, check_reachable, rank_env, rank_user
from nccltune.trials.runner import Runner, TrialAborted
from nccltune.trials.worker import FAULT_VAR

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
TEST_USER = "nccltune-ranktest"  # not the default user: the rest of the suite keeps its ranks as it has them


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("switching the ranks' user needs root (CI runs as root)")


@pytest.fixture(scope="module")
def user() -> RankUser:
    """The unprivileged rank user, created (idempotently) when missing."""
    needs_root()
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            pytest.skip("useradd is not installed here (Debian/Ubuntu: the passwd package)")
        subprocess.run([useradd, "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        TEST_USER], check=True, capture_output=True)
    found = rank_user(TEST_USER)
    assert found is not None and found.uid != 0
    return found


@pytest.fixture(scope="module")
def python(user: RankUser) -> Iterator[str]:
    """An interpreter with torch that the rank user can run: this one, or (when it lives where the
    user cannot go, such as a Python under /root) the system's Python of the same version with this
    environment's packages."""
    try:
        check_reachable(sys.executable, [], user)
        yield sys.executable
        return
    except InputError:
        pass
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.exists():
        pytest.skip(f"{sys.executable} is closed to other users and there is no {system} to use instead")
    where = Path(tempfile.mkdtemp(prefix="nccltune-rank-python-", dir="/tmp"))
    try:
        where.chmod(0o755)
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(where / "venv")], check=True,
                       capture_output=True)
        purelib = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        site = next((where / "venv" / "lib").glob("python3*/site-packages"))
        # addsitedir, not a bare path: that directory's own .pth files (nccltune's editable
        # install) are read too.
        (site / "nccltune-test.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
        exe = str(where / "venv" / "bin" / "python")
        check_reachable(exe, [], user)
        yield exe
    finally:
        shutil.rmtree(where, ignore_errors=True)


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


@pytest.mark.parametrize("fork_ranks", [True, False], ids=["forked", "by-exec"])
def test_demo_ranks_run_as_the_rank_user_without_privileges(user: RankUser, python: str, tmp_path: Path,
                                                            fork_ranks: bool) -> None:
    """A real two-rank gloo trial, held in its timed loop (the worker's hang fault) while the test
    reads every rank's credentials from /proc; then aborted. /proc/PID/environ is the environment
    a process was started with: a rank's own under exec, the rank server's for a forked rank (its
    own is set in the process after the fork); neither holds the caller's secrets."""
    record = tmp_path / "ranks.running"
    base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), FAULT_VAR: "hang", "HOME": "/root",
                "USER": "root", "SSH_AUTH_SOCK": "/root/agent.sock", "CLUSTER_API_TOKEN": "s3cret",
                "NOTIFY_SOCKET": "/run/systemd/notify", "DATABASE_URL": "postgres://admin:pw@db/x"}
    seen: dict[int, dict[str, str]] = {}
    environs: dict[int, dict[str, str]] = {}
    cwds: dict[int, str] = {}
    runner: Runner

    def look() -> str | None:
        out = tmp_path / "work" / "trial-001" / "rank0.out"
        if not out.exists() or '"event": "start"' not in out.read_text():
            return None
        for line in record.read_text().splitlines():
            pid = int(line.split()[0])
            seen[pid] = proc_status(pid)
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            environs[pid] = dict(e.decode().partition("=")[::2] for e in raw if e)
            cwds[pid] = os.readlink(f"/proc/{pid}/cwd")
        return "credentials read"

    runner = Runner(python=python, backend="gloo", nranks=2, base_env=base_env, work_dir=tmp_path / "work",
                    timeout_s=240, abort_check=look, rank_record=record, user=TEST_USER, fork_ranks=fork_ranks)
    assert runner.rank_user == user
    with pytest.raises(TrialAborted, match="credentials read"):
        runner.run({}, [4096], warmup=1, iters=2)
    assert len(seen) == 2, seen
    groups = {str(g) for g in user.groups}
    for pid, status in seen.items():
        assert status["Uid"].split() == [str(user.uid)] * 4, status["Uid"]  # real, effective, saved, fs
        assert status["Gid"].split() == [str(user.gid)] * 4, status["Gid"]
        assert set(status["Groups"].split()) == groups, status["Groups"]
        for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
            assert int(status[caps], 16) == 0, (caps, status[caps])
        assert status["NoNewPrivs"] == "1"
        env = environs[pid]
        if not fork_ranks:
            assert env["HOME"] == str(tmp_path / "work" / "trial-001" / RANK_DIR)
            assert env["USER"] == env["LOGNAME"] == user.name
        for secret in ("SSH_AUTH_SOCK", "CLUSTER_API_TOKEN", "NOTIFY_SOCKET", "DATABASE_URL"):
            assert secret not in env, secret
        assert cwds[pid] == str(tmp_path / "work" / "trial-001" / RANK_DIR)
    # The rank directory is the user's; the trial directory around it, with the ranks' output, root's.
    trial = tmp_path / "work" / "trial-001"
    assert (trial / RANK_DIR).stat().st_uid == user.uid
    assert trial.stat().st_uid == 0 and (trial / "rank0.out").stat().st_uid == 0
    assert (tmp_path / "work" / credentials.CACHE_DIR).stat().st_uid == user.uid


def test_a_finished_demo_trial_as_the_rank_user_is_measured(user: RankUser, python: str, tmp_path: Path) -> None:
    runner = Runner(python=python, backend="gloo", nranks=2, base_env={"PATH": os.environ.get("PATH", "/usr/bin")},
                    work_dir=tmp_path / "work", timeout_s=240, user=TEST_USER)
    result = runner.run({}, [4096], warmup=1, iters=2)
    assert result.status == "ok", result.reason
    assert [m.size_bytes for m in result.sizes] == [4096] and result.sizes[0].correct


def test_a_symlink_the_ranks_leave_is_not_followed_when_root_reads_their_log(tmp_path: Path) -> None:
    from nccltune.trials.nccllog import read_log

    secret = tmp_path / "root-only"
    secret.write_text("root's\n")
    secret.chmod(0o600)
    link = tmp_path / "nccl.1.log"
    link.symlink_to(secret)
    with pytest.raises(OSError):
        read_log(link)


def test_the_rank_environment_has_nothing_of_roots() -> None:
    user = RankUser("ranks", 999, 999, (999, 44))
    env = {"PATH": "/usr/bin", "NCCL_ALGO": "Ring", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "7",
           "HOME": "/root", "USER": "root", "SUDO_USER": "admin", "SSH_AUTH_SOCK": "/tmp/ssh-x/agent",
           "AWS_SECRET_ACCESS_KEY": "k", "GITHUB_TOKEN": "t", "DB_PASSWORD": "p", "NOTIFY_SOCKET": "/run/notify",
           "XDG_CACHE_HOME": "/var/cache/nccltune", "CUDA_CACHE_PATH": "/var/cache/nccltune/cuda",
           # Secrets whose names say nothing of it, and what a rank has no use for.
           "DATABASE_URL": "postgres://admin:pw@db/x", "https_proxy": "http://u:pw@proxy:3128",
           "ARTIFACTORY_AUTH": "Basic dTpw", "LD_PRELOAD": "/opt/site/hook.so", "PYTHONSTARTUP": "/root/.pyrc",
           "KRB5CCNAME": "FILE:/tmp/krb5cc_0", "SITE_NOTE": "x"}
    # What the worker, torch, CUDA and NCCL read, and a site may set.
    needed = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": "/scratch", "LD_LIBRARY_PATH": "/opt/nccl/lib",
              "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
              "TORCH_CPP_LOG_LEVEL": "INFO", "NCCLTUNE_TUNER_TABLE": "/t", "NCCLTUNE_WORKER_FAULT": "hang",
              "NVIDIA_VISIBLE_DEVICES": "all", "FI_PROVIDER": "efa", "OFI_NCCL_PROTOCOL": "RDMA",
              "UCX_TLS": "rc", "GLOO_SOCKET_IFNAME": "lo", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
              "SRUN_CPUS_PER_TASK": "8"}
    out = rank_env({**env, **needed}, user, Path("/s/trial-001/rank"), Path("/s/rank-cache"))
    assert out == {"PATH": "/usr/bin", "NCCL_ALGO": "Ring", "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_ID": "7",
                   "HOME": "/s/trial-001/rank", "USER": "ranks", "LOGNAME": "ranks",
                   "XDG_CACHE_HOME": "/s/rank-cache", "CUDA_CACHE_PATH": "/s/rank-cache/cuda", **needed}
    assert rank_env(env, None, Path("/x"), Path("/y")) == env  # the caller's own ranks: unchanged


def test_a_configured_user_that_does_not_exist_is_refused_before_any_trial(tmp_path: Path) -> None:
    needs_root()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"bench": {"user": "no-such-rank-user"}}))
    config.chmod(0o644)
    state = tmp_path / "state"
    proc = subprocess.run([sys.executable, "-m", "nccltune", "sweep", "--demo", "--json", "--config", str(config),
                           "--state-dir", str(state)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert "bench.user" in proc.stderr and "no-such-rank-user" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(state.glob("**/trial-*")), "a trial ran"


def test_root_is_no_rank_user() -> None:
    needs_root()
    with pytest.raises(InputError, match=r"bench\.user") as err:
        rank_user("root")
    assert err.value.exit_code == EXIT_CONFIG


def test_not_root_means_no_switch(user: RankUser, python: str) -> None:
    """Run by the rank user itself, rank_user answers None whatever is configured."""
    code = ("from nccltune.trials.credentials import rank_user; import json; "
            f"print(json.dumps([rank_user({TEST_USER!r}), rank_user('no-such-user'), rank_user(None)]))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                          preexec_fn=credentials.rank_preexec(os.getpid(), user))
    assert json.loads(proc.stdout) == [None, None, None], proc.stderr


def test_the_rank_directory_is_made_fresh_and_given_to_the_user(tmp_path: Path) -> None:
    needs_root()
    trial = tmp_path / "trial-001"
    trial.mkdir()
    old = credentials.fresh_rank_dir(trial, None)
    (old / "nccl.1.log").write_text("an earlier run's\n")
    (old / "link").symlink_to("/etc/shadow")
    (old / "sub").mkdir()
    (old / "sub" / "f").touch()
    (old / "sub").chmod(0o500)  # the ranks' own directory, closed even to its owner's writes
    user = RankUser("x", 4242, 4243, (4243,))
    for d in (old / "sub", old):
        os.chown(d, 4242, 4243)
    fresh = credentials.fresh_rank_dir(trial, user)
    st = fresh.lstat()
    assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (4242, 4243)
    assert list(fresh.iterdir()) == []
    assert Path("/etc/shadow").exists()


# --- nccltune install: the rank user --------------------------------------------------------------


def test_install_finds_the_groups_that_own_the_device_nodes(tmp_path: Path) -> None:
    import grp

    from nccltune.install import device_groups

    try:
        video = grp.getgrnam("video")
    except KeyError:
        pytest.skip("no video group here")
    needs_root()
    node = tmp_path / "nvidia0"
    node.touch()
    os.chown(node, 0, video.gr_gid)
    node.chmod(0o660)
    closed = tmp_path / "nvidiactl"
    closed.touch()
    closed.chmod(0o666)  # root's group: nothing to join
    assert device_groups((str(tmp_path / "nvidia*"),)) == ["video"]
    node.chmod(0o640)  # the group may read only: not a device the ranks could use through it
    assert device_groups((str(tmp_path / "nvidia*"),)) == []


def test_install_creates_the_rank_user_once(tmp_path: Path) -> None:
    import grp

    from nccltune.install import rank_user_commands

    needs_root()
    if shutil.which("useradd") is None or shutil.which("usermod") is None:
        pytest.skip("useradd/usermod are not installed here (Debian/Ubuntu: the passwd package)")
    name = "nccltune-insttest"
    groups = ["video"] if "video" in {g.gr_name for g in grp.getgrall()} else []
    created = False
    try:
        try:
            pwd.getpwnam(name)
        except KeyError:
            (cmd,) = rank_user_commands(name, groups)
            assert cmd[:2] == ["useradd", "--system"] and cmd[-1] == name
            subprocess.run(cmd, check=True, capture_output=True)
            created = True
        entry = pwd.getpwnam(name)
        assert entry.pw_uid != 0 and entry.pw_shell.endswith(("nologin", "false"))
        assert not Path(entry.pw_dir).exists()
        assert rank_user_commands(name, groups) == []  # installing again changes nothing
        for group in groups:
            assert name in grp.getgrnam(group).gr_mem
        found = rank_user(name)
        assert found is not None and found.uid == entry.pw_uid
    finally:
        if created:
            subprocess.run(["userdel", name], capture_output=True)


DAEMON_SCRIPT = """
import json, os, sys
from pathlib import Path
from nccltune.trials.runner import Runner, TrialAborted
python, user, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
env = {"PATH": os.environ.get("PATH", "/usr/bin")}
first = Runner(python=python, backend="gloo", nranks=2, base_env=env, work_dir=work, timeout_s=240, user=user)
ok = first.run({}, [4096], warmup=1, iters=2).status
# The same trial directory again (as verify reuses its own): the ranks' old files are root's to remove.
again = Runner(python=python, backend="gloo", nranks=2, base_env=env, work_dir=work, timeout_s=240, user=user)
record = work / "ranks.running"
pids = []
def stop():
    out = work / "trial-001" / "rank0.out"
    if out.exists() and '"event": "start"' in out.read_text():
        pids.extend(int(line.split()[0]) for line in record.read_text().splitlines())
        return "stop"
    return None
held = Runner(python=python, backend="gloo", nranks=2, base_env={**env, "NCCLTUNE_WORKER_FAULT": "hang"},
              work_dir=work, timeout_s=240, user=user, abort_check=stop, rank_record=record)
try:
    held.run({}, [4096], warmup=1, iters=2)
except TrialAborted:
    pass
alive = [p for p in pids if Path(f"/proc/{p}").exists()]
caps = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff")]
print(json.dumps({"ok": ok, "pids": pids, "alive": alive, "caps": caps}))
"""


def test_the_units_capabilities_suffice_to_run_and_end_the_ranks(user: RankUser, python: str, tmp_path: Path) -> None:
    """As the daemon under its unit: root with only the unit's CapabilityBoundingSet (no
    CAP_DAC_OVERRIDE, no CAP_SYS_PTRACE). A trial runs, a reused trial directory is cleared, and
    held ranks of another uid are ended."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    unit = (REPO / "systemd" / "nccltune.service").read_text()
    caps = next(line for line in unit.splitlines() if line.startswith("CapabilityBoundingSet=")).partition("=")[2]
    bounding = ",".join(["-all", *("+" + c.removeprefix("CAP_").lower() for c in caps.split())])
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([setpriv, "--bounding-set", bounding, sys.executable, "-c", DAEMON_SCRIPT, python,
                           TEST_USER, str(work)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["ok"] == "ok"
    assert len(got["pids"]) == 2 and got["alive"] == [], got
    # Not all of root's: the bounding set held (CAP_DAC_OVERRIDE is bit 1).
    assert not int(got["caps"][0].split()[1], 16) & (1 << 1)


def test_a_log_link_in_the_rank_directory_is_skipped_not_followed(tmp_path: Path) -> None:
    """The runner reads NCCL's log from the ranks' directory: a link there (to a file of root's) is
    not read, and the trial goes on without NCCL's details."""
    from nccltune.records import Measurement, TrialResult

    secret = tmp_path / "root-only"
    secret.write_text("nodea:7001:7001 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo TREE proto LL "
                      "channel{Lo..Hi}={0..1}\n")
    (tmp_path / RANK_DIR).mkdir()
    (tmp_path / RANK_DIR / "nccl.7001.log").symlink_to(secret)
    result = TrialResult("ok", None, [Measurement(4096, 1.0, 1.0, 1.0)], 1.0, start={"pid": 7001})
    Runner._attach_nccl_log(tmp_path, result)
    assert result.status == "ok" and not result.nccl and result.sizes[0].algo is None


# --- srun's tasks: rankexec --user --------------------------------------------------------------

STATUS_SCRIPT = """
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
keep = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs")
print(json.dumps({**{k: status[k].split() for k in keep}, "HOME": os.environ.get("HOME"),
                  "USER": os.environ.get("USER"), "RANK": os.environ.get("RANK")}))
"""


def test_an_srun_task_started_as_root_becomes_the_rank_user(user: RankUser, python: str) -> None:
    """What srun's command does on every node (Slurm starts tasks as the allocation's owner, root
    here): rankexec --user switches before it execs the worker."""
    from nccltune.trials import rankexec

    where = Path(tempfile.mkdtemp(prefix="nccltune-srun-task-", dir="/tmp"))
    try:
        where.chmod(0o755)
        (where / "status.py").write_text(STATUS_SCRIPT)
        env = {"PATH": "/usr/bin:/bin", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
               "HOME": "/root"}
        proc = subprocess.run([python, "-I", rankexec.__file__, "--slurm", "--user", user.name,
                               str(where / "status.py")], capture_output=True, text=True, timeout=120,
                              cwd=where, env=env)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["Uid"] == [str(user.uid)] * 4 and got["Gid"] == [str(user.gid)] * 4
        assert set(got["Groups"]) == {str(g) for g in user.groups}
        assert all(int(got[c][0], 16) == 0 for c in ("CapInh", "CapPrm", "CapEff", "CapAmb"))
        assert got["NoNewPrivs"] == ["1"]
        assert got["HOME"] == str(where) and got["USER"] == user.name and got["RANK"] == "0"
        bad = subprocess.run([python, "-I", rankexec.__file__, "--slurm", "--user", "no-such-rank-user",
                              str(where / "status.py")], capture_output=True, text=True, timeout=120,
                             cwd=where, env=env)
        assert bad.returncode == 4 and "no-such-rank-user" in bad.stderr and not bad.stdout
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_srun_passes_the_rank_user_to_every_task(tmp_path: Path) -> None:
    from nccltune.trials.launch.base import RANKEXEC, WORKER, TrialSpec
    from nccltune.trials.launch.srun import SrunLaunch

    launch = SrunLaunch(2, 1, master_addr="localhost", master_port=29500, nodelist=["localhost", "node-b"])
    worker = ["/opt/py/bin/python", str(WORKER), "--backend", "gloo", "--sizes", "1024"]
    (spec,) = launch.start(TrialSpec(1, tmp_path, worker, {"PATH": "/usr/bin"}, {}, 60, user="ranks"))
    assert spec.argv[spec.argv.index(str(RANKEXEC)):] == [
        str(RANKEXEC), "--slurm", "--user", "ranks", str(WORKER), "--backend", "gloo", "--sizes", "1024"]
    (plain,) = launch.start(TrialSpec(1, tmp_path, worker, {"PATH": "/usr/bin"}, {}, 60))
    assert "--user" not in plain.argv


# -- in the DaemonSet's pod --------------------------------------------------------------------------

MANIFEST = REPO / "deploy" / "kubernetes" / "nccltune-daemonset.yaml"
# linux/capability.h, in bit order.
CAPABILITY_BITS = {name: bit for bit, name in enumerate((
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE"))}

POD_SCRIPT = """
import json, sys
from pathlib import Path
from nccltune.errors import NccltuneError
from nccltune.trials.runner import Runner, TrialAborted
python, user, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
env = {"PATH": "/usr/bin:/bin"}
def status(pid):
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}
try:
    first = Runner(python=python, backend="gloo", nranks=2, base_env=env, work_dir=work, timeout_s=240, user=user)
except NccltuneError as exc:
    print(json.dumps({"refused": exc.exit_code, "message": str(exc)}))
    sys.exit(0)
ok = first.run({}, [4096], warmup=1, iters=2).status
record = work / "ranks.running"
ranks = {}
def look():
    out = work / "trial-001" / "rank0.out"
    if out.exists() and '"event": "start"' in out.read_text():
        for line in record.read_text().splitlines():
            ranks[int(line.split()[0])] = status(int(line.split()[0]))
        return "read"
    return None
# The same trial directory again: the ranks' old one is root's to take back and remove.
held = Runner(python=python, backend="gloo", nranks=2, base_env={**env, "NCCLTUNE_WORKER_FAULT": "hang"},
              work_dir=work, timeout_s=240, user=user, abort_check=look, rank_record=record)
try:
    held.run({}, [4096], warmup=1, iters=2)
except TrialAborted:
    pass
alive = [p for p in ranks if Path(f"/proc/{p}").exists()]
print(json.dumps({"ok": ok, "ranks": ranks, "alive": alive, "daemon": status("self")}))
"""


@pytest.fixture(scope="module")
def image_etc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's /etc/passwd and /etc/group, made by the Containerfile's own commands."""
    from containerfile import user_db

    needs_root()
    for tool in ("useradd", "groupadd", "unshare", "mount", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed here")
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace can be made here")
    return user_db(tmp_path_factory.mktemp("image"))


def in_the_pod(caps: list[str], etc: Path, python: str, user: str, work: Path) -> dict[str, object]:
    """POD_SCRIPT run as the daemon in the DaemonSet's container: root whose only capabilities are
    `caps` (the runtime makes them its bounding, permitted and effective sets), under
    no_new_privs (allowPrivilegeEscalation: false), with the image's /etc/passwd and /etc/group
    (bound over this machine's in a mount namespace of its own)."""
    bounding = ",".join(["-all", *("+" + c.lower() for c in caps)])
    binds = 'mount --bind "$1/passwd" /etc/passwd && mount --bind "$1/group" /etc/group && shift && exec "$@"'
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", binds, "sh", str(etc),
                           "setpriv", "--no-new-privs", "--bounding-set", bounding, "--inh-caps", "-all",
                           sys.executable, "-c", POD_SCRIPT, python, user, str(work)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return got


def test_the_ranks_run_unprivileged_in_the_pod(image_etc: Path, python: str, tmp_path: Path) -> None:
    """The shipped securityContext and the image's rank user, bench.user of the shipped config:
    a trial runs, a reused trial directory is cleared, held ranks are ended; every rank runs as
    the image's uid with its own group only, no capability and no_new_privs."""
    from containerfile import rank_account

    account = rank_account()
    docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}
    (container,) = [c for c in docs["DaemonSet/nccltune"]["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "nccltune"]  # the daemon's, beside the device plugin's
    sc = container["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    config = yaml.safe_load(docs["ConfigMap/nccltune-config"]["data"]["config.yaml"])
    assert config["bench"]["user"] == account.name
    work = tmp_path / "work"
    work.mkdir()
    got = in_the_pod(sc["capabilities"]["add"], image_etc, python, config["bench"]["user"], work)
    assert got["ok"] == "ok", got
    ranks = got["ranks"]
    assert isinstance(ranks, dict) and len(ranks) == 2 and got["alive"] == [], got
    for status in ranks.values():
        assert status["Uid"].split() == [str(account.uid)] * 4, status["Uid"]
        assert status["Gid"].split() == [str(account.gid)] * 4, status["Gid"]
        assert status["Groups"].split() == [str(account.gid)], status["Groups"]
        for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
            assert int(status[caps], 16) == 0, (caps, status[caps])
        assert status["NoNewPrivs"] == "1"
    daemon = got["daemon"]
    assert isinstance(daemon, dict) and daemon["NoNewPrivs"] == "1"
    assert int(daemon["CapEff"], 16) == sum(1 << CAPABILITY_BITS[c] for c in sc["capabilities"]["add"])
    assert (work / "trial-001" / RANK_DIR).stat().st_uid == account.uid


def test_without_the_units_capabilities_the_pod_refuses_every_sweep(image_etc: Path, python: str,
                                                                    tmp_path: Path) -> None:
    """What the pod did with all capabilities dropped but IPC_LOCK: once the image has the rank
    user, root cannot switch to it, and the runner refuses before any trial (exit 78)."""
    from containerfile import rank_account

    got = in_the_pod(["IPC_LOCK"], image_etc, python, rank_account().name, tmp_path)
    assert got["refused"] == EXIT_CONFIG, got
    assert "cannot switch to user" in str(got["message"]), got
