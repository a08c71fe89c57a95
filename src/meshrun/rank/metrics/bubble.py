"""Measured pipeline bubble: the share of the pipeline's time a rank is not computing.

Busy time is what a rank spends inside its stages' forward and backward compute
(PipelineStage.forward_one_chunk / backward_one_chunk / backward_weight_one_chunk, or the
compute a prefetching stage names) and, on the last stage, the loss (the schedule's
`_compute_loss`, which runs outside the stage's forward: left out, the last stage's loss
would count as idle); the pipeline's time is the whole `schedule.step` (compute, waits and
transfers). Both are timed around each call: wall clock on CPU, CUDA events on GPU (read at
the end, no sync per call).

For each timed step, bubble = 1 - busy / pipeline time, the pipeline's time being the
longest rank's: the definition of the theoretical (p-1)/(m+p-1), which leaves out what
happens outside the pipeline (optimizer, clipping). A rank's bubble is the median over the
timed steps, so that one step the host disturbed (another process, page faults of a fresh
allocation) does not stand for the schedule.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining.schedules import _PipelineSchedule

from meshrun.rank.parallel.pipeline import stage_compute


class BubbleClock:
    def __init__(self, schedule: _PipelineSchedule, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False
        self.busy = _PerStep()
        self.pipeline = _PerStep()
        for stage, method in stage_compute(schedule):
            setattr(stage, method, self._timed(getattr(stage, method), self.busy))
        schedule._compute_loss = self._timed(schedule._compute_loss, self.busy)
        schedule.step = self._timed(schedule.step, self.pipeline, starts_step=True)

    def _timed(
        self, fn: Callable[..., Any], span: _PerStep, starts_step: bool = False
    ) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            if starts_step:
                self.busy.next_step()
                self.pipeline.next_step()
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                result = fn(*args, **kwargs)
                end.record()
                span.events[-1].append((start, end))
                return result
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            span.seconds[-1] += time.perf_counter() - started
            return result

        return wrapper

    def start(self) -> None:
        """Count from now on (the first timed step)."""
        self.enabled = True

    def per_step(self) -> tuple[list[float], list[float]]:
        """(busy seconds, pipeline seconds) of this rank in each timed step."""
        return self.busy.totals(), self.pipeline.totals()


def bubble_per_rank(busy: list[list[float]], spans: list[list[float]]) -> list[float]:
    """Idle share of the pipeline for each rank (median over steps). A step's pipeline time
    is the longest rank's: the last stage leaves `step` before the first stage's final
    backward, so its own span would hide that wait."""
    longest = [max(step) for step in zip(*spans, strict=True)]
    return [
        statistics.median(1.0 - b / t for b, t in zip(mine, longest, strict=True)) for mine in busy
    ]


class _PerStep:
    """Summed duration of some calls, one total per pipeline step."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.events: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = []

    def next_step(self) -> None:
        self.seconds.append(0.0)
        self.events.append([])

    def totals(self) -> list[float]:
        if any(self.events):
            torch.cuda.synchronize()  # every recorded event has completed
        return [
            seconds + sum(a.elapsed_time(b) / 1e3 for a, b in events)
            for seconds, events in zip(self.seconds, self.events, strict=True)
        ]
