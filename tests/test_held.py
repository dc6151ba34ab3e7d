"""The one way root signals a process (trials.held): through a pidfd it holds, a process group only
while its leader is not reaped, so a pid handed again to another process is never hit. Real
processes; the pid reuse itself in a pid namespace of the test's own (tests/pidns.py)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from nccltune.trials.held import Child, Held, below
from tests.pidns import run_in_pid_namespace


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


_REUSED = '''
import json, signal, subprocess
from nccltune.trials.held import Child, Held

old = Child(["sleep", "60"], start_new_session=True)
old.kill_group()
old.wait()
reused = Held.open(old.pid)  # what the pid names now: nobody, until it is handed again
bystander = give_pid(old.pid, ["sleep", "60"])
# Every way nccltune signals what it held, on the old child whose pid the bystander now has.
old.kill_group()
old.send_signal(signal.SIGKILL)
old.kill()
old.terminate()
group, itself = old.held.signal_group(signal.SIGKILL), old.held.signal(signal.SIGKILL)
alive = bystander.poll() is None
bystander.kill()
print(json.dumps({"exists": old.held.exists(), "ended": old.held.ended(), "group": group, "itself": itself,
                  "alive": alive, "open_before": reused is not None, "pid": old.pid, "bystander": bystander.pid}))
'''


def test_a_reaped_childs_pid_handed_to_another_group_leader_is_never_signalled() -> None:
    got = run_in_pid_namespace(_REUSED)
    assert got["pid"] == got["bystander"]
    assert got["alive"], "a signal meant for the reaped child reached the process that got its pid"
    assert got == {**got, "exists": False, "ended": True, "group": False, "itself": False, "open_before": False}


def test_a_group_is_signalled_through_its_held_leader() -> None:
    # The leader (sh) and a member of its group (sleep): both end, and the leader is then reaped.
    leader = Child(["sh", "-c", "sleep 60 & echo $!; wait"], start_new_session=True, stdout=subprocess.PIPE)
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    assert leader.held.exists() and not leader.held.ended()
    leader.kill_group()
    assert leader.wait(timeout=10) == -signal.SIGKILL
    assert _gone(member)
    leader.stdout.close()
    assert not leader.held.exists() and leader.held.ended()
    assert not leader.held.signal_group(signal.SIGKILL) and not leader.held.signal(0)


def test_a_zombie_leader_still_names_its_group() -> None:
    """A leader that has exited but is not reaped still holds its pid: its group may be signalled."""
    leader = Child(["sh", "-c", "sleep 60 & echo $!"], start_new_session=True, stdout=subprocess.PIPE)
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    leader.stdout.close()
    deadline = time.monotonic() + 10
    while not leader.held.ended() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert leader.held.ended() and leader.held.exists()  # a zombie, not reaped (nothing waited on it)
    assert leader.held.signal_group(signal.SIGKILL)
    assert _gone(member)
    assert leader.wait(timeout=10) == 0


def test_below_holds_every_process_below_and_nothing_else() -> None:
    top = Child(["sh", "-c", "sleep 60 & sh -c 'sleep 60 & wait' & wait"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        tree = below(top.held)
        while len(tree) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
            tree = below(top.held)
        # sleep, sh, and the inner sleep; this process and the bystander are not below it.
        assert len(tree) == 3 and other.pid not in {h.pid for h in tree}
        for held in tree:
            held.kill()
        for held in tree:
            assert _gone(held.pid)
        assert other.poll() is None
    finally:
        top.kill_group()
        top.wait(timeout=10)
        other.kill()
        other.wait(timeout=10)


def test_no_pid_is_held_that_is_not_a_process() -> None:
    assert Held.open(0) is None and Held.open(-1) is None
    assert Held.open(2**22 + 12345) is None  # beyond any pid_max
