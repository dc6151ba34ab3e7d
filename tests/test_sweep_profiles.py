"""Workload profiles: which collectives they measure, how much each (collective, size) weighs,
and the choice that protects every collective a profile measures (synthetic measurements)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
from demo_state import clean_env

from nccltune.cli import main
from nccltune.config import Config, parse_config, with_overrides
from nccltune.node import load_node
from nccltune.pipeline.planning import workload
from nccltune.sweep import decision, profiles
from nccltune.sweep.plan import Plan
from nccltune.sweep.select import MiB
from nccltune.sweep.strategy import Search, Settings

LADDER = [65536 * 4**i for i in range(8)]  # 64 KiB .. 1 GiB
COMMON = {"NCCL_TOPO_FILE": "/state/runs/00001/ncclTopology.xml"}


def test_workload_profiles_name_their_collectives() -> None:
    assert profiles.collectives_of("ddp", {}) == ["all_reduce"]
    assert profiles.collectives_of("fsdp", {}) == ["all_gather", "reduce_scatter"]
    assert profiles.collectives_of("moe", {}) == ["all_to_all", "all_reduce"]
    assert profiles.collectives_of("pipeline", {}) == ["sendrecv"]
    for size_profile in ("balanced", "large", "small"):
        assert profiles.collectives_of(size_profile, {}) == ["all_reduce"]
    with pytest.raises(KeyError):
        profiles.collectives_of("nope", {})


def test_ddp_weighs_gradient_buckets_heavily_and_the_other_sizes_lightly() -> None:
    w = profiles.weights("ddp", LADDER, {})
    assert set(w) == {("all_reduce", s) for s in LADDER}
    heavy = [s for (_c, s), x in w.items() if x == 1.0]
    assert heavy == [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    assert w[("all_reduce", 65536)] == w[("all_reduce", 1 << 30)] == pytest.approx(profiles.LIGHT)


def test_moe_gives_all_to_all_twice_the_share_of_all_reduce() -> None:
    w = profiles.weights("moe", LADDER, {})
    assert w[("all_to_all", 4 * MiB)] == 2.0 and w[("all_reduce", 4 * MiB)] == 1.0
    assert w[("all_to_all", 256 * MiB)] == pytest.approx(0.2)  # outside token-dispatch sizes


def test_size_profiles_weigh_all_reduce_as_before() -> None:
    assert profiles.weights("large", LADDER, {}) == {
        ("all_reduce", s): (1.0 if s >= 16 * MiB else 0.0) for s in LADDER}


def test_a_ladder_outside_a_parts_range_weighs_every_size() -> None:
    assert profiles.weights("pipeline", [4096, 16384], {}) == {("sendrecv", 4096): 1.0, ("sendrecv", 16384): 1.0}


def test_a_configured_profile_weighs_the_collectives_it_names() -> None:
    cfg = parse_config('sweep:\n  profile: mine\n  profiles:\n    mine:\n      all_gather: {"1MiB": 2}\n'
                       '      broadcast: {"5000": 1, "1GiB": 0}\n', "c.yaml")
    node = load_node(cfg, True)
    w = workload(cfg, node, [4096, MiB])
    assert w.collectives == ("all_gather", "broadcast")
    assert w.weights == {("all_gather", 4096): 0.0, ("all_gather", MiB): 2.0,
                         ("broadcast", 4096): 1.0, ("broadcast", MiB): 0.0}
    # The original form, sizes alone, weighs all_reduce.
    old = parse_config('sweep:\n  profile: inf\n  profiles:\n    inf: {"64KiB": 4}\n', "c.yaml")
    assert workload(old, node, [65536]).weights == {("all_reduce", 65536): 4.0}


def test_a_collective_the_backend_cannot_measure_is_named_with_why() -> None:
    cfg = with_overrides(Config(), **{"sweep.profile": "pipeline"})
    one_rank = dataclasses.replace(load_node(cfg, True), nranks=1)
    w = workload(cfg, one_rank, [4096])
    assert w.collectives == () and w.weights == {}
    assert w.not_measured == {"sendrecv": "torch's gloo backend cannot send to its own rank"}
    # Two gloo ranks measure all seven.
    assert workload(cfg, load_node(cfg, True), [4096]).not_measured == {}


# -- the choice protects every measured collective -------------------------------------------


def _busbw(collective: str, size: int) -> float:
    return {"all_reduce": 200.0, "all_gather": 150.0, "reduce_scatter": 140.0}[collective] * size / (size + 8 * MiB)


class Bench:
    """Three collectives, deterministic but for 0.2% noise: NCCL_ALGO=Tree makes all_reduce 10%
    faster and all_gather 10% slower at every size, and leaves reduce_scatter alone."""

    def __init__(self) -> None:
        self.rng = random.Random(3)

    def __call__(self, env: dict[str, str], phase: str, label: str) -> tuple[dict[Any, float], dict[str, Any]]:
        tree = env.get("NCCL_ALGO") == "Tree"
        out = {}
        for c in ("all_reduce", "all_gather", "reduce_scatter"):
            factor = (1.10 if c == "all_reduce" else 0.90 if c == "all_gather" else 1.0) if tree else 1.0
            for s in LADDER:
                out[(c, s)] = _busbw(c, s) * factor * (1.0 + self.rng.uniform(-0.002, 0.002))
        return out, {}


def _search(profile: str) -> Search:
    plan = Plan(variables={"NCCL_ALGO": ["Tree"]}, pruned=[], pinned={}, policy={}, sizes=list(LADDER),
                backend="nccl", nranks=2)
    return Search(plan, Settings(), Bench(), common=dict(COMMON), weights=profiles.weights(profile, LADDER, {}))


def test_a_setting_that_slows_all_gather_is_not_published_under_fsdp() -> None:
    result = _search("fsdp").run()
    assert result.chosen is None or "NCCL_ALGO" not in result.chosen.env
    # all_gather 10% slower, reduce_scatter unchanged: it screens as a loss and never becomes a finalist.
    (gain,) = [g for env, _label, g in result.screened if env.get("NCCL_ALGO") == "Tree"]
    assert gain is not None and gain == pytest.approx(-5.0, abs=0.5)
    assert all(f.env.get("NCCL_ALGO") != "Tree" for f in result.finalists)


def test_the_same_setting_is_published_under_ddp() -> None:
    result = _search("ddp").run()
    assert result.chosen is not None and result.chosen.env.get("NCCL_ALGO") == "Tree"
    assert result.chosen.verdict is not None and result.chosen.verdict.gain_pct == pytest.approx(10.0, abs=0.5)


def test_one_slower_collective_vetoes_a_gain_of_the_others() -> None:
    """Judged directly: all_reduce 10% faster, all_gather 5% slower at one size, reduce_scatter
    unchanged, in three paired rounds; the weighted gain is positive, the verdict is no, and the
    reason names the size."""
    keys = [(c, s) for c in ("all_reduce", "all_gather", "reduce_scatter") for s in (MiB, 16 * MiB)]

    def ratio(k: tuple[str, int]) -> float:
        return 1.10 if k[0] == "all_reduce" else 0.95 if k == ("all_gather", MiB) else 1.0

    blocks = [{k: math.log(ratio(k)) + jitter for k in keys} for jitter in (-0.002, 0.0, 0.002)]
    ev = decision.Evidence((tuple(blocks),))
    rule = decision.Rule(1.0, 2.0)
    verdict = decision.judge(ev, {k: 1.0 for k in keys}, rule)
    assert verdict.gain_pct > 0 and not verdict.eligible and verdict.status == decision.LOSE
    assert verdict.regressions == [(("all_gather", MiB), pytest.approx(0.95))]
    assert "worst all_gather 1MiB: x0.950" in verdict.reason
    # Without all_gather in the profile's weights, the same numbers are a gain worth publishing.
    ddp = {k: (1.0 if k[0] == "all_reduce" else 0.0) for k in keys}
    assert decision.judge(ev, ddp, rule).eligible


# -- the plan shows the collectives, their sizes and the time -----------------------------------


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    rc = main(["sweep", "--demo", "--plan", "--state-dir", str(tmp_path / "s"), *extra])
    assert rc == 0
    return capsys.readouterr().out


def test_the_plan_shows_the_profiles_collectives_and_a_longer_estimate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k not in clean_env()]:
        monkeypatch.delenv(name)  # the caller's NCCL variables would be pinned into the plan
    text = _plan(tmp_path, capsys, "--profile", "fsdp")
    assert "Collectives of profile fsdp" in text
    assert "  all_gather: 4KiB-256KiB x0.1, 1MiB-4MiB x1" in text
    assert "  reduce_scatter: 4KiB-256KiB x0.1, 1MiB-4MiB x1" in text
    assert "of 2 collectives each" in text
    fsdp = json.loads(_plan(tmp_path, capsys, "--profile", "fsdp", "--json"))
    assert [c["collective"] for c in fsdp["collectives"]] == ["all_gather", "reduce_scatter"]
    assert {s["size_bytes"]: s["weight"] for s in fsdp["collectives"][0]["sizes"]}[MiB] == 1.0
    assert fsdp["not_measured"] == {}
    ddp = json.loads(_plan(tmp_path, capsys, "--profile", "ddp", "--json"))
    assert [c["collective"] for c in ddp["collectives"]] == ["all_reduce"]
    # The same trials but the per-size Tree candidates (Tree runs only all-reduce, which fsdp does not
    # measure), each trial twice the collectives.
    assert ddp["per_size"]["collectives"] == ["allreduce"]
    assert fsdp["per_size"]["collectives"] == ["allgather", "reducescatter"]
    tree = [c for c in ddp["per_size"]["candidates"] if c["label"].startswith("tree/")]
    assert len(tree) == 3 and not any(c["label"].startswith("tree/") for c in fsdp["per_size"]["candidates"])
    assert fsdp["estimate"]["trials"] == ddp["estimate"]["trials"] - len(tree)
    assert (fsdp["estimate"]["seconds"] / fsdp["estimate"]["trials"]
            > ddp["estimate"]["seconds"] / ddp["estimate"]["trials"])


def test_collectives_without_numbers_are_listed_with_why_in_the_plan_and_the_report() -> None:
    from nccltune.pipeline.planning import Workload
    from nccltune.records import ReportRow
    from nccltune.report.sweep import rows_text, workload_doc, workload_lines

    w = Workload("pipeline+", ("all_reduce",), {("all_reduce", 4096): 1.0, ("all_reduce", MiB): 0.0},
                 {"sendrecv": "torch's gloo backend cannot send to its own rank"})
    assert workload_lines(w) == ["Collectives of profile pipeline+ (every size of the ladder each, weighted):",
                                 "  all_reduce: 4KiB x1",
                                 "  sendrecv: not measured on this backend (torch's gloo backend cannot send to "
                                 "its own rank)"]
    assert workload_doc(w)["not_measured"] == {"sendrecv": "torch's gloo backend cannot send to its own rank"}
    rows = [ReportRow(4096, 1.0, 1.0, 0.0, 1.0, 1.0)]
    text = rows_text(rows, not_measured=w.not_measured)
    assert text[0] == "all_reduce (busbw = algbw x 2(n-1)/n):"
    assert text[-1] == "sendrecv: not measured on this backend (torch's gloo backend cannot send to its own rank)"
    # One all_reduce table and nothing missing: the table as it always was, without a heading.
    assert rows_text(rows)[0].startswith("# size in bytes")


def test_verify_refuses_an_unknown_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--demo", "--profile", "nope", "--state-dir", str(tmp_path / "s")]) == 78
    err = capsys.readouterr().err
    assert "unknown profile 'nope'" in err and "fsdp" in err
