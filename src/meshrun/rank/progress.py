"""Rank 0's progress bar: steps, the last log step's loss and tokens/s (rich draws nothing
when stdout is not a terminal)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)

from meshrun.core.run_files.metrics import StepRow

console = Console()


class RankProgress:
    def __init__(self, progress: Progress, task: TaskID, tokens_per_step: int) -> None:
        self._progress, self._task, self._tokens_per_step = progress, task, tokens_per_step

    def step(self, completed: int) -> None:
        self._progress.update(self._task, completed=completed)

    def show(self, records: list[StepRow]) -> None:
        """A log step's records (metrics.jsonl's): the last loss, the tokens/s of their timed
        steps."""
        times = [r.step_time_s for r in records if r.step_time_s]
        speed = f"{self._tokens_per_step * len(times) / sum(times):,.0f} tok/s" if times else ""
        self._progress.update(self._task, loss=f"loss {records[-1].loss:.4f}", speed=speed)


@contextlib.contextmanager
def rank_progress(total: int, tokens_per_step: int, enabled: bool) -> Iterator[RankProgress | None]:
    if not enabled:
        yield None
        return
    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TextColumn("{task.fields[speed]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("train", total=total, loss="", speed="")
        yield RankProgress(progress, task, tokens_per_step)
