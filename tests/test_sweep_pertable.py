"""The per-size choice from synthetic measurements, the table it renders, and that table in the C plugin."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tuner_harness import cost_table, init, load, table_env

from nccltune.records import Measurement
from nccltune.sweep.pertable import (
    NOT_STEERED,
    STEERED,
    CollectiveInput,
    Measured,
    Seen,
    SizeCandidate,
    TableChoice,
    algo_proto_candidates,
    candidate_of_env,
    channel_candidates,
    choose_per_size,
    choose_table,
    per_size_candidates,
    size_ranges,
    spans,
    table_inputs,
    to_table,
)
from nccltune.sweep.select import SizeStats
from nccltune.tuner.build import build_plugin
from nccltune.tuner.table import ALGORITHMS, COLLECTIVES, PROTOCOLS, parse_table, render_table

KIB, MIB = 1024, 1024 * 1024
SIZES = [64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB]
FP = "00112233445566778899aabbccddeeff"


def stats(values: dict[int, float], noise_pct: float = 1.0, n: int = 3) -> dict[int, SizeStats]:
    """Per size a median with a spread of +-noise_pct around it."""
    return {s: SizeStats(s, v, v * (1 - noise_pct / 100), v * (1 + noise_pct / 100), n) for s, v in values.items()}


BASE = stats({s: 100.0 for s in SIZES})
DEFAULT_USED = {s: Seen("ring", "ll" if s < MIB else "simple") for s in SIZES}


def choose(*measured: Measured, default_channels: int | None = 16,
           default_used: dict[int, Seen] | None = None) -> object:
    return choose_per_size(BASE, measured, default_used=DEFAULT_USED if default_used is None else default_used,
                           default_channels=default_channels, min_gain_pct=1.0, max_regression_pct=2.0)


def test_a_candidate_that_wins_only_at_small_sizes_gives_entries_only_there() -> None:
    tree_ll = SizeCandidate("tree", "ll")
    m = Measured(tree_ll, stats({64 * KIB: 120.0, 256 * KIB: 115.0, MIB: 100.0, 4 * MIB: 80.0, 16 * MIB: 60.0},
                                noise_pct=0.0, n=1))
    c = choose_per_size(BASE, [m], default_used=DEFAULT_USED, default_channels=16, min_gain_pct=1.0,
                        max_regression_pct=2.0)
    assert set(c.wins) == {64 * KIB, 256 * KIB}
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")
    assert len(table.entries) == 1  # the two small sizes merge
    e = table.entries[0]
    assert (e.algo, e.proto, e.channels) == ("tree", "ll", 0)
    assert (e.nnodes, e.nranks, e.ranks_per_node) == (1, 2, 2)
    assert e.min_bytes == 64 * KIB
    assert e.max_bytes == math.isqrt(256 * KIB * MIB) - 1  # split at the geometric midpoint
    assert c.single_node_env == {}


def test_a_gain_within_the_noise_gives_no_entry() -> None:
    # 3% better, but the defaults vary by +-2% and the candidate by +-2% there: within the bar.
    noisy_base = stats({s: 100.0 for s in SIZES}, noise_pct=2.0)
    m = Measured(SizeCandidate("ring", "ll"), stats({s: 103.0 for s in SIZES}, noise_pct=2.0))
    c = choose_per_size(noisy_base, [m], default_used=DEFAULT_USED, default_channels=16, min_gain_pct=1.0,
                        max_regression_pct=2.0)
    assert c.wins == {}
    assert to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9").entries == ()


def test_adjacent_equal_choices_merge_and_different_ones_do_not() -> None:
    a = Measured(SizeCandidate("tree", "ll"), stats({64 * KIB: 130.0, 256 * KIB: 130.0, MIB: 90.0, 4 * MIB: 90.0,
                                                     16 * MIB: 130.0}, noise_pct=0.0, n=1))
    b = Measured(SizeCandidate("ring", "ll128"), stats({64 * KIB: 90.0, 256 * KIB: 90.0, MIB: 120.0, 4 * MIB: 120.0,
                                                        16 * MIB: 90.0}, noise_pct=0.0, n=1))
    c = choose_per_size(BASE, [a, b], default_used=DEFAULT_USED, default_channels=16, min_gain_pct=1.0,
                        max_regression_pct=2.0)
    got = [(sp.sizes, sp.cell.algo, sp.cell.proto) for sp in spans(c)]
    assert got == [((64 * KIB, 256 * KIB), "tree", "ll"), ((MIB, 4 * MIB), "ring", "ll128"),
                   ((16 * MIB,), "tree", "ll")]
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")
    # Contiguous and non-overlapping: each entry starts where the previous one ended.
    for left, right in zip(table.entries, table.entries[1:], strict=False):
        assert right.min_bytes == left.max_bytes + 1
    assert table.entries[-1].max_bytes == 16 * MIB


def test_size_ranges_split_at_the_geometric_midpoint() -> None:
    r = size_ranges([4 * KIB, 16 * KIB, 64 * KIB])
    assert r[4 * KIB] == (4 * KIB, 8 * KIB - 1)
    assert r[16 * KIB] == (8 * KIB, 32 * KIB - 1)
    assert r[64 * KIB] == (32 * KIB, 64 * KIB)


def test_fewer_channels_go_into_the_table() -> None:
    eight = SizeCandidate(channels=8)
    used = {s: Seen("ring", "ll") for s in SIZES}
    m = Measured(eight, stats({64 * KIB: 110.0, 256 * KIB: 110.0, MIB: 95.0, 4 * MIB: 95.0, 16 * MIB: 95.0},
                              noise_pct=0.0, n=1), used)
    c = choose(m)
    assert c.single_node_env == {}  # type: ignore[attr-defined]
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")  # type: ignore[arg-type]
    assert [(e.algo, e.proto, e.channels) for e in table.entries] == [("ring", "ll", 8)]


def test_more_channels_than_the_defaults_stay_a_single_node_variable() -> None:
    more = SizeCandidate(channels=32)
    used = {s: Seen("ring", "simple") for s in SIZES}
    m = Measured(more, stats({64 * KIB: 95.0, 256 * KIB: 95.0, MIB: 110.0, 4 * MIB: 112.0, 16 * MIB: 100.0},
                             noise_pct=0.0, n=1), used)
    c = choose(m)
    assert c.single_node_env == {"NCCL_MIN_NCHANNELS": "32"}  # type: ignore[attr-defined]
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")  # type: ignore[arg-type]
    # The table never asks for 32 (NCCL would cap it); every size outside the win is held at the defaults'
    # 16 channels with what the defaults used there, and the won sizes are left to NCCL at the raised count.
    assert all(e.channels != 32 for e in table.entries)
    by_size = {s: table.choice("allreduce", s, 1, 2, 2, "2.28.9") for s in SIZES}
    assert by_size[MIB] is None and by_size[4 * MIB] is None  # NCCL with 32 channels, as measured
    for s in (64 * KIB, 256 * KIB, 16 * MIB):
        e = by_size[s]
        assert e is not None and e.channels == 16 and (e.algo, e.proto) == DEFAULT_USED[s][:2]


def test_pinned_counts_are_the_ones_nccls_log_showed_at_that_size() -> None:
    # NCCL used 4 of the defaults' 16 channels at 64 KiB; under a raise the table pins 64 KiB to 4,
    # not 16, since a tuner's count replaces NCCL's own reduction for small messages.
    default_used = {s: Seen("ring", "ll", 4 if s == 64 * KIB else 16) for s in SIZES}
    m = Measured(SizeCandidate(channels=32), stats({64 * KIB: 95.0, 256 * KIB: 95.0, MIB: 120.0, 4 * MIB: 95.0,
                                                    16 * MIB: 95.0}, noise_pct=0.0, n=1))
    c = choose(m, default_used=default_used)
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")  # type: ignore[arg-type]
    got = {s: e.channels for s in SIZES if (e := table.choice("allreduce", s, 1, 2, 2, "2.28.9")) is not None}
    assert got == {64 * KIB: 4, 256 * KIB: 16, 4 * MIB: 16, 16 * MIB: 16}
    # Without a raise, a lower count that won is capped by what NCCL's log showed it used.
    low = Measured(SizeCandidate(channels=8), stats({s: 120.0 for s in SIZES}, noise_pct=0.0, n=1),
                   {s: Seen("ring", "ll", 2 if s == 64 * KIB else 8) for s in SIZES})
    c = choose(low)
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")  # type: ignore[arg-type]
    assert [(e.min_bytes, e.channels) for e in table.entries][:2] == [(64 * KIB, 2), (128 * KIB, 8)]


def test_a_raise_without_the_defaults_log_is_dropped() -> None:
    m = Measured(SizeCandidate(channels=32), stats({s: 120.0 for s in SIZES[:2]} | {s: 90.0 for s in SIZES[2:]},
                                                   noise_pct=0.0, n=1))
    c = choose(m, default_used={})
    assert c.single_node_env == {}  # type: ignore[attr-defined]
    assert c.wins == {}  # type: ignore[attr-defined]
    assert any("raise is not used" in n for n in c.notes)  # type: ignore[attr-defined]


def test_candidates_follow_the_topology() -> None:
    with_ll128, pruned = algo_proto_candidates(ll128=True, nranks=2)
    assert len(with_ll128) == 6
    assert {c.algo for c in with_ll128} == {"ring", "tree"}
    assert {p.what for p in pruned} >= {"nvls", "pat"}
    without, pruned = algo_proto_candidates(ll128=False, nranks=2)
    assert len(without) == 4 and all(c.proto != "ll128" for c in without)
    assert any(p.what == "ll128" for p in pruned)
    assert [c.channels for c in channel_candidates(24)] == [12, 32]  # the 2x H200 node's defaults: 24
    assert [c.channels for c in channel_candidates(16)] == [8, 24]
    assert [c.channels for c in channel_candidates(48)] == [24, 64]
    assert [c.channels for c in channel_candidates(64)] == [32]
    assert channel_candidates(None) == []
    assert SizeCandidate("ring", "ll128", 0).env() == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"}
    assert SizeCandidate(channels=8).env() == {"NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}


def _mixed_choice() -> object:
    a = Measured(SizeCandidate("tree", "ll"), stats({64 * KIB: 130.0, 256 * KIB: 130.0, MIB: 90.0, 4 * MIB: 90.0,
                                                     16 * MIB: 90.0}, noise_pct=0.0, n=1))
    b = Measured(SizeCandidate(channels=8), stats({64 * KIB: 90.0, 256 * KIB: 90.0, MIB: 90.0, 4 * MIB: 90.0,
                                                   16 * MIB: 120.0}, noise_pct=0.0, n=1),
                 {s: Seen("ring", "simple") for s in SIZES})
    return choose(a, b)


def test_the_rendered_table_parses_and_the_plugin_applies_it_per_size(tmp_path: Path) -> None:
    c = _mixed_choice()
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")  # type: ignore[arg-type]
    text = render_table(table)
    assert parse_table(text, "table.txt") == table
    path = tmp_path / "table.txt"
    path.write_text(text, encoding="ascii")
    built = build_plugin(tmp_path / "lib")
    assert built.ok and built.path is not None, built.message
    _lib, v5, _v6 = load(built.path)
    with table_env(path, FP):
        comm = init(v5, 2, 1, (1, 2, 2))
    try:
        expect = {64 * KIB: ("tree", "ll", 0), 256 * KIB: ("tree", "ll", 0), 16 * MIB: ("ring", "simple", 8)}
        for size in SIZES:
            rc, before, after, nch = comm.call("allreduce", size, table=cost_table())
            assert rc == 0
            changed = [(ALGORITHMS[a], PROTOCOLS[p]) for a in range(len(ALGORITHMS)) for p in range(len(PROTOCOLS))
                       if before[a][p] != after[a][p]]
            if size in expect:
                algo, proto, channels = expect[size]
                assert changed == [(algo, proto)], size
                assert nch == channels
            else:
                assert changed == [] and nch == 0, size
        # Another shape (4 ranks) is left to NCCL even at a covered size.
        with table_env(path, FP):
            other = init(v5, 4, 1, (1, 4, 4))
        rc, before, after, nch = other.call("allreduce", 64 * KIB, table=cost_table())
        assert (rc, after == before, nch) == (0, True, 0)
        assert other.finalize() == 0
    finally:
        assert comm.finalize() == 0


@pytest.mark.parametrize("nranks", [2, 8])
def test_the_table_carries_the_node_shape(nranks: int) -> None:
    table = to_table(_mixed_choice(), fingerprint=FP, nranks=nranks)  # type: ignore[arg-type]
    assert {(e.nnodes, e.nranks, e.ranks_per_node) for e in table.entries} == {(1, nranks, nranks)}


def test_the_report_shows_the_entries_and_the_sizes_they_cover() -> None:
    from nccltune.pipeline.tablestage import TableOutcome
    from nccltune.report.sweep import table_lines

    c = _mixed_choice()
    table = to_table(c, fingerprint=FP, nranks=2, nccl="2.28.9")  # type: ignore[arg-type]
    out = TableOutcome("active", c, table, render_table(table), None, spans(c), default_channels=16)  # type: ignore[arg-type]
    lines = table_lines(out)
    assert lines[0] == "Tuner table: active"
    assert "  allreduce  [64KiB, 512KiB) (measured 64KiB, 256KiB): tree/ll" in lines
    assert "  allreduce  [8MiB, 16MiB] (measured 16MiB): ring/simple, 8 channels" in lines
    doc = out.as_dict()
    assert [e["sizes"] for e in doc["entries"]] == [[64 * KIB, 256 * KIB], [16 * MIB]]  # type: ignore[index]
    assert {e["collective"] for e in doc["entries"]} == {"allreduce"}  # type: ignore[index]
    assert doc["published"] is False


# -- every steered collective --------------------------------------------------------------------

TREE_LL128 = SizeCandidate("tree", "ll128", only=("all_reduce",))
RING_LL = SizeCandidate("ring", "ll")
SMALL, LARGE = SIZES[:2], SIZES[2:]


def _inputs(ag: dict[SizeCandidate, dict[int, float]], ar: dict[SizeCandidate, dict[int, float]],
            ag_used: dict[int, Seen] | None = None, ar_used: dict[int, Seen] | None = None,
            used: dict[int, Seen] | None = None) -> dict[str, CollectiveInput]:
    def part(values: dict[SizeCandidate, dict[int, float]], default_used: dict[int, Seen]) -> CollectiveInput:
        return CollectiveInput(BASE, [Measured(c, stats(v, noise_pct=0.0, n=1), used or {}) for c, v in values.items()],
                               default_used)
    return {"all_gather": part(ag, DEFAULT_USED if ag_used is None else ag_used),
            "all_reduce": part(ar, DEFAULT_USED if ar_used is None else ar_used)}


def _table(inputs: dict[str, CollectiveInput], **kw: object) -> TableChoice:
    return choose_table(inputs, default_channels=16, min_gain_pct=1.0, max_regression_pct=2.0, **kw)  # type: ignore[arg-type]


def test_each_collective_gets_its_own_entries_and_tree_never_wins_all_gather() -> None:
    # all_gather: ring/ll wins the small sizes. The Tree trial's all_gather numbers (NCCL's own choice
    # there) look faster still: they are not Tree's, so Tree never wins all_gather.
    ag = {RING_LL: {s: 120.0 if s in SMALL else 95.0 for s in SIZES}, TREE_LL128: {s: 150.0 for s in SIZES},
          SizeCandidate("tree", "ll"): {s: 150.0 for s in SIZES}}
    # all_reduce: tree/ll128 wins the large sizes, ring/ll none.
    ar = {RING_LL: {s: 98.0 for s in SIZES}, TREE_LL128: {s: 125.0 if s in LARGE else 90.0 for s in SIZES}}
    t = _table(_inputs(ag, ar))
    ag_part, ar_part = t.part("all_gather"), t.part("all_reduce")
    assert ag_part is not None and ar_part is not None
    assert {s: w.candidate for s, w in ag_part.wins.items()} == {s: RING_LL for s in SMALL}
    assert {s: w.candidate for s, w in ar_part.wins.items()} == {s: TREE_LL128 for s in LARGE}
    table = to_table(t, fingerprint=FP, nranks=2, nccl="2.28.9")
    got = [(e.collective, e.algo, e.proto, e.min_bytes, e.max_bytes) for e in table.entries]
    # all_gather's range is in NCCL's own byte count, one rank's block: the measured sizes over 2 ranks.
    assert got == [("allgather", "ring", "ll", 64 * KIB // 2, (math.isqrt(256 * KIB * MIB) - 1) // 2),
                   ("allreduce", "tree", "ll128", math.isqrt(256 * KIB * MIB), 16 * MIB)]
    assert all(e.algo != "tree" for e in table.entries if e.collective == "allgather")
    assert parse_table(render_table(table), "t.txt") == table  # per-collective entries the plugin accepts
    assert table.choice("allgather", 64 * KIB // 2, 1, 2, 2, "2.28.9") is not None  # NCCL's count: one rank's block
    assert table.choice("allreduce", 64 * KIB, 1, 2, 2, "2.28.9") is None
    assert t.single_node_env == {}


def test_a_raise_is_used_for_every_collective_or_for_none() -> None:
    raised = SizeCandidate(channels=32)
    # all_reduce: 32 channels win at 1 MiB and 4 MiB; all_gather wins nothing, but its other sizes would
    # change with the communicator's count all the same.
    ar = {raised: {s: 120.0 if s in (MIB, 4 * MIB) else 95.0 for s in SIZES}}
    ag = {raised: {s: 99.0 for s in SIZES}}
    t = _table(_inputs(ag, ar, used={s: Seen("ring", "simple", 32) for s in SIZES}))
    assert t.single_node_env == {"NCCL_MIN_NCHANNELS": "32"}
    table = to_table(t, fingerprint=FP, nranks=2, nccl="2.28.9")
    for s in SIZES:
        e = table.choice("allgather", s // 2, 1, 2, 2, "2.28.9")  # NCCL's count: one rank's block of 2
        assert e is not None and (e.algo, e.proto, e.channels) == (*DEFAULT_USED[s][:2], 16)  # pinned at the defaults
    assert table.choice("allreduce", MIB, 1, 2, 2, "2.28.9") is None  # NCCL at the raised count, as measured
    assert "of every collective" in " ".join(t.notes)
    # NCCL's log did not show what all_gather's defaults used: it cannot be pinned, so nobody gets the raise.
    t = _table(_inputs(ag, ar, ag_used={}, used={s: Seen("ring", "simple", 32) for s in SIZES}))
    assert t.single_node_env == {}
    assert all(not p.wins and not p.cells for p in t.parts)
    note = " ".join(t.notes)
    assert "raise is not used for any collective" in note and "every other size of allgather" in note
    # A decision for jobs of any shape never raises, and says why.
    t = _table(_inputs(ag, ar, used={s: Seen("ring", "simple", 32) for s in SIZES}), allow_raise=False,
               no_raise_reason="not for multi-node jobs")
    assert t.single_node_env == {} and all(not p.wins for p in t.parts)
    assert any(n.endswith("not for multi-node jobs") and "allreduce 1MiB, 4MiB" in n for n in t.notes)


def test_candidates_for_several_collectives_set_tree_for_all_reduce_alone() -> None:
    got = per_size_candidates(["all_reduce", "all_gather"], ll128=True, nranks=2, nccl_version="2.28.9")
    assert got.collectives == ["all_reduce", "all_gather"]
    assert len(got.candidates) == 6  # as many trials as for all_reduce alone
    tree = [c for c in got.candidates if c.algo == "tree"]
    assert [c.env() for c in tree] == [{"NCCL_ALGO": "allreduce:Tree", "NCCL_PROTO": f"allreduce:{p}"}
                                       for p in ("Simple", "LL", "LL128")]
    assert all(c.applies_to("all_reduce") and not c.applies_to("all_gather") for c in tree)
    ring = [c for c in got.candidates if c.algo == "ring"]
    assert ring[0].env() == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    assert all(c.applies_to("all_gather") and c.applies_to("all_reduce") for c in ring)
    assert "allreduce:Tree" in " ".join(got.notes) and "not known" not in " ".join(got.notes)
    # The version unknown: the same syntax, and the plan says what an older NCCL does with it.
    unknown = per_size_candidates(["all_reduce", "all_gather"], ll128=True, nranks=2)
    assert [c.env() for c in unknown.candidates] == [c.env() for c in got.candidates]
    assert "not known when planning" in " ".join(unknown.notes)
    # An NCCL without the syntax: Tree would fail all_gather in the same trial, so it is not measured.
    old = per_size_candidates(["all_reduce", "all_gather"], ll128=True, nranks=2, nccl_version="2.23.4")
    assert {c.algo for c in old.candidates} == {"ring"}
    assert any(p.what == "tree" and "2.24" in p.reason for p in old.pruned)
    # all_reduce the only collective a tuner steers: plain NCCL_ALGO=Tree, as for all_reduce alone.
    for collectives in (["all_reduce"], ["all_to_all", "all_reduce"]):
        alone = per_size_candidates(collectives, ll128=True, nranks=2, nccl_version="2.23.4")
        assert alone.collectives == ["all_reduce"] and len(alone.candidates) == 6 and not alone.notes
        assert SizeCandidate("tree", "ll") in alone.candidates
    fsdp = per_size_candidates(["all_gather", "reduce_scatter"], ll128=False, nranks=2)
    assert [c.label for c in fsdp.candidates] == ["ring/simple", "ring/ll"]
    assert any(p.what == "tree" for p in fsdp.pruned)


def test_all_to_all_and_sendrecv_are_listed_as_not_steered_by_the_tuner() -> None:
    got = per_size_candidates(["all_to_all", "all_reduce", "sendrecv"], ll128=True, nranks=2)
    reasons = {p.what: p.reason for p in got.pruned}
    assert reasons["all_to_all"].startswith("not seen by NCCL's tuner")
    assert reasons["sendrecv"].startswith("not seen by NCCL's tuner")
    none = per_size_candidates(["sendrecv"], ll128=True, nranks=2)
    assert none.collectives == [] and none.candidates == []
    # Every collective nccltune measures is either steered (and in the table, as NCCL spells it) or said not to be.
    from nccltune import collectives

    assert set(STEERED) | set(NOT_STEERED) == set(collectives.NAMES) and not set(STEERED) & set(NOT_STEERED)
    assert {collectives.COLLECTIVES[c].tuner_name for c in STEERED} == set(COLLECTIVES)


@pytest.mark.parametrize("cand", [SizeCandidate("ring", "ll128"), SizeCandidate("tree", "ll", only=("all_reduce",)),
                                  SizeCandidate(channels=24), SizeCandidate("tree", "simple")])
def test_a_trials_environment_gives_its_candidate_back(cand: SizeCandidate) -> None:
    env = {"NCCL_TOPO_FILE": "/x/ncclTopology.xml", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", **cand.env()}
    assert candidate_of_env(env) == cand


@pytest.mark.parametrize("env", [{}, {"NCCL_ALGO": "Ring;allreduce:Tree"}, {"NCCL_ALGO": "allreduce:Tree",
                                  "NCCL_PROTO": "LL"}, {"NCCL_MIN_NCHANNELS": "8"}, {"NCCL_ALGO": "^Tree"},
                                 {"NCCL_ALGO": "alltoall:Ring"}, {"NCCL_PROTO": "LL,LL128"}])
def test_other_environments_are_no_candidate(env: dict[str, str]) -> None:
    assert candidate_of_env(env) is None


def test_table_inputs_split_whole_trials_per_collective() -> None:
    def trial(ar: float, ag: float) -> list[Measurement]:
        return [Measurement(s, 1.0, 1.0, ar, "RING", "LL", True, 8, collective="all_reduce") for s in SIZES] + [
            Measurement(s, 1.0, 1.0, ag, "RING", "SIMPLE", True, None, collective="all_gather") for s in SIZES]

    base = {(c, s): st for c in ("all_reduce", "all_gather") for s, st in BASE.items()}
    tree, ring = SizeCandidate("tree", "ll", only=("all_reduce",)), SizeCandidate("ring", "ll")
    got = table_inputs(["all_reduce", "all_gather"], base, [(tree, [trial(130, 140)]), (ring, [trial(90, 110)])],
                       [trial(100, 100), trial(100, 100)])
    assert [m.candidate for m in got["all_reduce"].measured] == [tree, ring]
    assert [m.candidate for m in got["all_gather"].measured] == [ring]  # Tree's trial says nothing of all_gather
    assert got["all_gather"].measured[0].stats[MIB].median == 110
    assert got["all_reduce"].measured[0].used[MIB] == Seen("ring", "ll", 8)
    assert got["all_gather"].default_used[MIB] == Seen("ring", "simple", None)
    assert set(got["all_gather"].baseline) == set(SIZES)


def test_the_report_names_the_collective_of_every_entry() -> None:
    from nccltune.pipeline.tablestage import TableOutcome
    from nccltune.report.sweep import table_lines

    ag = {RING_LL: {s: 120.0 if s in SMALL else 95.0 for s in SIZES}}
    ar = {TREE_LL128: {s: 125.0 if s in LARGE else 90.0 for s in SIZES}}
    t = _table(_inputs(ag, ar))
    table = to_table(t, fingerprint=FP, nranks=2, nccl="2.28.9")
    out = TableOutcome("active", t, table, render_table(table), None, spans(t), default_channels=16)
    lines = table_lines(out)
    assert "  allgather  [64KiB, 512KiB) (measured 64KiB, 256KiB): ring/ll" in lines
    assert "  allreduce  [512KiB, 16MiB] (measured 1MiB, 4MiB, 16MiB): tree/ll128" in lines
    assert [e["collective"] for e in out.as_dict()["entries"]] == ["allgather", "allreduce"]  # type: ignore[index]
