"""Step timing without host syncs in the hot loop.

On CPU, ops finish before they return, so wall-clock marks are exact. On CUDA, work is queued:
CUDA events are recorded at step boundaries and only read (one sync) at log steps.
"""

from __future__ import annotations

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

    @property
    def started(self) -> bool:
        """Whether a mark has been made (the timed steps began)."""
        return self._start is not None

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
