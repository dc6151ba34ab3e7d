"""One number per fact: on one real demo sweep, the median bus bandwidth of NCCL's defaults and of
the published setting at each (collective, size) is the same in every output that shows it (the
report's table and JSON, the plot's lines, `compare`, the nccl-tests document, the metrics and
verify's expectation), and the table's times are the measured median times, not times recomputed
from a rounded bandwidth."""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
from typing import Any
from unittest import mock

from demo_state import SNAPSHOT, DemoSweep, clean_env

from nccltune.checks.verify import _expectations
from nccltune.cli import main
from nccltune.compare import compare_runs, setting_trials
from nccltune.config import load_config, with_overrides
from nccltune.metrics import snapshot_from_store
from nccltune.names import DEFAULTS_LABEL
from nccltune.node import load_node
from nccltune.report.nccltests_json import run_document
from nccltune.report.plot import series_by_collective
from nccltune.report.sweep import rows_text
from nccltune.store import Store

Key = tuple[str, int]
ROUNDED = 0.0005  # the stored rows keep 3 decimals of GB/s


def report_json(demo_sweep: DemoSweep, run_id: int) -> dict[str, Any]:
    out = io.StringIO()
    with mock.patch.dict(os.environ, clean_env(), clear=True), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(io.StringIO()):
        rc = main(["report", "--run", str(run_id), "--json", *map(str, demo_sweep.args())])
    assert rc == 0
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


def test_every_output_shows_the_same_median(demo_sweep: DemoSweep) -> None:
    with Store(demo_sweep.state / "history.db") as store:
        run = store.run(int(demo_sweep.doc["run_id"]))
        assert run is not None and run.rows
        trials = store.trials(run.id)
        chosen = str((run.summary or {}).get("chosen") or DEFAULTS_LABEL)
        truth: dict[str, dict[Key, float]] = {}
        for side in ("defaults", "published"):
            runs = setting_trials(trials, "defaults" if side == "defaults" else chosen)
            assert runs, side
            samples: dict[Key, list[float]] = {}
            for t in runs:
                for m in t.measurements:
                    samples.setdefault((m.collective, m.size_bytes), []).append(m.busbw_gbps)
            truth[side] = {k: statistics.median(v) for k, v in samples.items()}
        defaults_runs = setting_trials(trials, "defaults")
        # More than the first baselines: the defaults' final-round runs count too.
        assert len(defaults_runs) == len([t for t in trials if t.status == "ok" and not t.env]) >= 3
        seen: dict[str, dict[str, dict[Key, float]]] = {"defaults": {}, "published": {}}

        def shown(where: str, side: str, values: dict[Key, float]) -> None:
            seen[side][where] = values

        rows = {(r.collective, r.size_bytes): r for r in run.rows}
        shown("stored rows", "defaults", {k: r.default_busbw_gbps for k, r in rows.items()})
        shown("stored rows", "published", {k: r.tuned_busbw_gbps for k, r in rows.items()})
        doc = report_json(demo_sweep, run.id)
        shown("report --json", "defaults", {(s["collective"], s["size_bytes"]): s["default_busbw_gbps"]
                                            for s in doc["sizes"]})
        shown("report --json", "published", {(s["collective"], s["size_bytes"]): s["tuned_busbw_gbps"]
                                             for s in doc["sizes"]})
        lines = series_by_collective(trials)
        shown("plot", "defaults", {(c, size): v for c, by in lines.items() for size, v in by[DEFAULTS_LABEL].items()})
        shown("plot", "published", {(c, size): v for c, by in lines.items()
                                    for size, v in by[chosen if chosen in by else DEFAULTS_LABEL].items()})
        for side in ("defaults", "published"):
            cmp = compare_runs(store, run.id, run.id, side)  # type: ignore[arg-type]
            shown("compare", side, {(s.collective, s.size_bytes): s.a_busbw_gbps or 0.0 for s in cmp.sizes})
            nt = run_document(run, trials, setting=side)  # type: ignore[arg-type]
            # The demo measures in place (torch.distributed), a GPU node out of place: whichever is filled.
            shown("nccl-tests document", side, {
                ("all_reduce", r["size"]): (r["out_of_place"] or r["in_place"])["bus_bw"] for r in nt["results"]})
        snap = snapshot_from_store(store, fingerprint=run.fingerprint)
        for side, which in (("defaults", "default"), ("published", "published")):
            shown("metrics", side, {(c, size): v for (c, size, w), v in snap.busbw_gbps.items() if w == which})
        cfg = with_overrides(load_config(demo_sweep.config), state_dir=str(demo_sweep.state))
        node = load_node(cfg, str(SNAPSHOT))
        sizes = sorted({size for _c, size in rows})
        for side, current in (("defaults", True), ("published", False)):
            expected, _how, _counts = _expectations(store, node, None, current, sizes, ("all_reduce",))
            shown("verify's expectation", side, {k: v[0] for k, v in expected.items()})
    for side, by_output in seen.items():
        for where, values in by_output.items():
            assert set(values) == set(truth[side]), (side, where)
            for key, value in values.items():
                assert abs(value - truth[side][key]) <= ROUNDED, (side, where, key, value, truth[side][key])


def test_the_tables_times_are_the_measured_medians(demo_sweep: DemoSweep) -> None:
    with Store(demo_sweep.state / "history.db") as store:
        run = store.run(int(demo_sweep.doc["run_id"]))
        assert run is not None and run.rows
        trials = store.trials(run.id)
    chosen = str((run.summary or {}).get("chosen") or DEFAULTS_LABEL)
    times: dict[int, list[float]] = {}
    for t in setting_trials(trials, "defaults"):
        for m in t.measurements:
            times.setdefault(m.size_bytes, []).append(m.time_us)
    table = rows_text(run.rows, trials, chosen)
    cells = {int(line.split()[0]): line.split() for line in table[3:]}
    assert set(cells) == set(times)
    for size, got in cells.items():
        assert got[3] == f"{statistics.median(times[size]):.2f}", (size, got)
    # Distinct sizes take distinct times: nothing is derived from a bandwidth rounded to one value.
    assert len({got[3] for got in cells.values()}) == len(cells)
