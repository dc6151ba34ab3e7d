"""The worker's probe of its interpreter: the versions and NCCL's library file, found by the
worker's own memory-map rule, a path with spaces included; and how the sweep and daemon read it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from nccltune.trials.probe import parse_probe, probe_nccl
from nccltune.trials.worker import probe_record


def _library(tmp_path: Path) -> Path:
    lib = tmp_path / "my envs" / "nccl lib" / "libnccl.so.2.28.9"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF" + b"\0" * 60)
    return lib


def test_the_probe_record_keeps_a_library_path_with_spaces(tmp_path: Path) -> None:
    lib = _library(tmp_path)
    out = json.dumps({"event": "probe", "torch_version": "2.5.1", "nccl_version": "2.28.9", "nccl_lib": str(lib)})
    info = parse_probe("some warning torch printed\n" + out + "\n")
    assert info["nccl_lib"] == str(lib)
    st = os.stat(lib)
    assert info["nccl_lib_stat"] == [st.st_size, int(st.st_mtime)]
    assert "event" not in info and info["nccl_version"] == "2.28.9"


def test_a_probe_that_prints_no_record_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        parse_probe("")
    with pytest.raises(ValueError):
        parse_probe("[1, 2]\n")
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho 'Traceback: no module'\nexit 1\n")
    script.chmod(0o755)
    assert "error" in probe_nccl(str(script))
    assert "error" in probe_nccl(str(tmp_path / "missing-python"))


def test_probe_nccl_runs_the_worker_probe_of_the_given_interpreter(tmp_path: Path) -> None:
    # An interpreter that answers as the worker's probe would on a GPU node, and records how it
    # was asked: the worker file and --probe, nothing embedded.
    lib = _library(tmp_path)
    args_file = tmp_path / "args"
    script = tmp_path / "python"
    record = json.dumps({"event": "probe", "torch_version": "2.5.1", "nccl_version": "2.28.9",
                         "nccl_lib": str(lib)})
    script.write_text(f"#!/bin/sh\necho \"$@\" > '{args_file}'\necho '{record}'\n")
    script.chmod(0o755)
    info = probe_nccl(str(script))
    assert info["nccl_lib"] == str(lib) and info["nccl_version"] == "2.28.9"
    assert info["nccl_lib_stat"][0] == lib.stat().st_size
    isolated, worker, flag = args_file.read_text().split()
    assert isolated == "-I" and worker.endswith("trials/worker.py") and flag == "--probe"


def test_the_worker_probe_finds_the_library_by_the_memory_map_rule(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    maps = ("7f00-7f01 r-xp 00000000 08:01 7 /usr/lib/libc.so.6\n"
            "7f10-7f20 r-xp 00000000 08:01 99 /srv/my envs/nccl/lib/libnccl.so.2.28.9\n")
    info = probe_record(lambda: maps)
    assert info["nccl_lib"] == "/srv/my envs/nccl/lib/libnccl.so.2.28.9"
    assert info["torch_version"] and info["event"] == "probe"

    def unreadable() -> str:
        raise OSError("no /proc here")

    assert probe_record(unreadable)["nccl_lib"] is None


def test_the_real_worker_probe_answers_for_this_interpreter() -> None:
    pytest.importorskip("torch")
    import torch

    info = probe_nccl(sys.executable)
    assert info["torch_version"] == torch.__version__
    assert "error" not in info
