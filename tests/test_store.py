"""The results store against real SQLite files in tmp_path."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from nccltune.errors import EXIT_BUSY, EXIT_CONFIG, BusyError, InputError
from nccltune.records import Measurement, ReportRow
from nccltune.store import Store, database, migrations


class FakeClock:
    """Advances one second per reading, so that start order is time order and names are known."""

    def __init__(self, start: datetime = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)) -> None:
        self.now = start

    def __call__(self) -> datetime:
        current = self.now
        self.now += timedelta(seconds=1)
        return current


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "history.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    with Store(db_path, clock=FakeClock()) as s:
        yield s


def _start(s: Store, fingerprint: str = "fp-a", kind: Any = "sweep") -> int:
    return s.start_run(
        kind=kind,
        fingerprint=fingerprint,
        backend="gloo",
        demo=True,
        profile="default",
        nccl_version=None,
        driver_version=None,
        torch_version="2.3.0",
        nccltune_version="0.1.0",
        hostname="node1",
        topology={"gpus": 2, "links": ["NV4"]},
        config={"sweep": {"repeats": 3}},
    )


def _baseline_trial(s: Store, run_id: int, seq: int, busbw: dict[int, float], status: Any = "ok") -> int:
    return s.add_trial(
        run_id,
        seq=seq,
        phase="baseline",
        label="defaults",
        env={},
        status=status,
        measurements=[Measurement(size, 10.0, bw, bw) for size, bw in busbw.items()],
    )


def test_round_trip_run_trials_measurements(store: Store, db_path: Path) -> None:
    run_id = _start(store)
    ms = [
        Measurement(1024, 12.5, 0.08, 0.08, algo="Ring", proto="LL", correct=True),
        Measurement(1 << 20, 80.0, 13.1, 13.1, algo="Tree", proto="Simple"),
    ]
    t1 = store.add_trial(
        run_id,
        seq=1,
        phase="screen",
        label="NCCL_ALGO=Tree",
        env={"NCCL_PROTO": "Simple", "NCCL_ALGO": "Tree"},
        status="ok",
        wall_s=3.25,
        nccl={"version": "2.21.5", "transports": ["P2P"], "algo": {"1024": "Ring"}},
        measurements=ms,
    )
    t0 = store.add_trial(
        run_id, seq=0, phase="baseline", label="defaults", env={}, status="timeout", reason="rank 1 hung"
    )
    store.finish_run(
        run_id,
        status="ok",
        summary={"gain": 1.07, "noise": 0.01},
        chosen_env={"NCCL_ALGO": "Tree"},
        published_generation=3,
    )

    run = store.run(run_id)
    assert run is not None
    assert (run.kind, run.status, run.backend, run.demo) == ("sweep", "ok", "gloo", True)
    assert run.fingerprint == "fp-a" and run.profile == "default" and run.hostname == "node1"
    assert run.nccl_version is None and run.torch_version == "2.3.0"
    assert run.topology == {"gpus": 2, "links": ["NV4"]}
    assert run.config == {"sweep": {"repeats": 3}}
    assert run.summary == {"gain": 1.07, "noise": 0.01}
    assert run.chosen_env == {"NCCL_ALGO": "Tree"}
    assert run.published_generation == 3
    assert run.started_at == "2024-05-01T12:00:00.000000+00:00"
    assert run.finished_at is not None and run.finished_at > run.started_at

    trials = store.trials(run_id)
    assert [t.id for t in trials] == [t0, t1]  # seq order, not insertion order
    assert trials[0].status == "timeout" and trials[0].reason == "rank 1 hung"
    assert trials[0].measurements == () and trials[0].nccl is None and trials[0].wall_s is None
    assert trials[1].env == {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}
    assert trials[1].nccl == {"version": "2.21.5", "transports": ["P2P"], "algo": {"1024": "Ring"}}
    assert trials[1].wall_s == 3.25 and trials[1].phase == "screen"
    assert trials[1].measurements == tuple(ms)

    # Stored text: sorted keys, so equal environments compare equal as strings.
    raw = sqlite3.connect(db_path)
    env_json = raw.execute("SELECT env_json FROM trials WHERE id = ?", (t1,)).fetchone()[0]
    raw.close()
    assert env_json == '{"NCCL_ALGO":"Tree","NCCL_PROTO":"Simple"}'
    assert list(json.loads(env_json)) == sorted(json.loads(env_json))


def test_runs_lists_newest_first_and_filters_kind(store: Store) -> None:
    a = _start(store)
    b = _start(store, kind="verify")
    c = _start(store)
    assert [r.id for r in store.runs()] == [c, b, a]
    assert [r.id for r in store.runs(kind="sweep")] == [c, a]
    assert [r.id for r in store.runs(limit=1)] == [c]
    assert store.run(9999) is None
    assert store.trials(9999) == []
    d = _start(store, kind="import")
    assert [r.id for r in store.runs(kinds=("sweep", "verify"))] == [c, b, a]
    assert [r.id for r in store.runs(kind="import")] == [d]
    assert [r.id for r in store.runs(limit=2)] == [d, c]  # no kind named: every kind


def test_run_count_and_outcomes_read_what_runs_gives(store: Store) -> None:
    """The daemon's metrics count the sweeps and read the newest verifies' outcomes without their
    records: the same runs, in the same order, as runs() gives them."""
    verifies = [_start(store, fingerprint=fp, kind="verify") for fp in ("fp-a", "fp-b", "fp-a", "fp-a")]
    store.finish_run(verifies[0], status="ok", summary={})
    store.finish_run(verifies[1], status="failed", summary={})
    store.finish_run(verifies[2], status="failed", summary={})
    _start(store)
    assert store.run_count("sweep") == 1 and store.run_count("verify") == 4 and store.run_count("import") == 0
    for limit in (1, 3, 10):
        assert store.run_outcomes("verify", limit) == [
            (r.fingerprint, r.status, r.finished_at is not None) for r in store.runs(limit=limit, kind="verify")]
    assert store.run_outcomes("verify", 10) == [("fp-a", "running", False), ("fp-a", "failed", True),
                                                 ("fp-b", "failed", True), ("fp-a", "ok", True)]


def test_latest_run_by_fingerprint_and_status(store: Store) -> None:
    assert store.latest_run("fp-a") is None
    ok_a = _start(store, "fp-a")
    store.finish_run(ok_a, status="ok", chosen_env={"NCCL_ALGO": "Ring"}, published_generation=1)
    ok_b = _start(store, "fp-b")
    store.finish_run(ok_b, status="ok")
    failed_a = _start(store, "fp-a")
    store.finish_run(failed_a, status="failed")
    verify_a = _start(store, "fp-a", kind="verify")
    store.finish_run(verify_a, status="ok")
    running_a = _start(store, "fp-a")

    latest = store.latest_run("fp-a")
    assert latest is not None and latest.id == ok_a
    assert getattr(store.latest_run("fp-b"), "id", None) == ok_b
    assert getattr(store.latest_run("fp-a", status="failed"), "id", None) == failed_a
    assert getattr(store.latest_run("fp-a", kind="verify"), "id", None) == verify_a
    assert getattr(store.latest_run("fp-a", status=None), "id", None) == running_a
    assert store.latest_run("fp-c") is None

    published = store.latest_published("fp-a")
    assert published is not None
    assert (published.run_id, published.env, published.generation) == (ok_a, {"NCCL_ALGO": "Ring"}, 1)
    nothing_chosen = store.latest_published("fp-b")
    assert nothing_chosen is not None and nothing_chosen.env == {} and nothing_chosen.generation is None
    assert store.latest_published("fp-c") is None


def test_corrupt_file_is_moved_aside(db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    garbage = b"this is not an sqlite database, just bytes " * 100
    db_path.write_bytes(garbage)
    caplog.set_level(logging.WARNING, logger="nccltune.store")

    with Store(db_path, clock=FakeClock()) as s:
        run_id = _start(s)
        s.finish_run(run_id, status="ok")
        assert [r.id for r in s.runs()] == [run_id]

    aside = db_path.with_name("history.db.corrupt-20240501T120000Z")
    assert aside.read_bytes() == garbage
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert str(db_path) in message and str(aside) in message


def test_malformed_pages_are_moved_aside(db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Store(db_path) as s:
        for _ in range(20):
            run_id = _start(s)
            _baseline_trial(s, run_id, 0, {size: 1.0 for size in range(1, 200)})
    raw = sqlite3.connect(db_path)
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    raw.close()
    # Keep the header (page 1) intact so the file still opens; scribble over the b-tree pages.
    with db_path.open("r+b") as f:
        f.seek(page_size)
        f.write(b"\xa5" * page_size * 4)
    caplog.set_level(logging.WARNING, logger="nccltune.store")

    with Store(db_path) as s:
        assert s.runs() == []
    assert len(list(db_path.parent.glob("history.db.corrupt-*"))) == 1
    assert any("corrupt" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_quick_check_findings_move_the_file_aside(db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Store(db_path) as s:
        _start(s)  # a running run: finished_at is NULL
    # A NOT NULL column holding a NULL opens and reads fine; only quick_check reports it.
    raw = sqlite3.connect(db_path, isolation_level=None)
    raw.execute("PRAGMA writable_schema = ON")
    raw.execute(
        "UPDATE sqlite_master SET sql = replace(sql, 'finished_at TEXT,', 'finished_at TEXT NOT NULL,') "
        "WHERE name = 'runs'"
    )
    raw.close()
    caplog.set_level(logging.WARNING, logger="nccltune.store")

    with Store(db_path) as s:
        assert s.runs() == []
    assert len(list(db_path.parent.glob("history.db.corrupt-*"))) == 1
    assert any("quick_check" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_newer_schema_is_refused_and_left_alone(db_path: Path) -> None:
    raw = sqlite3.connect(db_path)
    raw.execute("PRAGMA user_version = 99")
    raw.close()
    before = db_path.read_bytes()

    with pytest.raises(InputError) as info:
        Store(db_path)
    assert info.value.exit_code == EXIT_CONFIG == 78
    assert "upgrade nccltune" in str(info.value)
    assert str(db_path) in str(info.value)
    assert db_path.read_bytes() == before
    assert list(db_path.parent.glob("*.corrupt-*")) == []


def test_unopenable_path_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        Store(tmp_path / "missing-dir" / "history.db")
    assert info.value.exit_code == EXIT_CONFIG
    assert not (tmp_path / "missing-dir").exists()


def test_migrations_run_once_and_data_survives_reopen(db_path: Path) -> None:
    with Store(db_path) as s:
        run_id = _start(s)
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == 2 == migrations.schema_version()
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()

    with Store(db_path) as s:  # a second run of _migrate_v1 would fail on CREATE TABLE
        run = s.run(run_id)
        assert run is not None and run.fingerprint == "fp-a"


def test_a_later_migration_is_applied_once(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store(db_path) as s:
        run_id = _start(s)

    calls: list[int] = []

    def migrate_next(conn: sqlite3.Connection) -> None:
        calls.append(1)
        conn.execute("ALTER TABLE runs ADD COLUMN note TEXT")

    monkeypatch.setattr(migrations, "MIGRATIONS", (*migrations.MIGRATIONS, migrate_next))
    with Store(db_path) as s:
        assert s.run(run_id) is not None
    with Store(db_path) as s:
        assert s.run(run_id) is not None
    assert calls == [1]
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == 3
    raw.close()


OLD_ROWS = [
    {"size_bytes": 1024, "weight": 1.0, "default_busbw_gbps": 1.5, "default_noise_pct": 2.0,
     "tuned_busbw_gbps": 1.8, "ratio": 1.2, "default_algo_proto": "RING/LL", "tuned_algo_proto": "TREE/LL"},
    {"size_bytes": 1 << 20, "default_busbw_gbps": 10.0, "tuned_busbw_gbps": 12.5},
]


def _version_1_file(path: Path, runs: list[tuple[str, dict[str, Any]]]) -> list[int]:
    """A history file as a version-1 nccltune wrote it: report rows inside summary_json."""
    raw = sqlite3.connect(path)
    migrations.MIGRATIONS[0](raw)
    raw.execute("PRAGMA user_version = 1")
    ids = []
    for kind, summary in runs:
        cur = raw.execute(
            "INSERT INTO runs (started_at, finished_at, status, kind, fingerprint, backend, demo, nccltune_version,"
            " hostname, topology_json, config_json, summary_json) VALUES (?, ?, 'ok', ?, 'fp-a', 'gloo', 1, '0.1.0',"
            " 'node1', '{}', '{}', ?)",
            ("2026-01-01T00:00:00.000000+00:00", "2026-01-01T00:01:00.000000+00:00", kind,
             json.dumps(summary, sort_keys=True)))
        assert cur.lastrowid is not None
        ids.append(cur.lastrowid)
    trial = raw.execute("INSERT INTO trials (run_id, seq, phase, label, env_json, status, started_at) VALUES"
                        " (?, 1, 'baseline', 'defaults', '{}', 'ok', '2026-01-01T00:00:30.000000+00:00')", (ids[0],))
    raw.execute("INSERT INTO measurements (trial_id, size_bytes, time_us, algbw_gbps, busbw_gbps, correct)"
                " VALUES (?, 1024, 10.0, 1.5, 1.5, 1)", (trial.lastrowid,))
    raw.commit()
    raw.close()
    return ids


def test_a_version_1_file_keeps_its_report_rows_as_a_table(db_path: Path) -> None:
    sweep, verify = _version_1_file(db_path, [
        ("sweep", {"chosen": "NCCL_ALGO=Tree", "rows": OLD_ROWS}),
        ("verify", {"rows": [{"size_bytes": 8, "ok": True}]}),
    ])
    with Store(db_path) as s:
        run = s.run(sweep)
        assert run is not None
        assert [r.size_bytes for r in run.rows] == [1024, 1 << 20]
        assert run.rows[0] == ReportRow(1024, 1.0, 1.5, 2.0, 1.8, 1.2, "RING/LL", "TREE/LL")
        # What the old row left out: every size weighed, no noise known, the ratio of the medians.
        assert (run.rows[1].weight, run.rows[1].default_noise_pct, run.rows[1].ratio) == (1.0, 0.0, 1.25)
        assert run.summary is not None and run.summary["chosen"] == "NCCL_ALGO=Tree"
        assert [r["size_bytes"] for r in run.summary["rows"]] == [1024, 1 << 20]
        # A verify run's rows are verify's own (measured against expected), left where they were.
        other = s.run(verify)
        assert other is not None and other.rows == () and other.summary == {"rows": [{"size_bytes": 8, "ok": True}]}
        (m,) = s.trials(sweep)[0].measurements
        assert (m.busbw_gbps, m.collective, m.channels, m.gpu_time_us) == (1.5, "all_reduce", None, None)
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == migrations.schema_version()
    stored = raw.execute("SELECT summary_json FROM runs WHERE id = ?", (sweep,)).fetchone()[0]
    assert json.loads(stored) == {"chosen": "NCCL_ALGO=Tree"}
    assert raw.execute("SELECT COUNT(*) FROM report_rows WHERE run_id = ?", (sweep,)).fetchone()[0] == 2
    raw.close()


def test_report_rows_and_new_measurement_fields_round_trip(store: Store) -> None:
    run_id = _start(store)
    store.add_trial(run_id, seq=1, phase="baseline", label="defaults", env={}, status="ok",
                    measurements=[Measurement(4096, 9.0, 0.4, 0.5, algo="RING", proto="LL", channels=4,
                                              gpu_time_us=8.5, collective="all_gather")])
    rows = [ReportRow(4096, 1.0, 0.5, 1.0, 0.6, 1.2, "RING/LL", "TREE/LL"),
            ReportRow(8192, 0.0, 0.9, 0.0, 0.9, 1.0, collective="all_gather")]
    store.finish_run(run_id, status="ok", summary={"chosen": "x"}, rows=rows)
    run = store.run(run_id)
    assert run is not None and list(run.rows) == rows
    assert run.summary == {"chosen": "x", "rows": [r.as_dict() for r in rows]}
    (m,) = store.trials(run_id)[0].measurements
    assert (m.channels, m.gpu_time_us, m.collective) == (4, 8.5, "all_gather")
    with pytest.raises(ValueError, match="not finite"):
        store.finish_run(run_id, status="ok", rows=[ReportRow(1, 1.0, float("nan"), 0.0, 1.0, 1.0)])
    with pytest.raises(ValueError, match="go in `rows`"):
        store.finish_run(run_id, status="ok", summary={"rows": []}, rows=rows)


def test_mark_interrupted(store: Store) -> None:
    done = _start(store)
    store.finish_run(done, status="ok")
    crashed_a = _start(store)
    crashed_b = _start(store, kind="verify")

    assert store.mark_interrupted() == 2
    statuses = {r.id: (r.status, r.finished_at) for r in store.runs()}
    assert statuses[crashed_a] == ("interrupted", None)
    assert statuses[crashed_b] == ("interrupted", None)
    assert statuses[done][0] == "ok"
    assert store.mark_interrupted() == 0


def test_two_connections_write_the_same_file(db_path: Path) -> None:
    with Store(db_path) as a, Store(db_path) as b:
        ids = []
        for _ in range(5):
            ids.append(_start(a, "fp-a"))
            ids.append(_start(b, "fp-b"))
        _baseline_trial(b, ids[0], 0, {1024: 1.0})
        a.finish_run(ids[0], status="ok")
        assert sorted(r.id for r in a.runs(limit=None)) == sorted(ids)
        assert sorted(r.id for r in b.runs(limit=None)) == sorted(ids)
        assert [m.busbw_gbps for t in a.trials(ids[0]) for m in t.measurements] == [1.0]  # b's trial, seen by a

        # While another connection holds the write lock, a write waits (busy timeout) instead of
        # failing at once, and goes through when the lock is released.
        holder = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")
        release = threading.Timer(0.3, holder.execute, args=("COMMIT",))
        release.start()
        started = time.monotonic()
        late = _start(a)
        waited_s = time.monotonic() - started
        release.join()
        holder.close()
        assert waited_s >= 0.2
        assert b.run(late) is not None


def test_lock_held_past_the_busy_timeout_is_busy_error(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 100)
    with Store(db_path) as s:
        holder = sqlite3.connect(db_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(BusyError) as info:
                _start(s)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert info.value.exit_code == EXIT_BUSY
        _start(s)  # the failed attempt left no transaction open


def test_foreign_keys_and_argument_checks(store: Store) -> None:
    with pytest.raises(KeyError):
        store.add_trial(12345, seq=0, phase="baseline", label="x", env={}, status="ok")
    with pytest.raises(KeyError):
        store.finish_run(12345, status="ok")
    run_id = _start(store)
    with pytest.raises(ValueError, match="phase"):
        store.add_trial(run_id, seq=0, phase="warmup", label="x", env={}, status="ok")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="status"):
        store.finish_run(run_id, status="running")
    with pytest.raises(ValueError, match="not finite"):
        store.add_trial(
            run_id,
            seq=0,
            phase="screen",
            label="x",
            env={},
            status="ok",
            measurements=[Measurement(8, float("nan"), 1.0, 1.0)],
        )
    assert store.trials(run_id) == []  # nothing half-written
    with pytest.raises(sqlite3.IntegrityError):  # the database itself enforces the link too
        store._db.conn.execute(
            "INSERT INTO trials (run_id, seq, phase, label, env_json, status, started_at) "
            "VALUES (999, 0, 'screen', 'x', '{}', 'ok', 'now')"
        )


def test_a_version_2_file_takes_an_import_without_a_migration(db_path: Path) -> None:
    """Kinds, backends and phases are text checked in Python: a history written before imports
    existed takes one as it is (an older nccltune reading it back sees a kind it does not ask
    for), and every reader of a sweep's result still finds the sweep."""
    raw = sqlite3.connect(db_path)
    for migrate in migrations.MIGRATIONS[:2]:
        migrate(raw)
    raw.execute("PRAGMA user_version = 2")
    raw.commit()
    raw.close()
    assert migrations.schema_version() == 2
    with Store(db_path) as s:
        sweep = _start(s)
        _baseline_trial(s, sweep, 1, {1024: 5.0})
        s.finish_run(sweep, status="ok", chosen_env={})
        imported = s.start_run(kind="import", fingerprint="fp-a", backend="nccl-tests", demo=False, profile=None,
                               nccl_version="2.28.9", driver_version=None, torch_version=None,
                               nccltune_version="0.2.0", hostname="node1", topology={"nranks": 2}, config={})
        s.add_trial(imported, seq=1, phase="import", label="all_reduce_perf out of place #1", env={}, status="ok",
                    nccl={"placement": "out_of_place", "cycle": 1},
                    measurements=[Measurement(1024, 10.0, 50.0, 50.0)])
        s.finish_run(imported, status="ok", summary={"placement": "out_of_place"})
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == 2
    raw.close()
    with Store(db_path) as s:
        run = s.run(imported)
        assert run is not None and (run.kind, run.backend) == ("import", "nccl-tests")
        assert s.trials(imported)[0].phase == "import"
        latest = s.latest_run("fp-a")
        assert latest is not None and latest.id == sweep
        assert [m.busbw_gbps for t in s.trials(latest.id) for m in t.measurements] == [5.0]
        published = s.latest_published("fp-a")
        assert published is not None and published.run_id == sweep
        with pytest.raises(ValueError, match="backend"):
            s.start_run(kind="import", fingerprint="x", backend="mpi", demo=False,  # type: ignore[arg-type]
                        profile=None, nccl_version=None, driver_version=None, torch_version=None,
                        nccltune_version="0", hostname="h", topology={}, config={})
