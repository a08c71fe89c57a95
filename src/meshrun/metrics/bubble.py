"""Measured pipeline bubble: the share of the pipeline's time a rank is not computing.

Busy time is what a rank spends inside its stages' forward and backward compute
(PipelineStage.forward_one_chunk / backward_one_chunk / backward_weight_one_chunk); the
pipeline's time is the whole `schedule.step` (compute, waits and transfers). Both are timed
around each call: wall clock on CPU, CUDA events on GPU (read at the end, no sync per call).
Bubble = 1 - busy / pipeline time over the timed steps, the pipeline's time being the
longest rank's: the definition of the theoretical (p-1)/(m+p-1), which leaves out what
happens outside the pipeline (optimizer, clipping).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining.schedules import _PipelineSchedule

COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class BubbleClock:
    def __init__(self, schedule: _PipelineSchedule, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False
        self.busy = _Span()
        self.pipeline = _Span()
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for method in COMPUTE_METHODS:
                if hasattr(stage, method):
                    setattr(stage, method, self._timed(getattr(stage, method), self.busy))
        schedule.step = self._timed(schedule.step, self.pipeline)

    def _timed(self, fn: Callable[..., Any], span: _Span) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                result = fn(*args, **kwargs)
                end.record()
                span.events.append((start, end))
                return result
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            span.seconds += time.perf_counter() - started
            return result

        return wrapper

    def start(self) -> None:
        """Count from now on (the first timed step)."""
        self.enabled = True

    def totals(self) -> tuple[float, float]:
        """(busy seconds, pipeline seconds) of this rank over the timed steps."""
        return self.busy.total(), self.pipeline.total()


def bubble_per_rank(busy: list[float], spans: list[float]) -> list[float]:
    """Idle share of the pipeline for each rank. The pipeline's time is the longest rank's:
    the last stage leaves `step` before the first stage's final backward, so its own span
    would hide that wait."""
    longest = max(spans)
    return [1.0 - b / longest for b in busy]


class _Span:
    """Accumulated duration of some calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def total(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) / 1e3 for a, b in self.events)
            self.events = []
        return self.seconds
