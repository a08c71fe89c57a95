"""The local results store: one SQLite row per run (failed ones too), with the full results
JSON beside the columns one filters and compares on. Baselines are found here by key."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

COLUMNS = {
    "run_id": "TEXT PRIMARY KEY",
    "created_at": "TEXT",
    "status": "TEXT",
    "error": "TEXT",
    "name": "TEXT",
    "model": "TEXT",
    "parallel": "TEXT",
    "layout_name": "TEXT",
    "world_size": "INTEGER",
    "backend": "TEXT",
    "hardware": "TEXT",
    "precision": "TEXT",
    "seq_len": "INTEGER",
    "global_batch_size": "INTEGER",
    "micro_batch_size": "INTEGER",
    "tokens_per_s": "REAL",
    "step_time_s": "REAL",
    "speedup": "REAL",
    "scaling_efficiency": "REAL",
    "mfu": "REAL",
    "peak_memory_max_bytes": "INTEGER",
    "memory_params_bytes": "INTEGER",
    "memory_grads_bytes": "INTEGER",
    "memory_optimizer_bytes": "INTEGER",
    "memory_activations_bytes": "INTEGER",
    "memory_other_bytes": "INTEGER",
    "predicted_peak_memory_bytes": "INTEGER",
    "predicted_step_time_s": "REAL",
    "bubble_measured": "REAL",
    "bubble_theoretical": "REAL",
    "baseline_key": "TEXT",
    "role": "TEXT",
    "run_dir": "TEXT",
    "results_json": "TEXT",
}


class ResultsStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            columns = ", ".join(f"{name} {kind}" for name, kind in COLUMNS.items())
            db.execute(f"CREATE TABLE IF NOT EXISTS runs ({columns})")
            # A store written by an older meshrun lacks newer columns: add them.
            present = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
            for name, kind in COLUMNS.items():
                if name not in present:
                    db.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # A generous busy timeout: sweep jobs and torchrun ranks may write at the same time.
        db = sqlite3.connect(self.path, timeout=60)
        try:
            with db:
                yield db
        finally:
            db.close()

    def record(self, results: dict[str, Any]) -> None:
        row = {name: results.get(name) for name in COLUMNS if name != "results_json"}
        row["results_json"] = json.dumps(results)
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._connect() as db:
            db.execute(
                f"INSERT OR REPLACE INTO runs ({names}) VALUES ({marks})", list(row.values())
            )

    def find_baseline(self, key: str) -> dict[str, Any] | None:
        """The newest completed single-device run measured under `key`."""
        with self._connect() as db:
            row = db.execute(
                "SELECT results_json FROM runs WHERE baseline_key = ? AND status = 'completed' "
                "AND world_size = 1 AND parallel = 'single' ORDER BY created_at DESC LIMIT 1",
                (key,),
            ).fetchone()
        return json.loads(row[0]) if row else None

    def runs(self) -> list[dict[str, Any]]:
        with self._connect() as db:
            rows = db.execute("SELECT results_json FROM runs ORDER BY created_at").fetchall()
        return [json.loads(r[0]) for r in rows]
