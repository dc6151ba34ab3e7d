"""What root reads of a program it runs on what another party shaped is bounded in bytes and time
(files.inputfile.read_output): the worker's probe in bench.image's image (trials.container) and the
loader's cache (`ldconfig -p`, nccl.site), each under a fake program that prints without end."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO

from nccltune.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, InputError, UnavailableError
from nccltune.files.inputfile import Ran, read_output
from nccltune.images import parse_image
from nccltune.nccl import site
from nccltune.trials import container as container_mod
from nccltune.trials.container import MAX_PROBE_OUT_BYTES, Container

IMAGE = "registry.example/team/train@sha256:" + "ab" * 32
HUNDRED_MB = 100 * 10**6


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fake(tmp: Path, name: str, body: str) -> Path:
    """A program `name` in `tmp` that records its arguments (one call a line) and runs `body`
    (a runtime: for `run` only)."""
    path = tmp / name
    path.write_text(f'#!/bin/sh\necho "$*" >> {tmp}/calls\n[ "$1" = rm ] && exit 0\n{body}\n')
    path.chmod(0o755)
    return path


def _probe(tmp: Path, body: str) -> dict[str, str]:
    c = Container("podman", parse_image(IMAGE), REPO / "nccltune" / "trials", gpus=False,
                  executable=str(_fake(tmp, "podman", body)))
    return c.probe({"PATH": "/usr/bin:/bin"})


def test_a_probe_that_prints_without_end_is_refused_within_its_bound(tmp_path: Path) -> None:
    before = _peak_mib()
    with pytest.raises(InputError) as got:
        _probe(tmp_path, f"head -c {HUNDRED_MB} /dev/zero | tr '\\0' x; echo '{{}}'")
    assert got.value.exit_code == EXIT_CONFIG
    assert f"bench.image: {IMAGE} (podman): the worker's probe in the image printed more than " \
           f"{MAX_PROBE_OUT_BYTES} bytes" in str(got.value)
    assert _peak_mib() - before < 50  # 100 MB read whole would be twice that
    # Killed at the bound, its container removed by the name it was started with.
    run, rm = (tmp_path / "calls").read_text().splitlines()
    name = run.split("--name ", 1)[1].split()[0]
    assert name.startswith("nccltune-probe-") and rm == f"rm -f {name}"


def test_a_probe_that_does_not_answer_json_is_refused_naming_the_image(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"train@sha256:a+b.*answered not json\\x1b\[2J, not a JSON object"):
        _probe(tmp_path, "echo 'not json\033[2J'")
    assert _probe(tmp_path, """echo 'a line of its own'; echo '{"event": "probe", "torch_version": "2.13.0"}'""") \
        == {"torch_version": "2.13.0"}


def test_a_probe_that_fails_or_hangs_is_unavailable_with_its_last_words(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnavailableError) as got:
        _probe(tmp_path, "head -c 3000000 /dev/zero >&2; printf '\\nno torch\\033[31m here\\n' >&2; exit 3")
    assert got.value.exit_code == EXIT_UNAVAILABLE
    assert str(got.value).endswith("the worker's probe exited 3: no torch\\x1b[31m here")
    monkeypatch.setattr(container_mod, "PROBE_TIMEOUT_S", 0.2)
    with pytest.raises(UnavailableError, match=r"the worker's probe still running after 0.2 s: \(nothing on stderr\)"):
        _probe(tmp_path, "exec sleep 30")


def _run(argv: list[str], *, limit: int, err_limit: int, timeout_s: float) -> Ran:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    return read_output(proc, limit=limit, err_limit=err_limit, timeout_s=timeout_s)


def test_read_output_keeps_stdout_from_its_start_and_stderr_from_its_end() -> None:
    script = "printf 'one\\ntwo\\n'; head -c 100000 /dev/zero >&2; printf '\\nlast\\n' >&2; exit 4"
    got = _run(["sh", "-c", script], limit=100, err_limit=1000, timeout_s=30)
    assert (got.returncode, got.killed, got.stdout.text(), got.stdout.cut) == (4, None, "one\ntwo\n", False)
    assert got.stderr.cut and len(got.stderr.data) == 1000 and got.stderr.lines()[-1] == "last"
    # Both pipes closed, the program still running: its timeout ends it.
    quiet = _run(["sh", "-c", "exec >&- 2>&-; sleep 30"], limit=100, err_limit=100, timeout_s=0.2)
    assert quiet.returncode is None and quiet.killed == "still running after 0.2 s"


def test_the_loader_cache_is_read_within_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The system's ldconfig stood in for by a program of the test's (root never takes one from PATH).
    monkeypatch.setattr(site, "system_program", lambda name, what: tmp_path / name)
    _fake(tmp_path, "ldconfig",
          "echo '2 libs found in cache'; echo '\tlibnccl.so.2 (libc6,x86-64) => /opt/nccl/libnccl.so.2'")
    assert site._loader_cache() == {"libnccl.so.2": Path("/opt/nccl/libnccl.so.2")}
    before = _peak_mib()
    _fake(tmp_path, "ldconfig", f"head -c {HUNDRED_MB} /dev/zero")
    assert site._loader_cache() == {}
    assert _peak_mib() - before < 50


def test_the_loader_cache_never_comes_from_an_ldconfig_on_the_callers_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    _fake(tmp_path, "ldconfig", "echo '\tlibplanted.so (libc6,x86-64) => /tmp/libplanted.so'")
    assert "libplanted.so" not in site._loader_cache()
    assert not (tmp_path / "calls").exists()  # never even run


@pytest.fixture
def interrupted() -> Iterator[None]:
    """A KeyboardInterrupt 0.2 s into the test (a sweep stopped by a signal as it reads)."""
    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_stopped_reader_leaves_no_program_and_no_probe_container(tmp_path: Path, interrupted: None) -> None:
    proc = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    with pytest.raises(KeyboardInterrupt):
        read_output(proc, limit=100, err_limit=100, timeout_s=30)
    assert proc.returncode == -signal.SIGKILL
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    with pytest.raises(KeyboardInterrupt):
        _probe(tmp_path, "exec sleep 30")
    run, rm = (tmp_path / "calls").read_text().splitlines()
    assert rm == f"rm -f {run.split('--name ', 1)[1].split()[0]}"


def test_enroots_probe_runs_with_the_path_every_rank_gets(tmp_path: Path) -> None:
    """Without a login shell enroot gives the command no PATH of the image's: the probe hands on
    its own by name, as the ranks' trial environment does, so that it runs the python they run."""
    c = Container("enroot", parse_image(IMAGE), REPO / "nccltune" / "trials", gpus=False,
                  executable=str(_fake(tmp_path, "enroot", """echo '{"event": "probe", "python": "3.11.2"}'""")))
    assert c.probe({"PATH": "/usr/bin:/bin"}) == {"python": "3.11.2"}
    (call,) = (tmp_path / "calls").read_text().splitlines()
    assert call.startswith("start ") and " --env PATH nccltune-" + "ab" * 16 + " sh -c " in call
