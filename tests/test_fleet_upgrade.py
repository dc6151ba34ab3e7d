"""The upgrade rule (fleet/upgrade.py, docs/upgrades.md) on hand-made inputs: which outcome the
canary's gate and a new profile give, the canary of a profile, what the canary's sweep is narrowed
to, and the gate as the export carries it, from a hand-made history of two NCCL versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nccltune.config import Config, with_overrides
from nccltune.fleet.gate import GateReading, export_gate
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.fleet.upgrade import (
    SAFE_PART,
    canary_measured,
    canary_of,
    canary_overrides,
    upgrade_outcome,
)
from nccltune.names import DEFAULTS_LABEL
from nccltune.records import Measurement
from nccltune.store import Store

MiB = 1 << 20


@pytest.mark.parametrize(("gate", "new", "outcome", "why"), [
    (None, None, "safe", "has not re-measured"),
    (GateReading(0, ()), None, "safe", "has not re-measured"),
    (GateReading(4, ("defaults all_reduce 1048576 B -30.0% (noise 1.0%)",)), None, "safe", "1 size(s) slower"),
    (GateReading(4, ()), None, "keep", "no size slower beyond noise (4 compared)"),
    # The canary's profile for the new versions wins over either, whatever the gate said.
    (GateReading(4, ("x",)), {"chosen": "NCCL_ALGO=Ring"}, "new", "(NCCL_ALGO=Ring)"),
    (None, {"chosen": DEFAULTS_LABEL}, "new", "(NCCL's defaults)"),
])
def test_the_rule_new_keep_or_safe(gate: GateReading | None, new: dict[str, Any] | None, outcome: str,
                                   why: str) -> None:
    got, reason = upgrade_outcome(gate, new)
    assert got == outcome and why in reason


def test_the_canary_is_the_lowest_hostname_of_the_profiles_nodes() -> None:
    nodes = [{"hostname": h} for h in ("gpu-10", "gpu-02", "gpu-7")]
    assert canary_of({"evidence": {"nodes": nodes}}) == "gpu-02"
    assert canary_of({"evidence": {"nodes": []}}) is None


def test_the_canarys_sweep_measures_the_profiles_values_alone() -> None:
    doc = {"env": {"NCCL_BUFFSIZE": "8388608", "NCCL_ALGO": "Ring", "NCCL_IB_HCA": "mlx5_0",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}}
    got = canary_overrides(doc)
    # The whole-environment search: the profile's value of each of its variables and nothing else;
    # the per-size stage (algorithm, protocol, channels) re-measures the table's candidates.
    assert got["sweep.variables"] == {"NCCL_BUFFSIZE": ["8388608"]}
    excluded = got["sweep.exclude"]
    assert isinstance(excluded, list) and "NCCL_BUFFSIZE" not in excluded and "NCCL_ALGO" not in excluded
    assert "NCCL_NTHREADS" in excluded
    cfg = with_overrides(Config(), **got)  # what the config's reader accepts
    assert cfg.sweep.variables == {"NCCL_BUFFSIZE": ["8388608"]} and "NCCL_NTHREADS" in cfg.sweep.exclude


def _sweep(store: Store, nccl: str, defaults: list[float], tuned: list[float]) -> int:
    run = store.start_run(kind="sweep", fingerprint="0123456789abcdef", backend="nccl", demo=False, profile="balanced",
                          nccl_version=nccl, driver_version="570.1", torch_version="2.7.0", nccltune_version="0",
                          hostname="node1", topology={}, config={})
    seq = 0
    for label, env, values in (("defaults", {}, defaults), ("NCCL_ALGO=Ring", {"NCCL_ALGO": "Ring"}, tuned)):
        for i, busbw in enumerate(values):
            seq += 1
            m = Measurement(size_bytes=MiB, time_us=100.0, algbw_gbps=busbw, busbw_gbps=busbw)
            store.add_trial(run, seq=seq, phase="baseline" if not env else "final", label=f"{label} #{i + 1}",
                            env=env, status="ok", measurements=[m])
    store.finish_run(run, status="ok", summary={"chosen": "NCCL_ALGO=Ring", "nccl_version": nccl},
                     chosen_env={"NCCL_ALGO": "Ring"})
    return run


@pytest.mark.parametrize(("new_defaults", "slower"), [([100.5, 101.0, 100.0], 0), ([70.0, 70.5, 69.5], 1)])
def test_the_gate_of_the_canarys_sweep_as_the_export_carries_it(tmp_path: Path, new_defaults: list[float],
                                                               slower: int) -> None:
    with Store(tmp_path / "history.db") as store:
        old = _sweep(store, "2.21.5", [100.0, 101.0, 99.0], [120.0, 121.0, 119.0])
        assert canary_measured(store, "0123456789abcdef", "2.26.2", "570.1") is None
        new = _sweep(store, "2.26.2", new_defaults, [119.5, 120.5, 120.0])
        assert canary_measured(store, "0123456789abcdef", "2.26.2", "570.1") == new
        assert canary_measured(store, "0123456789abcdef", "2.26.2", "580.1") is None  # another driver
        gate = export_gate(store, new)
        assert export_gate(store, old) is None  # no earlier versions to compare with
    assert gate is not None
    assert (gate["run_id"], gate["previous_run_id"], gate["compared"]) == (new, old, 2)
    assert gate["previous_versions"] == {"nccl": "2.21.5", "driver": "570.1", "torch": "2.7.0"}
    assert len(gate["slower"]) == slower
    validate(gate, load_schema("export")["properties"]["upgrade_gate"], load_schema("export"))
    reading = GateReading(gate["compared"], tuple(gate["slower"]))
    assert upgrade_outcome(reading, None)[0] == ("safe" if slower else "keep")


def test_verify_never_compares_the_safe_part_with_the_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """The class's numbers were measured under the old versions: with only the safe part published,
    verify's expectation is the node's own, and the class profile's copy is not even read."""
    from nccltune.checks import verify
    from nccltune.publish import PublishedSet

    def never(*args: object) -> None:
        raise AssertionError("the class profile in force was read")

    monkeypatch.setattr(verify, "profile_in_force", never)
    prov = {"class_profile": {"file": "c0ffee.json", "sha256": "0" * 64, "part": SAFE_PART}}
    assert verify._class_in_force(Config(), PublishedSet(Path("/nonexistent"), 1, {}, prov, {})) == (None, None)
    whole = {"class_profile": {"file": "c0ffee.json", "sha256": "0" * 64}}
    with pytest.raises(AssertionError, match="was read"):
        verify._class_in_force(Config(), PublishedSet(Path("/nonexistent"), 1, {}, whole, {}))
