"""The nccl-tests engine: its command line, the parsing of its output, one `*_perf` binary per collective."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from conftest import NCCL_TESTS_OUTPUT

from nccltune.cli import main
from nccltune.config import Config
from nccltune.errors import EXIT_CONFIG
from nccltune.trials import nccltests
from nccltune.trials.runner import Runner

REFERENCE = NCCL_TESTS_OUTPUT


def test_reference_output_parses_to_its_rows() -> None:
    rows, version = nccltests.parse_output((REFERENCE / "all_reduce_perf.default.txt").read_text())
    assert version == "2.28.9"
    by_size = {r.size_bytes: r for r in rows}
    assert sorted(by_size) == [1024 * 4**i for i in range(11)]
    # out-of-place columns are the headline numbers; in place kept beside them
    assert by_size[1 << 30].busbw_gbps == pytest.approx(329.17)
    assert by_size[1 << 30].inplace_busbw_gbps == pytest.approx(332.28)
    assert by_size[4 << 20].time_us == pytest.approx(35.37)
    assert all(r.correct for r in rows)


def test_wrong_values_make_a_row_incorrect() -> None:
    text = ("#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n"
            "  4194304  1048576  float  sum  -1  35.37  118.57  118.57  3  35.18  119.21  119.21  0\n")
    (row,), _ = nccltests.parse_output(text)
    assert not row.correct


def test_garbage_lines_are_skipped() -> None:
    rows, version = nccltests.parse_output("hello\n# comment 1 2 3\n  12 x y\n")
    assert rows == [] and version is None


def test_command_uses_the_ladder_and_one_process_over_all_gpus() -> None:
    cmd = nccltests.command("/opt/nccl-tests/all_reduce_perf", [65536 * 4**i for i in range(9)], 8, 5, 20)
    assert cmd[0] == "/opt/nccl-tests/all_reduce_perf"
    args = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert args == {"-b": "65536", "-e": str(65536 * 4**8), "-f": "4", "-g": "8", "-w": "5", "-n": "20",
                    "-c": "1", "-d": "float", "-o": "sum"}


def test_find_binary_in_a_configured_directory(tmp_path: Path) -> None:
    assert nccltests.find_binary(str(tmp_path)) is None
    (tmp_path / "all_reduce_perf").write_text("")
    assert nccltests.find_binary(str(tmp_path)) == str(tmp_path / "all_reduce_perf")


def test_demo_refuses_the_nccl_tests_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bench:\n  engine: nccl-tests\n")
    rc = main(["sweep", "--demo", "--config", str(cfg), "--state-dir", str(tmp_path / "s")])
    assert rc == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{cfg}:2" in err and "nccl-tests" in err
    assert not (tmp_path / "s" / "history.db").exists()


# -- one *_perf binary per collective ---------------------------------------------------------

HANDWRITTEN_ALL_GATHER = REFERENCE / "all_gather_perf.handwritten.txt"
LADDER = [1024 * 4**i for i in range(6)]


def test_every_collective_has_its_binary_beside_all_reduce_perf() -> None:
    from nccltune.collectives import COLLECTIVES

    got = {name: nccltests.binary_for("/opt/nccl-tests/build/all_reduce_perf", name) for name in COLLECTIVES}
    assert got == {
        "all_reduce": "/opt/nccl-tests/build/all_reduce_perf", "all_gather": "/opt/nccl-tests/build/all_gather_perf",
        "reduce_scatter": "/opt/nccl-tests/build/reduce_scatter_perf",
        "broadcast": "/opt/nccl-tests/build/broadcast_perf", "reduce": "/opt/nccl-tests/build/reduce_perf",
        "all_to_all": "/opt/nccl-tests/build/alltoall_perf", "sendrecv": "/opt/nccl-tests/build/sendrecv_perf"}


def test_all_gather_perf_output_parses_with_the_same_parser() -> None:
    rows, version = nccltests.parse_output(HANDWRITTEN_ALL_GATHER.read_text())
    assert version == "2.28.9"
    assert [r.size_bytes for r in rows] == LADDER
    top = rows[-1]
    # The size column is the gathered array; busbw is algbw x (n-1)/n on 2 GPUs, as collectives.py computes it.
    from nccltune.collectives import get

    assert (top.time_us, top.algbw_gbps, top.busbw_gbps) == (32.0, 32.77, 16.38)
    assert get("all_gather").busbw_gbps(top.size_bytes, top.time_us, 2) == pytest.approx(top.busbw_gbps, abs=0.01)
    assert all(r.correct for r in rows)


def _fake_suite(tmp_path: Path, outputs: dict[str, str]) -> str:
    """A directory of `*_perf` stand-ins that print the given output: the binaries nccltune runs."""
    suite = tmp_path / "nccl-tests"
    suite.mkdir()
    for binary, text in outputs.items():
        (suite / f"{binary}.txt").write_text(text)
        script = suite / binary
        script.write_text(f"#!/bin/sh\nexec cat '{suite / binary}.txt'\n")
        script.chmod(0o755)
    return str(suite / "all_reduce_perf")


def _runner(tmp_path: Path, binary: str) -> Runner:
    return Runner(python=sys.executable, backend="nccl", nranks=2, base_env={"PATH": "/usr/bin:/bin"},
                  work_dir=tmp_path / "work", timeout_s=30, nccl_debug=False, nccl_tests=binary)


def test_a_trial_runs_the_binary_of_each_collective(tmp_path: Path) -> None:
    binary = _fake_suite(tmp_path, {"all_reduce_perf": (REFERENCE / "all_reduce_perf.default.txt").read_text(),
                                    "all_gather_perf": HANDWRITTEN_ALL_GATHER.read_text()})
    result = _runner(tmp_path, binary).run({}, LADDER, warmup=1, iters=1, collectives=["all_reduce", "all_gather"])
    assert result.status == "ok", result.reason
    by_key = result.busbw_by_key()
    assert by_key[("all_reduce", 1 << 20)] == pytest.approx(44.17)
    assert by_key[("all_gather", 1 << 20)] == pytest.approx(16.38)
    assert sorted(by_key) == sorted((c, s) for c in ("all_reduce", "all_gather") for s in LADDER)
    assert result.method == "out-of-place; all_reduce_perf, all_gather_perf (nccl-tests)"


def test_wrong_values_of_one_binary_fail_the_trial_naming_it(tmp_path: Path) -> None:
    wrong = HANDWRITTEN_ALL_GATHER.read_text().replace(
        "32.77   16.38       0", "32.77   16.38       5")
    binary = _fake_suite(tmp_path, {"all_reduce_perf": (REFERENCE / "all_reduce_perf.default.txt").read_text(),
                                    "all_gather_perf": wrong})
    result = _runner(tmp_path, binary).run({}, LADDER, warmup=1, iters=1, collectives=["all_reduce", "all_gather"])
    assert (result.status, result.reason) == ("wrong_result", "all_gather_perf counted wrong values")


def test_a_missing_binary_of_the_profile_is_unavailable(tmp_path: Path) -> None:
    from nccltune.config import with_overrides
    from nccltune.errors import UnavailableError
    from nccltune.node import load_node
    from nccltune.trials.session import resolve_engine

    binary = _fake_suite(tmp_path, {"all_reduce_perf": ""})
    cfg = with_overrides(Config(), **{"bench.engine": "nccl-tests", "bench.nccl_tests_dir": str(Path(binary).parent)})
    node = dataclasses.replace(load_node(cfg, True), demo=False, backend="nccl")
    assert resolve_engine(cfg, node, ["all_reduce"]).nccl_tests == binary
    with pytest.raises(UnavailableError, match="all_gather_perf, reduce_scatter_perf"):
        resolve_engine(cfg, node, ["all_gather", "reduce_scatter"])
