"""What a class's canary found after an upgrade: the upgrade gate (compare.upgrade_check, a sweep
against the last sweep of the previous NCCL/driver/torch) read size by size (`GateReading`), and
its record in the node's export (`export_gate`), for `fleet status` and the upgrade rule
(fleet/upgrade.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..compare import UpgradeCheck
    from ..store import Store


@dataclass(frozen=True)
class GateReading:
    """What the canary's upgrade gate (compare.upgrade_check) found, size by size."""

    compared: int  # (collective, size) rows compared on either side (defaults, published)
    slower: tuple[str, ...]  # "defaults all_reduce 1048576 B -12.0% (noise 2.0%)", ...

    @classmethod
    def of(cls, check: UpgradeCheck | None) -> GateReading | None:
        if check is None:
            return None
        rows = [s for side in (check.defaults, check.published) for s in side.sizes if s.verdict != "missing"]
        slower = tuple(f"{side} {s.collective} {s.size_bytes} B {s.change_pct or 0.0:+.1f}% (noise {s.noise_pct:.1f}%)"
                       for side, s in check.regressions)
        return cls(len(rows), slower)

    @classmethod
    def of_export(cls, export: Mapping[str, Any]) -> GateReading | None:
        """The reading an export carries (its `upgrade_gate`), or None: its newest run follows no
        other versions."""
        gate = export.get("upgrade_gate")
        if not isinstance(gate, Mapping):
            return None
        return cls(int(gate["compared"]), tuple(str(s) for s in gate["slower"]))


def slower_warning(export: Mapping[str, Any], where: str) -> str | None:
    """What a person deciding by hand should see of an export whose upgrade gate found sizes
    slower than under the previous versions, or None."""
    reading = GateReading.of_export(export)
    if reading is None or not reading.slower:
        return None
    before = export["upgrade_gate"]["previous_versions"]
    now = export["versions"]
    return (f"{where}: {export['hostname']}'s upgrade gate found {len(reading.slower)} size(s) slower beyond noise "
            f"under NCCL {now.get('nccl') or 'unknown'}, driver {now.get('driver') or 'unknown'} than under NCCL "
            f"{before.get('nccl') or 'unknown'}, driver {before.get('driver') or 'unknown'}: "
            f"{'; '.join(reading.slower[:3])}")


def export_gate(store: Store, run_id: int) -> dict[str, Any] | None:
    """The export's `upgrade_gate` (schemas/export.schema.json): the upgrade gate of sweep `run_id`
    (the newest exported) against the last sweep of the previous versions, for `fleet status` and
    the upgrade rule; None where the run follows no other versions."""
    from ..compare import upgrade_check

    run = store.run(run_id)
    if run is None or run.kind != "sweep" or run.status != "ok":
        return None
    check = upgrade_check(store, run, warn=False)
    reading = GateReading.of(check)
    if check is None or reading is None:
        return None
    names = ("nccl", "driver", "torch")
    return {"run_id": check.run_id, "previous_run_id": check.previous_run_id,
            "previous_versions": dict(zip(names, check.before, strict=True)),
            "compared": reading.compared, "slower": list(reading.slower)}
