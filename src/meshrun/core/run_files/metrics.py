"""metrics.jsonl: the run's per-step records, a JSON object a line. Rank 0 appends each log
step's as it happens (rank/metrics/log.py); the driver follows the file while the ranks train
(its live W&B run) and reads it whole once they are done (completed or failed).
rolled_back.jsonl: the steps a train.guard rollback trained again, as they were the first
time, each with the rollback's number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshrun.core.atomic_write import write_atomic

METRICS_FILE = "metrics.jsonl"
ROLLED_BACK_FILE = "rolled_back.jsonl"
REPLICAS_DIR = "replicas"


def replica_metrics(run_dir: str, replica: int) -> Path:
    """A torchft replica's own records (replica 0's are metrics.jsonl): the same steps, the
    same global losses, written while it lives."""
    return Path(run_dir) / REPLICAS_DIR / f"replica{replica}.jsonl"


def replicas_ended(run_dir: str) -> Path:
    """Written by the driver as the first torchft replica group ends the run: a restarted one
    still waiting for a live peer stops instead of training alone."""
    return Path(run_dir) / REPLICAS_DIR / "ended"


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def fill_from_replicas(run_dir: str) -> list[int]:
    """metrics.jsonl completed with the steps replica 0 did not write (it was down, or its
    last steps died unwritten with it) from the other replicas' files; the steps filled."""
    path = Path(run_dir) / METRICS_FILE
    records = {r["step"]: r for r in read_records(path)}
    filled: list[int] = []
    for other in sorted((Path(run_dir) / REPLICAS_DIR).glob("replica*.jsonl")):
        for record in read_records(other):
            if record["step"] not in records:
                records[record["step"]] = {**record, "written_by_replica": _number(other)}
                filled.append(record["step"])
    if filled:
        write_atomic(path, "".join(json.dumps(records[s]) + "\n" for s in sorted(records)))
    return sorted(filled)


def _number(path: Path) -> int:
    return int(path.stem.removeprefix("replica"))
