"""Step timing without host syncs in the hot loop.

On CPU, ops finish before they return, so wall-clock marks are exact. On CUDA, work is queued:
CUDA events are recorded at step boundaries and only read (one sync) at log steps.
"""

from __future__ import annotations

import statistics
import time
from itertools import pairwise

import torch


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def drain(self) -> list[float]:
        """Seconds of each step between the marks so far; keeps the last mark as the start."""
        if len(self._marks) < 2:
            return []
        if self.cuda:
            self._marks[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in pairwise(self._marks)]
        else:
            spans = [b - a for a, b in pairwise(self._marks)]
        self._marks = self._marks[-1:]
        return spans


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize_steps(step_times: list[float], tokens_per_step: int, samples_per_step: int) -> dict:
    total = sum(step_times)
    return {
        "step_time_s": statistics.median(step_times),
        "step_time_p90_s": percentile(step_times, 90),
        "tokens_per_s": tokens_per_step * len(step_times) / total,
        "samples_per_s": samples_per_step * len(step_times) / total,
    }
