"""Rank 0's writer of the run's per-step records (metrics.jsonl, core/run_files/metrics.py):
each log step's appended as it happens, then handed to the sinks (the progress bar)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from meshrun.core.atomic_write import write_atomic
from meshrun.core.run_files.metrics import ROLLED_BACK_FILE, StepRow, step_line

Sink = Callable[[list[StepRow]], None]


class MetricsLog:
    """Rank 0 appends each log step's records at once, so a crash keeps the steps done; then
    each sink (the progress bar) sees them."""

    def __init__(self, path: Path | None, sinks: Iterable[Sink] = ()) -> None:
        self.path = path
        self.sinks = list(sinks)

    def keep_before(self, step: int) -> list[StepRow]:
        """Drops the steps from `step` on, which a run resumed at `step` trains again, and
        returns them. The kept steps go to a new file that replaces the old one: a reader
        following the file (driver/sinks/live.py) sees a new inode, never a file cut under
        its offset."""
        if self.path is None or not self.path.exists():
            return []
        text = self.path.read_text()
        lines = [(line, StepRow.from_json(json.loads(line))) for line in text.splitlines() if line]
        write_atomic(self.path, "".join(line + "\n" for line, r in lines if r.step < step))
        return [r for _, r in lines if r.step >= step]

    def roll_back(self, step: int, rollback: int) -> None:
        """train.guard's rollback to `step`: the steps from it on move to rolled_back.jsonl,
        each marked with the rollback's number (from 1), and are trained again."""
        undone = self.keep_before(step)
        if undone:
            with self.path.with_name(ROLLED_BACK_FILE).open("a") as f:
                f.writelines(step_line(replace(r, rollback=rollback)) for r in undone)

    def __call__(self, records: list[StepRow]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.writelines(step_line(r) for r in records)
        for sink in self.sinks:
            sink(records)
