"""Step timing without host syncs in the hot loop.

On CPU, ops finish before they return, so wall-clock marks are exact. On CUDA, work is queued:
CUDA events are recorded at step boundaries and only read (one sync) at log steps.
"""

from __future__ import annotations

import statistics
import time

import torch


class StepClock:
    """Spans between marks: each mark ends the open span and starts the next; `restart`
    starts the open span again, so that what ran since the last mark (an evaluation between
    two steps) is in no span."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start = None  # the open span's start mark
        self._spans: list[tuple] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        now = self._now()
        if self._start is not None:
            self._spans.append((self._start, now))
        self._start = now

    def restart(self) -> None:
        self._start = self._now()

    def drain(self) -> list[float]:
        """Seconds of each span ended since the last drain; the open span stays open."""
        if not self._spans:
            return []
        if self.cuda:
            self._spans[-1][1].synchronize()
            seconds = [a.elapsed_time(b) / 1e3 for a, b in self._spans]
        else:
            seconds = [b - a for a, b in self._spans]
        self._spans = []
        return seconds


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
    """Median and spread (p10, p90, coefficient of variation) of the step times; throughput
    over their sum."""
    total = sum(step_times)
    mean = total / len(step_times)
    return {
        "step_time_s": statistics.median(step_times),
        "step_time_p10_s": percentile(step_times, 10),
        "step_time_p90_s": percentile(step_times, 90),
        "step_time_cv": statistics.pstdev(step_times) / mean if mean else None,
        "tokens_per_s": tokens_per_step * len(step_times) / total,
        "samples_per_s": samples_per_step * len(step_times) / total,
    }
