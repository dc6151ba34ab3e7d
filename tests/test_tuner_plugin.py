"""nccltune's NCCL tuner plugin, built with the system C compiler and driven through ctypes as NCCL drives it.

Every test runs twice: against the normal build, and (test_same_tests_under_sanitizers) in a child
pytest against a build with -fsanitize=address,undefined whose runtime is preloaded; that child also
runs test_tuner_table.py, whose C/Python agreement cases feed the C parser hundreds of bad tables.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest
from tuner_harness import (
    FLAG_INIT,
    FLAG_TUNING,
    IGNORE,
    LIB_ENV,
    LOG_INFO,
    LOG_WARN,
    Comm,
    ConstantsV5,
    ConstantsV7,
    NcclHost,
    TunerV5,
    TunerV6,
    compile_host,
    cost_table,
    filled_constants,
    init,
    load,
    load_v7,
    table_env,
)

from nccltune.tuner.build import BASE_FLAGS, LIBRARY_NAME, build_plugin, find_compiler, source_dir
from nccltune.tuner.table import ALGORITHMS, MAX_ENTRIES, PROTOCOLS, TableEntry, TunerTable, render_table

FP = "0123456789abcdef"
SANITIZED_ENV = "NCCLTUNE_TEST_TUNER_SANITIZED"
KIB = 1024
MIB = 1024 * KIB

@pytest.fixture(scope="module")
def lib_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get(LIB_ENV)
    if given:
        return Path(given)
    result = build_plugin(tmp_path_factory.mktemp("tuner"))  # CI has a C compiler: no compiler is a failure
    assert result.ok, result.message
    assert result.path is not None
    return result.path


@pytest.fixture(scope="module")
def plugins(lib_path: Path) -> tuple[ctypes.CDLL, TunerV5, TunerV6]:
    return load(lib_path)


@pytest.fixture(scope="module")
def v5(plugins: tuple[ctypes.CDLL, TunerV5, TunerV6]) -> TunerV5:
    return plugins[1]


def entry(coll: str = "allreduce", lo: int = 0, hi: int = MIB, nodes: int = 1, ranks: int = 2, rpn: int = 2,
          algo: str = "ring", proto: str = "ll128", channels: int = 16, nccl: str = "2.28.9") -> TableEntry:
    return TableEntry(coll, lo, hi, nodes, ranks, rpn, algo, proto, channels, nccl)


def write_table(path: Path, *entries: TableEntry, fingerprint: str = FP) -> Path:
    path.write_text(render_table(TunerTable(fingerprint, tuple(entries))), encoding="ascii")
    return path


class MakeComm(Protocol):
    def __call__(self, *entries: TableEntry, ranks: int = 2, nodes: int = 1,
                 nvl: tuple[int, int, int] | None = (1, 2, 2), name: str = "table.txt") -> Comm: ...


@pytest.fixture
def comm_with(v5: TunerV5, tmp_path: Path) -> Iterator[MakeComm]:
    """Factory: a communicator whose plugin read a table of these entries; finalized after the test."""
    made: list[Comm] = []

    def make(*entries: TableEntry, ranks: int = 2, nodes: int = 1, nvl: tuple[int, int, int] | None = (1, 2, 2),
             name: str = "table.txt") -> Comm:
        path = write_table(tmp_path / name, *entries)
        with table_env(path, FP):
            c = init(v5, ranks, nodes, nvl)
        made.append(c)
        return c

    yield make
    for c in made:
        assert c.finalize() == 0


def cell(table: list[list[float]], algo: str, proto: str) -> float:
    return table[ALGORITHMS.index(algo)][PROTOCOLS.index(proto)]


def assert_untouched(result: tuple[int, list[list[float]], list[list[float]], int], channels_in: int = 0) -> None:
    rc, before, after, nch = result
    assert rc == 0
    assert after == before
    assert nch == channels_in


def assert_chose(result: tuple[int, list[list[float]], list[list[float]], int], algo: str, proto: str,
                 channels: int) -> None:
    """Exactly the chosen cell became 0.0 and nChannels is what the entry says."""
    rc, before, after, nch = result
    assert rc == 0
    assert cell(after, algo, proto) == 0.0
    changed = [(a, p) for a in range(len(ALGORITHMS)) for p in range(len(PROTOCOLS)) if before[a][p] != after[a][p]]
    assert changed == [(ALGORITHMS.index(algo), PROTOCOLS.index(proto))]
    assert nch == channels


# ---- exports and build ---------------------------------------------------------------------------------------


def test_exports_v5_and_v6_with_the_same_entry_points(plugins: tuple[ctypes.CDLL, TunerV5, TunerV6]) -> None:
    _, p5, p6 = plugins
    assert p5.name == b"nccltune" and p6.name == b"nccltune"
    assert p6.getChunkSize is None  # NCCL keeps its own chunk size
    for fn in ("init", "getCollInfo", "finalize"):
        a = ctypes.cast(getattr(p5, fn), ctypes.c_void_p).value
        b = ctypes.cast(getattr(p6, fn), ctypes.c_void_p).value
        assert a and a == b


def test_exports_v7_with_v6s_functions(plugins: tuple[ctypes.CDLL, TunerV5, TunerV6]) -> None:
    lib, _, p6 = plugins
    p7 = load_v7(lib)
    assert p7.name == b"nccltune" and p7.getChunkSize is None
    for fn in ("getCollInfo", "finalize"):
        address = ctypes.cast(getattr(p7, fn), ctypes.c_void_p).value
        assert address and address == ctypes.cast(getattr(p6, fn), ctypes.c_void_p).value


def test_v7_constants_layout_has_a_fifth_compute_capability_row() -> None:
    """tuner_v7.h (NCCL 2.32.6): 5 compute-capability rows of 3 scales in each of 5 bandwidth tables,
    after the same latency tables: 5 x 3 doubles more than v5's struct."""
    assert ctypes.sizeof(ConstantsV7) - ctypes.sizeof(ConstantsV5) == 5 * 3 * ctypes.sizeof(ctypes.c_double)
    assert ctypes.sizeof(ConstantsV7) == (7 * 3 + 3 * 7 * 3 + 5 * 5 * 3) * 8


