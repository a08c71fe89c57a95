"""Rank 0's progress bar (rich draws nothing when stdout is not a terminal)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console()


@contextlib.contextmanager
def rank_progress(total: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """Yields `update(completed)`; rich draws nothing when stdout is not a terminal."""
    if not enabled:
        yield None
        return
    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("train", total=total)
        yield lambda completed: progress.update(task, completed=completed)
