"""One measurement record on every path: the worker's line, the history store, history's JSON
document, an export and `fleet decide`'s reading of it each carry every field of a
records.Measurement and give back the same record."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nccltune.fleet.decide import load_exports, pool
from nccltune.fleet.export import build_export, dumps_export, node_identity
from nccltune.fleet.jsonschema import load_schema, validate
from nccltune.fleet.member import FleetNode
from nccltune.records import MEASUREMENT_KEYS, Measurement
from nccltune.report.runs import history_doc
from nccltune.store import Store
from nccltune.topology.fingerprint import topology_fingerprint
from nccltune.topology.model import from_snapshot
from nccltune.topology.snapshot import load_snapshot

ROOT = Path(__file__).resolve().parents[1]

# Every field set, none at its default, so that a path that drops one cannot pass.
FULL = Measurement(size_bytes=1 << 20, time_us=41.25, algbw_gbps=25.42, busbw_gbps=44.485, algo="Tree",
                   proto="LL128", correct=True, channels=16, gpu_time_us=39.5, collective="all_gather")


def test_every_field_is_in_the_document() -> None:
    assert sorted(f.name for f in dataclasses.fields(Measurement)) == sorted(MEASUREMENT_KEYS)
    assert all(getattr(FULL, key) is not None for key in MEASUREMENT_KEYS)
    doc = FULL.to_doc()
    assert list(doc) == list(MEASUREMENT_KEYS)
    assert Measurement.from_doc(json.loads(json.dumps(doc))) == FULL


def test_the_workers_line_reads_as_the_record() -> None:
    """The worker's `size` line: its own keys beside the record's; no algorithm or channels (NCCL's log adds them)."""
    line = json.dumps({"event": "size", "size_bytes": 4096, "count": 1024, "collective": "reduce_scatter",
                       "time_us": 12.5, "gpu_time_us": 11.75, "algbw_gbps": 0.328, "busbw_gbps": 0.164,
                       "correct": False, "placement": "out-of-place", "iters": 5, "warmup": 2})
    got = Measurement.from_doc(json.loads(line))
    assert got == Measurement(4096, 12.5, 0.328, 0.164, correct=False, gpu_time_us=11.75, collective="reduce_scatter")


@pytest.mark.parametrize("bad", [
    {"size_bytes": "4096"}, {"time_us": "12.5"}, {"correct": "false"}, {"channels": 4.5}, {"gpu_time_us": True},
    {"algo": 3}, {"collective": 7},
])
def test_a_field_of_the_wrong_type_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(TypeError, match=next(iter(bad))):
        Measurement.from_doc({**FULL.to_doc(), **bad})


def test_a_missing_field_is_refused_and_an_older_documents_defaults_hold() -> None:
    for key in ("size_bytes", "time_us", "algbw_gbps", "busbw_gbps", "correct"):
        with pytest.raises(KeyError):
            Measurement.from_doc({k: v for k, v in FULL.to_doc().items() if k != key})
    older = {k: v for k, v in FULL.to_doc().items() if k not in ("collective", "gpu_time_us", "channels")}
    assert Measurement.from_doc(older) == dataclasses.replace(FULL, collective="all_reduce", gpu_time_us=None,
                                                              channels=None)


def test_store_history_export_and_decide_keep_every_field(tmp_path: Path) -> None:
    snap = load_snapshot(ROOT / "topologies" / "hgx-h100-8gpu.json")
    topo = from_snapshot(snap)
    bare = dataclasses.replace(FULL, algo=None, proto=None, channels=None, gpu_time_us=None, collective="all_reduce",
                               correct=False)
    with Store(tmp_path / "history.db") as store:
        run = store.start_run(kind="sweep", fingerprint=topology_fingerprint(topo), backend="nccl", demo=False,
                              profile="balanced", nccl_version="2.28.9", driver_version=topo.driver_version,
                              torch_version="2.9.0", nccltune_version="0.2.0", hostname="gpu001",
                              topology={"gpus": 8}, config={"bench": {"nranks": None, "gpus": None}})
        store.add_trial(run, seq=1, phase="baseline", label="defaults #1", env={}, status="ok", reason=None,
                        wall_s=1.0, nccl=None, measurements=[FULL, bare])
        store.finish_run(run, status="ok", chosen_env={}, published_generation=1)
        [trial] = store.trials(run)
        # the store
        assert list(trial.measurements) == [FULL, bare]
        # history's JSON document
        history = history_doc([store.run(run)], [trial])  # type: ignore[list-item]
        export = build_export(store, node_identity(FleetNode(topo, topo, False)))
    rows = json.loads(json.dumps(history))["trials"][0]["measurements"]
    schema = json.loads((ROOT / "schemas" / "history.schema.json").read_text())
    for row in rows:
        validate(row, schema["$defs"]["measurement_row"], schema)
    assert [Measurement.from_doc(r) for r in rows] == [FULL, bare]
    assert rows[0]["gpu_time_us"] == FULL.gpu_time_us and rows[1]["gpu_time_us"] is None
    # the export, as written and as `fleet decide` reads it (only correct measurements pool)
    validate(export, load_schema("export"))
    [exported] = export["runs"][0]["trials"][0]["measurements"][:1]
    assert exported == FULL.to_doc()
    path = tmp_path / "gpu001.json"
    path.write_text(dumps_export(export))
    pooled = pool(load_exports([path]))
    assert pooled.baseline_measurements == [[FULL]]
