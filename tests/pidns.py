"""A pid namespace of the test's own, where the test may say which pid the next process gets.

`unshare --user --map-root-user --pid --fork --mount-proc` runs a script as pid 1 of a new pid
namespace, root of a user namespace of its own (so no privilege is needed where unprivileged user
namespaces are allowed), with /proc mounted for that namespace. There the script may write
/proc/sys/kernel/ns_last_pid, and the next process started gets the pid after it: a pid that
was a rank's is handed again, on purpose, to another process. Where this cannot be done the test
is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

# Python run in the namespace before the script: `give_pid(pid, argv)` starts argv (in a session
# of its own, so it leads a process group whose id is that pid) as the process that gets `pid`. A
# process that has just been reaped can hold its pid a moment longer (its /proc entry already
# gone), and the namespace's other processes may fork meanwhile: a start that got another pid is
# ended and tried again, a few times.
PRELUDE = '''
import os, subprocess, time

def give_pid(pid, argv, tries=50):
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(pid - 1))
        proc = subprocess.Popen(argv, start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} was not handed to {argv} in {tries} tries")
'''


def run_in_pid_namespace(script: str, *args: str, timeout_s: float = 120.0) -> Any:
    """Run `script` (Python, after PRELUDE) in a pid namespace of its own with `args`; it prints
    one JSON document as its last line of stdout, which is returned."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "sh", "-c",
                            "echo 1 > /proc/sys/kernel/ns_last_pid"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no pid namespace of the test's own here: {probe.stderr.strip()[:200]}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", sys.executable,
                           "-c", PRELUDE + script, *args], capture_output=True, text=True, timeout=timeout_s, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
