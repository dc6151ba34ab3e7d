"""The nccl-tests engine: its command line and the parsing of all_reduce_perf output."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import NCCL_TESTS_OUTPUT

from nccltune.cli import main
from nccltune.errors import EXIT_CONFIG
from nccltune.trials import nccltests

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
