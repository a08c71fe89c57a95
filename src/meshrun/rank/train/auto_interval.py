"""checkpoint.every_steps=auto on the ranks: the plan's interval between two saves (seconds,
driver/run_plan.py: Young/Daly at the plan's save cost and failure rate) in steps of the
step time this run measures, over its first TIMED_STEPS timed steps. Each rank's clock
reads its own times; rank 0's choice is broadcast at the log step where they are all in
(every rank logs at the same steps), so that every rank saves at the same steps."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch.distributed as dist

from meshrun.core.rank_report import AutoCheckpoint
from meshrun.rank.progress import console

TIMED_STEPS = 3  # timed steps measured before the interval is turned into steps


def steps_between(interval_s: float, step_s: float) -> int:
    """The steps whose time is nearest the interval, at least one."""
    return max(1, round(interval_s / step_s))


@dataclass
class AutoInterval:
    """`interval_s`, `why`: the plan's (Resolved.checkpoint_interval_s, _why); `group`: a
    process group the main thread alone uses (none: one process)."""

    interval_s: float
    why: str
    group: dist.ProcessGroup | None
    rank: int
    times: list[float] = field(default_factory=list)
    chosen: AutoCheckpoint | None = None

    def measured(self, times: list[float]) -> int | None:
        """A log step's step times; the steps between saves once TIMED_STEPS are in (the
        same on every rank), else None."""
        if self.chosen is not None:
            return None
        self.times += times
        if len(self.times) < TIMED_STEPS:
            return None
        step_s = statistics.median(self.times[:TIMED_STEPS])
        choice = [AutoCheckpoint(steps_between(self.interval_s, step_s), step_s, self.interval_s)]
        if self.group is not None:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        self.chosen = choice[0]
        if self.rank == 0:
            said = f"meshrun: checkpoint.every_steps=auto: {self.chosen.describe(self.why)}"
            console.print(said, soft_wrap=True, highlight=False, markup=False)
        return self.chosen.every_steps
