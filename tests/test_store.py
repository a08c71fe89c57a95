"""The SQLite results store: one row per run, failed ones too; baselines found by key."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing

import pytest

from meshrun.core.record import RunRecord, flat_fields
from meshrun.driver.sinks.store import COLUMNS, ResultsStore


def result(run_id: str, created_at: str, **fields) -> dict:
    row = {
        "run_id": run_id,
        "created_at": created_at,
        "status": "completed",
        "error": None,
        "model": "tiny",
        "parallel": "single",
        "world_size": 1,
        "baseline_key": "key-a",
        "fingerprint_key": "host-a",
        "tokens_per_s": 100.0,
        "losses": [5.0, 4.5],
    }
    return {**row, **fields}


@pytest.fixture
def store(tmp_path) -> ResultsStore:
    return ResultsStore(tmp_path / "nested" / "meshrun.db")


def test_store_creates_its_directory_and_starts_empty(tmp_path):
    path = tmp_path / "a" / "b" / "meshrun.db"
    assert ResultsStore(path).runs() == []
    assert path.is_file()


def test_record_keeps_the_full_results_dict(store):
    row = result("r1", "2024-01-01T00:00:00+00:00", memory_per_rank=[{"rank": 0, "peak": 2}])
    store.record(row)
    assert store.runs() == [RunRecord.from_dict(row).as_dict()]
    assert store.records() == [RunRecord.from_dict(row)]


def test_rows_of_an_older_meshrun_read_as_todays_record(store):
    """Renamed keys followed, unknown ones dropped, missing ones defaulted; a store without
    today's columns gets them."""
    old = result("r1", "2024-01-01", pp_microbatches=4, extra={"nested": [1, 2]})
    del old["losses"], old["fingerprint_key"]
    with closing(sqlite3.connect(store.path)) as db, db:
        db.execute("DROP TABLE runs")
        db.execute(
            "CREATE TABLE runs (run_id TEXT PRIMARY KEY, created_at TEXT, status TEXT, "
            "baseline_key TEXT, world_size INTEGER, parallel TEXT, results_json TEXT)"
        )
        db.execute(
            "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)",
            ("r1", "2024-01-01", "completed", "key-a", 1, "single", json.dumps(old)),
        )
    reopened = ResultsStore(store.path)
    (record,) = reopened.records()
    assert (
        record.pipeline.n_microbatches == 4
        and record.series.losses == []
        and record.layout_name is None
    )
    assert "extra" not in reopened.runs()[0]
    # measured where, nobody knows: never reused as a stored baseline
    assert record.host.fingerprint_key is None
    assert reopened.find_baseline("key-a", "host-a", since="2000-01-01") is None
    with closing(sqlite3.connect(store.path)) as db:
        present = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    assert set(COLUMNS) <= present


def test_store_columns_are_the_records_with_sqlite_types():
    assert COLUMNS["run_id"] == "TEXT PRIMARY KEY"
    assert COLUMNS["world_size"] == "INTEGER" and COLUMNS["tokens_per_s"] == "REAL"
    assert COLUMNS["layout_name"] == "TEXT" and COLUMNS["results_json"] == "TEXT"
    assert "losses" not in COLUMNS  # series stay in results_json
    assert set(COLUMNS) - {"results_json"} <= {f.name for _, f in flat_fields()}


def test_find_baseline_returns_the_newest_completed_single_device_run_of_key_and_host(store):
    rows = [
        result("old", "2024-01-01T00:00:00+00:00", tokens_per_s=90.0),
        result("newest-ok", "2024-01-03T00:00:00+00:00", tokens_per_s=110.0),
        result("middle", "2024-01-02T00:00:00+00:00"),
        # Newer still, but each disqualified by one column:
        result("failed", "2024-01-04T00:00:00+00:00", status="failed", error="boom"),
        result("ddp", "2024-01-05T00:00:00+00:00", parallel="ddp", world_size=2),
        result("wide", "2024-01-06T00:00:00+00:00", world_size=2),
        result("other-key", "2024-01-07T00:00:00+00:00", baseline_key="key-b"),
        result("other-host", "2024-01-08T00:00:00+00:00", fingerprint_key="host-b"),
    ]
    for row in rows:
        store.record(row)
    baseline = store.find_baseline("key-a", "host-a", since="2024-01-01T00:00:00+00:00")
    assert baseline is not None
    assert baseline.run_id == "newest-ok"
    assert baseline.speed.tokens_per_s == 110.0
    assert store.find_baseline("key-b", "host-a", since="2024-01-01").run_id == "other-key"
    assert store.find_baseline("key-a", "host-b", since="2024-01-01").run_id == "other-host"
    # too old: measured before `since`
    assert store.find_baseline("key-a", "host-a", since="2024-01-03T00:00:01+00:00") is None


def test_find_baseline_is_none_without_a_matching_completed_run(store):
    since = "2000-01-01"
    assert store.find_baseline("key-a", "host-a", since) is None
    store.record(result("failed", "2024-01-01T00:00:00+00:00", status="failed", error="x"))
    store.record(result("ddp", "2024-01-02T00:00:00+00:00", parallel="ddp", world_size=2))
    assert store.find_baseline("key-a", "host-a", since) is None
    assert store.find_baseline("no-such-key", "host-a", since) is None


def test_failed_runs_are_stored_with_their_error(store):
    failed = result(
        "f1",
        "2024-01-01T00:00:00+00:00",
        status="failed",
        error="rank 1 failed at step 3: RuntimeError: injected",
        tokens_per_s=None,
        losses=[5.0, 4.9, 4.8],
    )
    store.record(failed)
    (stored,) = store.runs()
    assert stored["status"] == "failed"
    assert stored["error"] == failed["error"]
    assert stored["losses"] == [5.0, 4.9, 4.8]
    with closing(sqlite3.connect(store.path)) as db:
        columns = db.execute("SELECT status, error, tokens_per_s FROM runs").fetchone()
    assert columns == ("failed", failed["error"], None)


def test_runs_returns_every_row_oldest_first(store):
    for run_id, created in [("b", "2024-01-02"), ("c", "2024-01-03"), ("a", "2024-01-01")]:
        store.record(result(run_id, created, status="completed" if run_id != "c" else "failed"))
    assert [r["run_id"] for r in store.runs()] == ["a", "b", "c"]


def test_recording_the_same_run_id_again_replaces_the_row(store):
    store.record(result("r1", "2024-01-01", tokens_per_s=1.0))
    store.record(result("r1", "2024-01-01", tokens_per_s=2.0))
    (row,) = store.runs()
    assert row["tokens_per_s"] == 2.0


def test_two_store_objects_on_one_file_see_each_others_rows(tmp_path):
    path = tmp_path / "shared.db"
    ResultsStore(path).record(result("r1", "2024-01-01"))
    ResultsStore(path).record(result("r2", "2024-01-02"))
    assert [r["run_id"] for r in ResultsStore(path).runs()] == ["r1", "r2"]
