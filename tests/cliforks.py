"""`python -m nccltune ARGS`, each call in a process of its own, forked from one interpreter that
has imported the command line (and the modules its caller names) already: a call costs a fork, not
an interpreter's start and nccltune's imports (tests/test_bad_input.py runs the command line once
per malformed input).

A call's process runs the command line as `python -m nccltune` does: its argv, its working
directory, stdin /dev/null, stdout and stderr into files, and the exit status Python gives its
SystemExit or an uncaught exception (whose traceback goes to stderr); atexit handlers run before it
exits. It is killed at its timeout, as subprocess.run kills its child. Every call's process is
forked from the server as it was before any call ran, so no call sees what another one did.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
from pathlib import Path

_SERVER = r'''
import atexit, importlib, json, os, runpy, select, signal, sys, traceback
import nccltune.cli  # what `python -m nccltune` imports first: loaded once, before any fork
for name in sys.argv[1:]:  # and what the calls' commands import when they run
    importlib.import_module(name)

def run_child(req):
    os.chdir(req["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.closerange(3, 1 << 16)
    sys.argv = ["-m", *req["argv"]]
    sys.path[0] = req["cwd"]  # -m puts the working directory first on the path
    code = 0
    try:
        runpy.run_module("nccltune", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)

def serve():
    for line in sys.stdin.buffer:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                run_child(req)
            finally:
                os._exit(70)
        pidfd = os.pidfd_open(pid)
        ready, _, _ = select.select([pidfd], [], [], req["timeout_s"])
        timed_out = not ready
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        rc = os.waitstatus_to_exitcode(status)
        sys.stdout.write(json.dumps({"rc": rc, "timed_out": timed_out}) + "\n")
        sys.stdout.flush()

serve()
'''


class CliForks:
    """The server and its calls: `run(cwd, args, timeout_s)` gives (exit status, stdout, stderr)."""

    def __init__(self, env: dict[str, str], cwd: Path, preload: tuple[str, ...] = ()) -> None:
        """The server runs with `env` in `cwd`, and has imported nccltune.cli and the modules
        `preload` names (those the calls' commands import as they run) before its first fork."""
        self._dir = Path(tempfile.mkdtemp(prefix="cliforks-"))
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, cwd=cwd)

    def run(self, cwd: Path, args: list[str], timeout_s: float) -> tuple[int, str, str]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        out, err = self._dir / "out", self._dir / "err"
        request = {"argv": args, "cwd": str(cwd), "out": str(out), "err": str(err), "timeout_s": timeout_s}
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        # The server kills the call at its timeout and answers; a server that does not is a failure too.
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s + 60)
        if not ready:
            raise subprocess.TimeoutExpired(["nccltune", *args], timeout_s)
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the command line's fork server ended (status {self._proc.wait()})")
        reply = json.loads(line)
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(["nccltune", *args], timeout_s)
        return reply["rc"], out.read_text(), err.read_text()  # decoded as subprocess.run(text=True) does

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        for name in ("out", "err"):
            (self._dir / name).unlink(missing_ok=True)
        self._dir.rmdir()