def test_v7_applies_the_table_and_leaves_ncclss_constants_alone(plugins: tuple[ctypes.CDLL, TunerV5, TunerV6],
                                                                tmp_path: Path) -> None:
    p7 = load_v7(plugins[0])
    constants = filled_constants(ConstantsV7)
    before = bytes(constants)
    path = write_table(tmp_path / "t.txt", entry(lo=0, hi=MIB, ranks=2, rpn=2, algo="ring", proto="ll128", channels=16))
    with table_env(path, FP):
        c = init(p7, 2, 1, (1, 2, 2), constants=constants)
    assert c.init_rc == 0
    assert_chose(c.call("allreduce", 4 * KIB), "ring", "ll128", 16)
    assert_untouched(c.call("allreduce", 2 * MIB))  # outside the table: NCCL decides
    assert c.finalize() == 0
    assert bytes(constants) == before  # NCCL's model is never changed, in either layout


@pytest.mark.skipif(bool(os.environ.get(LIB_ENV)), reason="checked in the parent run")
def test_source_builds_warning_free_with_werror(tmp_path: Path) -> None:
    cc = find_compiler()
    assert cc is not None
    out = tmp_path / "strict.so"
    proc = subprocess.run([cc, *BASE_FLAGS, "-Werror", "-o", str(out), str(source_dir() / "nccltune_tuner.c")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # Needs no CUDA and no NCCL: nothing beyond the C library is linked.
    needed = subprocess.run(["readelf", "-d", str(out)], capture_output=True, text=True, check=False).stdout
    if needed:
        libs = [line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line]
        assert all(lib.startswith("libc.so") for lib in libs), libs


@pytest.mark.skipif(bool(os.environ.get(LIB_ENV)), reason="checked in the parent run")
def test_build_replaces_the_library_atomically_and_reports(tmp_path: Path) -> None:
    first = build_plugin(tmp_path)
    assert first.ok and first.path == tmp_path / LIBRARY_NAME and first.warnings == ""
    inode = first.path.stat().st_ino
    second = build_plugin(tmp_path)
    assert second.ok and second.path is not None
    assert second.path.stat().st_ino != inode  # a new file renamed over the old, never rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == [LIBRARY_NAME]  # no temporary left behind
    assert "built" in second.message


@pytest.mark.skipif(bool(os.environ.get(LIB_ENV)), reason="checked in the parent run")
def test_no_compiler_gives_a_result_not_an_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = build_plugin(tmp_path / "out")
    assert not result.ok and result.path is None
    assert result.message.startswith("per-size tuner table not active: no C compiler on PATH")
    named = build_plugin(tmp_path / "out", cc="no-such-cc")
    assert not named.ok and "no-such-cc" in (named.reason or "")
    assert not (tmp_path / "out" / LIBRARY_NAME).exists()


@pytest.mark.skipif(bool(os.environ.get(LIB_ENV)), reason="checked in the parent run")
def test_failed_compile_gives_a_result_and_leaves_no_file(tmp_path: Path) -> None:
    fake = tmp_path / "failing-cc"
    fake.write_text("#!/bin/sh\necho 'error: this compiler refuses' >&2\nexit 1\n")
    fake.chmod(0o755)
    result = build_plugin(tmp_path / "out", cc=str(fake))
    assert not result.ok and "refuses" in (result.reason or "")
    assert list((tmp_path / "out").iterdir()) == []


# ---- choices: shape, size edges, unavailable cells -----------------------------------------------------------


def test_matching_shape_marks_exactly_the_chosen_cell(comm_with: MakeComm) -> None:
    c = comm_with(entry())
    assert_chose(c.call("allreduce", 4 * KIB), "ring", "ll128", 16)
    assert [line.level for line in c.lines] == [LOG_INFO]
    assert "using table" in c.lines[0].message and FP in c.lines[0].message


@pytest.mark.parametrize(("ranks", "nodes", "nvl"), [
    (4, 2, (2, 2, 2)),  # nNodes differs
    (4, 1, (1, 4, 4)),  # nRanks differs
    (2, 2, (2, 1, 1)),  # same nRanks, other split
    (3, 1, (1, 3, 3)),
])
def test_any_other_shape_is_left_to_nccl(comm_with: MakeComm, ranks: int, nodes: int,
                                         nvl: tuple[int, int, int]) -> None:
    c = comm_with(entry(), ranks=ranks, nodes=nodes, nvl=nvl)
    assert_untouched(c.call("allreduce", 4 * KIB))
    assert_untouched(c.call("allreduce", 4 * KIB, channels_in=5), channels_in=5)


def test_ranks_per_node_from_nvl_info_or_from_the_counts(comm_with: MakeComm) -> None:
    e = entry(nodes=2, ranks=4, rpn=2, algo="tree", proto="simple", channels=8)
    assert_chose(comm_with(e, ranks=4, nodes=2, nvl=(2, 2, 2), name="a").call("allreduce", 1), "tree", "simple", 8)
    assert_chose(comm_with(e, ranks=4, nodes=2, nvl=None, name="b").call("allreduce", 1), "tree", "simple", 8)
    # NVL info that is all zero is "not given" as well.
    assert_chose(comm_with(e, ranks=4, nodes=2, nvl=(0, 0, 0), name="c").call("allreduce", 1), "tree", "simple", 8)


@pytest.mark.parametrize(("ranks", "nodes", "nvl"), [
    (4, 2, (2, 1, 3)),  # 1 + 3: same counts as the entry, uneven layout
    (5, 2, None),       # 5 ranks on 2 nodes cannot be even
    (4, 2, (2, 4, 4)),  # NVL info that contradicts the counts
])
def test_uneven_or_inconsistent_layout_never_matches(comm_with: MakeComm, ranks: int, nodes: int,
                                                     nvl: tuple[int, int, int] | None) -> None:
    entries = [entry(nodes=2, ranks=4, rpn=2), entry(nodes=2, ranks=6, rpn=3)]
    c = comm_with(*entries, ranks=ranks, nodes=nodes, nvl=nvl)
    assert_untouched(c.call("allreduce", 4 * KIB))
    assert [line.level for line in c.lines] == [LOG_INFO]


@pytest.mark.parametrize(("n_bytes", "applies"), [
    (1023, False), (1024, True), (1500, True), (2048, True), (2049, False), (0, False), (2**64 - 1, False),
])
def test_size_range_edges_are_inclusive(comm_with: MakeComm, n_bytes: int, applies: bool) -> None:
    c = comm_with(entry(lo=1024, hi=2048, algo="tree", proto="ll", channels=4))
    result = c.call("allreduce", n_bytes)
    if applies:
        assert_chose(result, "tree", "ll", 4)
    else:
        assert_untouched(result)


def test_full_byte_range_reaches_the_largest_size(comm_with: MakeComm) -> None:
    c = comm_with(entry(lo=0, hi=2**64 - 1, channels=0))
    assert_chose(c.call("allreduce", 2**64 - 1), "ring", "ll128", 0)
    assert_chose(c.call("allreduce", 0), "ring", "ll128", 0)


def test_unavailable_cell_is_never_written(comm_with: MakeComm) -> None:
    c = comm_with(entry())
    ignored = cost_table(ignore=(("ring", "ll128"), ("tree", "ll")))
    rc, before, after, nch = c.call("allreduce", 4 * KIB, table=ignored)
    assert rc == 0 and after == before and nch == 0
    assert cell(after, "ring", "ll128") == IGNORE


def test_cell_outside_the_table_size_is_left_alone(comm_with: MakeComm) -> None:
    c = comm_with(entry(algo="pat", proto="simple"))
    assert_untouched(c.call("allreduce", 4 * KIB, num_algo=6))  # PAT is index 6
    assert_untouched(c.call("allreduce", 4 * KIB, num_proto=2))  # another row width: layout unknown
    assert_untouched(c.call("allreduce", 4 * KIB, num_algo=0))
    assert_chose(c.call("allreduce", 4 * KIB), "pat", "simple", 16)


def test_channels_zero_leaves_the_count_to_nccl(comm_with: MakeComm) -> None:
    c = comm_with(entry(channels=0))
    assert_chose(c.call("allreduce", 4 * KIB), "ring", "ll128", 0)
    rc, _, _, nch = c.call("allreduce", 4 * KIB, channels_in=7)
    assert rc == 0 and nch == 7


def test_unmatched_calls_set_no_channel_count_and_write_no_cell(comm_with: MakeComm) -> None:
    c = comm_with(entry(), entry(coll="allgather", lo=MIB + 1, hi=2 * MIB, algo="pat", proto="simple"))
    assert_untouched(c.call("allgather", 4 * KIB))  # collective has entries, size does not
    assert_untouched(c.call("broadcast", 4 * KIB))  # collective without entries
    assert_untouched(c.call("allreduce", MIB + 1, channels_in=3), channels_in=3)
    for bad in (5, 6, -1, 1000):  # send/recv and beyond are not tuned here
        assert_untouched(c.call("allreduce", 4 * KIB, coll_index=bad))
    assert_chose(c.call("allgather", MIB + 1), "pat", "simple", 16)


def test_first_matching_shape_wins_among_entries_of_other_shapes(comm_with: MakeComm) -> None:
    entries = [entry(nodes=1, ranks=4, rpn=4, algo="tree", proto="ll"),
               entry(nodes=1, ranks=2, rpn=2, algo="nvls", proto="simple", channels=2),
               entry(nodes=2, ranks=2, rpn=1, algo="collnet_chain", proto="ll")]
    c = comm_with(*entries)
    assert_chose(c.call("allreduce", 100), "nvls", "simple", 2)


def test_null_pointers_from_the_caller_are_survived(v5: TunerV5, comm_with: MakeComm) -> None:
    c = comm_with(entry())
    rc, _, after, _ = c.call("allreduce", 4 * KIB, null_channels=True)
    assert rc == 0 and cell(after, "ring", "ll128") == 0.0
    assert_untouched(c.call("allreduce", 4 * KIB, null_table=True))
    assert v5.finalize(None) == 0
    assert v5.getCollInfo(None, 4, 4096, 1, None, 7, 3, 0, None) == 0


def test_no_logger_and_no_nvl_info(v5: TunerV5, tmp_path: Path) -> None:
    path = write_table(tmp_path / "t", entry(nodes=1, ranks=2, rpn=2))
    # Without a logger the plugin cannot find the NCCL that loaded it (loaded RTLD_LOCAL, outside the
    # global scope), so it cannot tell which section applies: it defers, silently (no logger).
    with table_env(path, FP):
        c = init(v5, 2, 1, None, with_logger=False)
    assert c.init_rc == 0 and c.ctx.value and c.lines == []
    assert_untouched(c.call("allreduce", 1))
    with table_env(tmp_path / "missing", FP):
        quiet = init(v5, 2, 1, None, with_logger=False)
    assert quiet.init_rc == 0 and quiet.lines == []
    assert c.finalize() == 0 and quiet.finalize() == 0


# ---- the running NCCL's version picks the section ------------------------------------------------------------

TWO_SECTIONS = (entry(lo=0, hi=MIB, algo="ring", proto="ll128", channels=16, nccl="2.28.9"),
                entry(lo=0, hi=MIB, algo="tree", proto="simple", channels=0, nccl="2.27.7"))


@pytest.mark.parametrize(("nccl", "chosen"), [("2.28.9", ("ring", "ll128", 16)), ("2.27.7", ("tree", "simple", 0)),
                                              ("2.31.0", None)])
def test_two_sections_three_versions(v5: TunerV5, tmp_path: Path, nccl: str,
                                     chosen: tuple[str, str, int] | None) -> None:
    path = write_table(tmp_path / "t", *TWO_SECTIONS)
    with table_env(path, FP):
        c = init(v5, 2, 1, (1, 2, 2), nccl=nccl)
    assert c.init_rc == 0 and len(c.lines) == 1 and c.lines[0].level == LOG_INFO
    if chosen is None:
        assert c.lines[0].message == (f"nccltune tuner: table {path} has no section for NCCL {nccl} (sections: "
                                      "2.28.9, 2.27.7); deferring to NCCL")
        assert_untouched(c.call("allreduce", 4 * KIB))
    else:
        assert f"using table {path} (NCCL {nccl} section, 1 entries" in c.lines[0].message
        assert_chose(c.call("allreduce", 4 * KIB), *chosen)
        assert_untouched(c.call("allreduce", 2 * MIB))  # past the section's range: no other section's entry
    assert c.finalize() == 0


def test_a_patch_release_is_another_version(v5: TunerV5, tmp_path: Path) -> None:
    path = write_table(tmp_path / "t", *TWO_SECTIONS)
    with table_env(path, FP):
        c = init(v5, 2, 1, (1, 2, 2), nccl="2.28.7")
    assert "has no section for NCCL 2.28.7" in c.lines[0].message
    assert_untouched(c.call("allreduce", 4 * KIB))
    assert c.finalize() == 0


def test_version_unknown_defers_with_one_line(v5: TunerV5, tmp_path: Path) -> None:
    path = write_table(tmp_path / "t", *TWO_SECTIONS)
    with table_env(path, FP):
        c = init(v5, 2, 1, (1, 2, 2), nccl=None)  # the host's ncclGetVersion fails
    assert len(c.lines) == 1 and c.lines[0].level == LOG_INFO
    assert "is valid, but the running NCCL's version is unknown" in c.lines[0].message
    assert "deferring to NCCL" in c.lines[0].message
    assert_untouched(c.call("allreduce", 4 * KIB))
    assert c.finalize() == 0


def test_the_version_comes_from_the_library_the_logger_lives_in(v5: TunerV5, tmp_path: Path) -> None:
    # Two NCCLs in one process: one in the global scope saying 2.27.7, and the RTLD_LOCAL one that
    # calls init saying 2.28.9. The caller's wins; without a logger the global one answers.
    global_host = NcclHost(compile_host(tmp_path, "libnccl-global.so"), global_scope=True)
    global_host.set_version("2.27.7")
    path = write_table(tmp_path / "t", *TWO_SECTIONS)
    with table_env(path, FP):
        local = init(v5, 2, 1, (1, 2, 2), nccl="2.28.9")
        fallback = init(v5, 2, 1, (1, 2, 2), with_logger=False)
    assert "NCCL 2.28.9 section" in local.lines[0].message
    assert_chose(local.call("allreduce", 4 * KIB), "ring", "ll128", 16)
    assert_chose(fallback.call("allreduce", 4 * KIB), "tree", "simple", 0)
    assert local.finalize() == 0 and fallback.finalize() == 0
    global_host.set_version(None)  # it stays loaded for the rest of this process: make it answer nothing


# ---- table problems: one line, then defer ---------------------------------------------------------------------

GOOD = entry(lo=0, hi=2**40)


def _problem(v5: TunerV5, path: Path | str | None, fingerprint: str | None = FP) -> Comm:
    with table_env(path, fingerprint):
        c = init(v5, 2, 1, (1, 2, 2))
    assert c.init_rc == 0  # a table problem never fails the communicator
    assert c.ctx.value  # a context exists, and it defers
    assert len(c.lines) == 1, [line.message for line in c.lines]
    assert c.lines[0].fmt == "%s"
    assert c.lines[0].flags & FLAG_INIT and c.lines[0].flags & FLAG_TUNING
    assert c.lines[0].message.startswith("nccltune tuner: ") and "deferring to NCCL" in c.lines[0].message
    for n_bytes in (0, 4 * KIB, 2**40):
        assert_untouched(c.call("allreduce", n_bytes))
    assert c.finalize() == 0
    return c


def test_no_table_variable(v5: TunerV5) -> None:
    c = _problem(v5, None)
    assert c.lines[0].level == LOG_INFO and "NCCLTUNE_TUNER_TABLE is not set" in c.lines[0].message
    assert _problem(v5, "").lines[0].level == LOG_INFO


def test_missing_table_file(v5: TunerV5, tmp_path: Path) -> None:
    c = _problem(v5, tmp_path / "absent.txt")
    assert c.lines[0].level == LOG_INFO
    assert f"no table at {tmp_path / 'absent.txt'}" in c.lines[0].message


def test_directory_instead_of_a_table(v5: TunerV5, tmp_path: Path) -> None:
    c = _problem(v5, tmp_path)
    assert c.lines[0].level == LOG_WARN and "unreadable (not a regular file)" in c.lines[0].message


def test_fifo_instead_of_a_table_does_not_block(v5: TunerV5, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in _problem(v5, fifo).lines[0].message


def test_path_through_a_file_is_unreadable(v5: TunerV5, tmp_path: Path) -> None:
    path = write_table(tmp_path / "t", GOOD) / "child"
    c = _problem(v5, path)
    assert c.lines[0].level == LOG_WARN and "unreadable (cannot open: Not a directory)" in c.lines[0].message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_table(v5: TunerV5, tmp_path: Path) -> None:
    path = write_table(tmp_path / "t", GOOD)
    path.chmod(0)
    c = _problem(v5, path)
    assert c.lines[0].level == LOG_WARN and "Permission denied" in c.lines[0].message


def test_malformed_table_names_the_line(v5: TunerV5, tmp_path: Path) -> None:
    path = tmp_path / "t"
    text = render_table(TunerTable(FP, (GOOD, entry(coll="allgather")))).replace("allgather 0", "allgather x")
    path.write_text(text)
    c = _problem(v5, path)
    assert c.lines[0].level == LOG_WARN
    assert f"{path}:6 is malformed (min_bytes 'x' is not a byte count)" in c.lines[0].message


def test_one_bad_entry_discards_the_whole_table(v5: TunerV5, tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text(render_table(TunerTable(FP, (GOOD,))).replace("end 1", "allreduce 1 2 1 2 2 ring warp 0\nend 2"))
    assert "unknown protocol 'warp'" in _problem(v5, path).lines[0].message  # GOOD is not applied either


def test_truncated_table(v5: TunerV5, tmp_path: Path) -> None:
    full = render_table(TunerTable(FP, (GOOD, entry(coll="reduce"))))
    cut_at_line = tmp_path / "line"
    cut_at_line.write_text(full[: full.index("\nreduce") + 1])  # whole lines, but no end record
    assert "truncated: no 'end' line" in _problem(v5, cut_at_line).lines[0].message
    cut_mid = tmp_path / "mid"
    cut_mid.write_text(full[: full.index("\nreduce") + 10])
    assert "truncated: the file does not end with a newline" in _problem(v5, cut_mid).lines[0].message
    empty = tmp_path / "empty"
    empty.write_text("")
    assert f"{empty}:1 is malformed (truncated" in _problem(v5, empty).lines[0].message


def test_huge_table(v5: TunerV5, tmp_path: Path) -> None:
    path = tmp_path / "huge"
    path.write_text(render_table(TunerTable(FP, (GOOD,))) + "#" * 100 + "\n" + ("# padding\n" * 110_000))
    c = _problem(v5, path)
    assert c.lines[0].level == LOG_WARN and "is malformed (larger than 1048576 bytes)" in c.lines[0].message


def test_too_many_entries(v5: TunerV5, tmp_path: Path) -> None:
    entries = [entry(lo=i, hi=i) for i in range(MAX_ENTRIES)]
    text = render_table(TunerTable(FP, tuple(entries)))
    text = text.replace(f"end {MAX_ENTRIES}", f"allreduce {MAX_ENTRIES} {MAX_ENTRIES} 1 2 2 ring ll 0\n"
                        f"end {MAX_ENTRIES + 1}")
    path = tmp_path / "many"
    path.write_text(text)
    assert f"more than {MAX_ENTRIES} entries" in _problem(v5, path).lines[0].message
    # At the limit the table is fine.
    ok = write_table(tmp_path / "ok", *entries)
    with table_env(ok, FP):
        c = init(v5, 2, 1, (1, 2, 2))
    assert_chose(c.call("allreduce", MAX_ENTRIES - 1), "ring", "ll128", 16)
    assert c.finalize() == 0


def test_stale_fingerprint(v5: TunerV5, tmp_path: Path) -> None:
    path = write_table(tmp_path / "t", GOOD)
    c = _problem(v5, path, fingerprint="fedcba9876543210")
    assert c.lines[0].level == LOG_WARN
    assert f"is stale (fingerprint {FP}, this node expects fedcba9876543210)" in c.lines[0].message


def test_no_expected_fingerprint_means_not_applied(v5: TunerV5, tmp_path: Path) -> None:
    c = _problem(v5, write_table(tmp_path / "t", GOOD), fingerprint=None)
    assert c.lines[0].level == LOG_WARN and "NCCLTUNE_TUNER_FINGERPRINT is not set" in c.lines[0].message


def test_wrong_format_version(v5: TunerV5, tmp_path: Path) -> None:
    path = tmp_path / "t"
    for other in ("1", "3"):  # version 1 had no NCCL sections: never applied as if it were for any NCCL
        path.write_text(render_table(TunerTable(FP, (GOOD,))).replace("nccltune-tuner-table 2",
                                                                      f"nccltune-tuner-table {other}"))
        c = _problem(v5, path)
        assert c.lines[0].level == LOG_WARN
        assert f"{path}:1 is of another format version (format version {other}, this plugin reads version 2)" in \
            c.lines[0].message


def test_one_rank_communicator_defers_with_one_line(v5: TunerV5, tmp_path: Path) -> None:
    path = write_table(tmp_path / "t", entry(nodes=1, ranks=1, rpn=1, algo="ring", proto="simple"))
    with table_env(path, FP):
        c = init(v5, 1, 1, (1, 1, 1))
    assert c.init_rc == 0 and len(c.lines) == 1 and c.lines[0].level == LOG_INFO
    assert "one-rank communicator, deferring to NCCL" in c.lines[0].message
    assert_untouched(c.call("allreduce", 4 * KIB))
    assert c.finalize() == 0


# ---- several communicators, determinism ----------------------------------------------------------------------


def test_two_contexts_with_different_tables_at_once(v5: TunerV5, tmp_path: Path) -> None:
    a_path = write_table(tmp_path / "a", entry(algo="ring", proto="ll", channels=4))
    b_path = write_table(tmp_path / "b", entry(algo="tree", proto="simple", channels=12),
                         fingerprint="abcdef0123456789")
    with table_env(a_path, FP):
        a = init(v5, 2, 1, (1, 2, 2))
    with table_env(b_path, "abcdef0123456789"):
        b = init(v5, 2, 1, (1, 2, 2))
    with table_env(None, None):
        c = init(v5, 2, 1, (1, 2, 2))
    for _ in range(2):  # interleaved calls: no context sees another's table
        assert_chose(a.call("allreduce", 64), "ring", "ll", 4)
        assert_chose(b.call("allreduce", 64), "tree", "simple", 12)
        assert_untouched(c.call("allreduce", 64))
    assert a.finalize() == 0
    assert_chose(b.call("allreduce", 64), "tree", "simple", 12)  # finalizing one leaves the other intact
    assert b.finalize() == 0 and c.finalize() == 0


def test_same_inputs_give_the_same_outputs(v5: TunerV5, tmp_path: Path) -> None:
    entries = [entry(lo=0, hi=MIB - 1, algo="ring", proto="ll128", channels=8),
               entry(lo=MIB, hi=64 * MIB, algo="ring", proto="simple", channels=32),
               entry(coll="allgather", lo=0, hi=64 * MIB, algo="pat", proto="simple", channels=0)]
    path = write_table(tmp_path / "t", *entries)
    sizes = [0, 1, 4 * KIB, MIB - 1, MIB, 64 * MIB, 64 * MIB + 1]
    outputs = []
    for _ in range(3):  # three "ranks" of one communicator, each with its own context
        with table_env(path, FP):
            rank = init(v5, 2, 1, (1, 2, 2))
        outputs.append([rank.call(coll, n) for coll in ("allreduce", "allgather", "reduce") for n in sizes])
        outputs.append([rank.call(coll, n) for coll in ("allreduce", "allgather", "reduce") for n in sizes])
        assert rank.finalize() == 0
    assert all(o == outputs[0] for o in outputs)
    assert sum(1 for _, before, after, _ in outputs[0] if before != after) == 12  # the rules did apply


# ---- the same tests against a sanitizer build ----------------------------------------------------------------


def test_sanitizer_runtime_is_loaded_when_asked() -> None:
    if not os.environ.get(SANITIZED_ENV):
        pytest.skip("only in the sanitizer run")
    process = ctypes.CDLL(None)
    assert hasattr(process, "__asan_init") and hasattr(process, "__ubsan_handle_add_overflow")


def _sanitizer_runtime(cc: str) -> list[str]:
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=False).stdout
        path = out.strip()
        if not path or not os.path.isabs(path) or not os.path.exists(path):
            return []
        libs.append(os.path.realpath(path))
    return libs


def _sanitized_env(libs: list[str], lib: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"LD_PRELOAD": ":".join(libs), "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
                "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1", LIB_ENV: str(lib), SANITIZED_ENV: "1",
                "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])})
    return env


@pytest.mark.skipif(bool(os.environ.get(LIB_ENV)), reason="this is the sanitizer run")
def test_same_tests_under_sanitizers(tmp_path: Path) -> None:
    cc = find_compiler()
    assert cc is not None
    libs = _sanitizer_runtime(cc)
    if not libs:
        pytest.skip(f"{cc} has no libasan/libubsan runtime installed")
    result = build_plugin(tmp_path / "asan", sanitize=True)
    assert result.ok, result.message
    assert result.path is not None and "-fsanitize=address,undefined" in result.command
    env = _sanitized_env(libs, result.path)

    # First show that this harness does catch a fault in a library loaded this way.
    bad_src = tmp_path / "bad.c"
    bad_src.write_text("#include <stdlib.h>\nint bad(int i) { int *a = malloc(4 * sizeof *a); int v = a[i];"
                       " free(a); return v; }\n")
    bad_so = tmp_path / "bad.so"
    subprocess.run([cc, "-shared", "-fPIC", "-g", "-fsanitize=address,undefined", "-o", str(bad_so), str(bad_src)],
                   check=True)
    probe = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(bad_so)!r}).bad(4)"],
                           env=env, capture_output=True, text=True, check=False, timeout=120)
    assert probe.returncode != 0 and "heap-buffer-overflow" in probe.stderr, probe.stderr[-2000:]

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", __file__,
                           str(Path(__file__).with_name("test_tuner_table.py"))],
                          env=env, capture_output=True, text=True, check=False, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-6000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
    assert "only in the sanitizer run" not in proc.stdout  # the child did run with the runtime preloaded


def test_a_shipped_library_is_not_required(tmp_path: Path) -> None:
    """The C source and header ship as package data next to this package, not as a prebuilt binary."""
    src = source_dir()
    assert (src / "nccltune_tuner.c").is_file() and (src / "nccltune_tuner.h").is_file()
    assert not list(src.glob("*.so"))
