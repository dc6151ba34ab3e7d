"""Rank server: imports torch once per sweep and forks every rank of the sweep's trials from it.

Importing torch costs a rank process about a second of CPU (several on a GPU node, where the CUDA
libraries load too), and a trial needs fresh rank processes, because NCCL reads most of its
variables once per process. A process forked after the import but before anything touches CUDA
or NCCL is such a fresh process: CUDA is initialised, NCCL reads its variables and torch builds its
process group in the child, under the child's own environment, as in a process started by exec.

Executed by path with the worker's interpreter, isolated (`python -I rankserver.py`), as the rank
user, in a session of its own, by the runner (trials.forkedranks), and it imports only the
standard library, torch and worker.py (loaded by path from this file's directory). It is started
with the environment every rank of the sweep shares; what differs between ranks and trials
(`LATE_PREFIXES`, `LATE_NAMES`: read by NCCL, torch's process group and the worker only after a
rank has started) comes with each request. A rank whose environment differs in anything else is
started by exec instead (the runner decides, with `same_start`).

Usage: rankserver.py FD. Protocol, over the SOCK_SEQPACKET socket on descriptor FD (one JSON
document per message):
- server: {"ready": PID} once torch is imported, or {"error": TEXT} and exit 4;
- runner: {"argv": [worker args...], "env": {...}} with four descriptors: the rank's stdin, stdout
  and stderr, and its working directory (opened by the runner, which may reach it where the rank
  user could not walk the path); server: {"started": PID} or {"refused": TEXT};
- server, whenever a rank ends: {"exited": PID, "code": STATUS} (negative: killed by that signal).
The server ends when the runner closes its end, and dies with the runner (PR_SET_PDEATHSIG);
each rank dies with the server, so a killed runner leaves no rank behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import NoReturn

# Variables read after a rank has started (NCCL at communicator init, torch's process group when it
# is built, the worker and the rendezvous), and the rank's own identity and directories. Anything
# else may be read while torch is imported, so it must be what the server started with.
LATE_PREFIXES = ("NCCL_", "TORCH_NCCL_", "NCCLTUNE_")
LATE_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "HOME", "USER", "LOGNAME", "XDG_CACHE_HOME", "CUDA_CACHE_PATH"})
MAX_MESSAGE = 1 << 20
EXIT_SETUP = 4
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def is_late(name: str) -> bool:
    return name in LATE_NAMES or name.startswith(LATE_PREFIXES)


def start_part(env: Mapping[str, str]) -> dict[str, str]:
    """What of `env` a rank must share with the server: everything that is not read late."""
    return {k: v for k, v in env.items() if not is_late(k)}


def same_start(server_env: Mapping[str, str], rank_env: Mapping[str, str]) -> bool:
    """A rank with `rank_env` may be forked from a server started with `server_env`."""
    return start_part(server_env) == start_part(rank_env)


def _load_worker() -> ModuleType:
    path = Path(__file__).with_name("worker.py")
    spec = importlib.util.spec_from_file_location("_nccltune_worker", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _send(sock: socket.socket, doc: dict[str, object]) -> None:
    try:
        sock.send(json.dumps(doc).encode())
    except OSError:
        os._exit(0)  # the runner is gone: so are its ranks (they die with this process)


def _name(libc: ctypes.CDLL, name: str) -> None:
    """The process's name as ps and top show it (15 bytes): the command line is the server's."""
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _die_with(parent: int, libc: ctypes.CDLL) -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _rank(worker: ModuleType, request: dict[str, object], fds: list[int], sock: socket.socket,
          server: int, libc: ctypes.CDLL) -> None:
    """In the forked child: become the rank the request describes, run the worker, exit."""
    code = 1
    try:
        os.setsid()
        _die_with(server, libc)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a Python started by exec
        sock.close()
        os.fchdir(fds[3])
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        env = request["env"]
        argv = request["argv"]
        assert isinstance(env, dict) and isinstance(argv, list)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        _name(libc, f"nccltune-rank{os.environ.get('RANK', '')}")
        sys.argv = [worker.__file__ or "worker.py", *(str(a) for a in argv)]
        # Line by line, as PYTHONUNBUFFERED gives a rank started by exec: the runner reads as it goes.
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
        code = int(worker.main(sys.argv[1:]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a rank's traceback goes to its own stderr, as under exec
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _end(code)  # in this rank: nothing of the server's runs after its work


def _end(code: int) -> NoReturn:
    """End this process as an interpreter ends, less the teardown of torch's modules and objects
    (half a second of CPU, which a forked rank's trial and the runner closing the server would
    wait for): what was registered to run at exit runs, the streams are flushed, then it exits."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            children.discard(pid)
            continue
        if got == pid:
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _send(sock, {"exited": pid, "code": code})


def serve(sock: socket.socket) -> int:
    """Answer the runner's requests until it closes its end. The runner started this process to
    die with it (trials.credentials.rank_preexec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        worker = _load_worker()
        import torch
        import torch.distributed  # noqa: F401
    except Exception as exc:
        _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return EXIT_SETUP
    _name(libc, "nccltune-ranksv")
    _send(sock, {"ready": os.getpid()})
    server = os.getpid()
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock, children)
        if not ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except OSError:
            return 0
        if not data:
            return 0  # the runner closed its end: the sweep is over
        try:
            request = json.loads(data)
            if not isinstance(request, dict) or len(fds) != 4:
                raise ValueError("expected a JSON object and four descriptors")
        except ValueError as exc:
            for fd in fds:
                os.close(fd)
            _send(sock, {"refused": str(exc)})
            continue
        pid = os.fork()
        if pid == 0:
            _rank(worker, request, fds, sock, server, libc)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, {"started": pid})


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        sys.stderr.write("usage: rankserver.py FD\n")
        return 2
    sock = socket.socket(fileno=int(argv[0]))
    # Ranks run in sessions of their own; a terminal's Ctrl-C is the runner's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    # The runner closing its end waits for this exit (forkedranks.RankServer.close); an exception
    # out of main ends the interpreter as usual.
    _end(main(sys.argv[1:]))
