"""Rank 0's writer of the run's per-step records (metrics.jsonl, core/run_files/metrics.py):
each log step's appended as it happens, then handed to the sinks (the progress bar)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from meshrun.core.atomic_write import write_atomic
from meshrun.core.run_files.metrics import ROLLED_BACK_FILE

Sink = Callable[[list[dict[str, Any]]], None]


class MetricsLog:
    """Rank 0 appends each log step's records at once, so a crash keeps the steps done; then
    each sink (the progress bar) sees them."""

    def __init__(self, path: Path | None, sinks: Iterable[Sink] = ()) -> None:
        self.path = path
        self.sinks = list(sinks)

    def keep_before(self, step: int) -> list[dict[str, Any]]:
        """Drops the steps from `step` on, which a run resumed at `step` trains again, and
        returns them. The kept steps go to a new file that replaces the old one: a reader
        following the file (driver/sinks/live.py) sees a new inode, never a file cut under
        its offset."""
        if self.path is None or not self.path.exists():
            return []
        lines = [(line, json.loads(line)) for line in self.path.read_text().splitlines() if line]
        write_atomic(self.path, "".join(line + "\n" for line, r in lines if r["step"] < step))
        return [r for _, r in lines if r["step"] >= step]

    def roll_back(self, step: int, rollback: int) -> None:
        """train.guard's rollback to `step`: the steps from it on move to rolled_back.jsonl,
        each marked with the rollback's number (from 1), and are trained again."""
        undone = self.keep_before(step)
        if undone:
            with self.path.with_name(ROLLED_BACK_FILE).open("a") as f:
                f.writelines(json.dumps({**r, "rollback": rollback}) + "\n" for r in undone)

    def __call__(self, records: list[dict[str, Any]]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        for sink in self.sinks:
            sink(records)
