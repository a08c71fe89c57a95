"""The local results store: one SQLite row per run (failed ones too), with the full results
JSON beside the columns one filters and compares on. Baselines are found here by key.
`meshrun-comm` runs go to their own table, `comm_runs`, in the same file."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from meshrun.core.record import RunRecord, store_columns

# The record's store columns (core/record.py), and the whole record as JSON beside them.
COLUMNS = {**store_columns(), "results_json": "TEXT"}

COMM_COLUMNS = {
    "run_id": "TEXT PRIMARY KEY",
    "created_at": "TEXT",
    "status": "TEXT",
    "error": "TEXT",
    "name": "TEXT",
    "backend": "TEXT",
    "launcher": "TEXT",
    "world_size": "INTEGER",
    "device_type": "TEXT",
    "hardware": "TEXT",
    "ops": "TEXT",
    "dtypes": "TEXT",
    "max_bytes": "INTEGER",
    "avg_busbw_gbs": "REAL",
    "peak_busbw_gbs": "REAL",
    "wrong": "INTEGER",
    "run_dir": "TEXT",
    "results_json": "TEXT",
}


def _ensure_table(db: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Create the table, or add the columns a store written by an older meshrun lacks."""
    spec = ", ".join(f"{name} {kind}" for name, kind in columns.items())
    db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({spec})")
    present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    for name, kind in columns.items():
        if name not in present:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


class ResultsStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            _ensure_table(db, "runs", COLUMNS)
            _ensure_table(db, "comm_runs", COMM_COLUMNS)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # A generous busy timeout: sweep jobs and torchrun ranks may write at the same time.
        db = sqlite3.connect(self.path, timeout=60)
        try:
            with db:
                yield db
        finally:
            db.close()

    def record(self, results: RunRecord | dict[str, Any]) -> None:
        if not isinstance(results, RunRecord):
            results = RunRecord.from_dict(results)
        self._insert("runs", COLUMNS, results.as_dict())

    def record_comm(self, report: dict[str, Any]) -> None:
        self._insert("comm_runs", COMM_COLUMNS, report)

    def _insert(self, table: str, columns: dict[str, str], results: dict[str, Any]) -> None:
        row = {name: results.get(name) for name in columns if name != "results_json"}
        row["results_json"] = json.dumps(results)
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._connect() as db:
            db.execute(
                f"INSERT OR REPLACE INTO {table} ({names}) VALUES ({marks})", list(row.values())
            )

    def find_baseline(self, key: str, fingerprint: str, since: str) -> RunRecord | None:
        """The newest completed single-device run measured under `key` on a host of
        `fingerprint`, created at `since` (UTC, ISO) or later."""
        with self._connect() as db:
            row = db.execute(
                "SELECT results_json FROM runs WHERE baseline_key = ? AND fingerprint_key = ? "
                "AND created_at >= ? AND status = 'completed' AND world_size = 1 "
                "AND parallel = 'single' ORDER BY created_at DESC LIMIT 1",
                (key, fingerprint, since),
            ).fetchone()
        return RunRecord.from_dict(json.loads(row[0])) if row else None

    def records(self) -> list[RunRecord]:
        """Every run's record, oldest first; rows of older meshruns read as today's record
        (renamed keys followed, missing ones defaulted, unknown ones dropped)."""
        return [RunRecord.from_dict(row) for row in self._rows("runs")]

    def runs(self, table: str = "runs") -> list[dict[str, Any]]:
        """Every row's full record as a dict, oldest first (`comm_runs`: meshrun-comm's)."""
        if table == "runs":
            return [record.as_dict() for record in self.records()]
        return self._rows(table)

    def _rows(self, table: str) -> list[dict[str, Any]]:
        with self._connect() as db:
            rows = db.execute(f"SELECT results_json FROM {table} ORDER BY created_at").fetchall()
        return [json.loads(r[0]) for r in rows]


def stored_records(path: Path) -> list[RunRecord]:
    """Every run's record in the store at `path`, read without writing (no store there: none),
    for a command that reads what runs measured (meshrun-plan's band)."""
    if not path.is_file():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT results_json FROM runs ORDER BY created_at").fetchall()
    except sqlite3.OperationalError:  # a store of meshrun-comm's runs alone: no runs table
        return []
    finally:
        db.close()
    return [RunRecord.from_dict(json.loads(r[0])) for r in rows]
