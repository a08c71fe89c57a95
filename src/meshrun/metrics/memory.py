"""Peak tensor memory of one rank.

CUDA: the caching allocator's own peak (`max_memory_allocated`) over the whole run.
CPU: torch has no allocator statistics there, so the profiler records every allocation and
free of the CPU allocator (profile_memory) from before the model is built to the end of the
warmup steps; the peak of the running sum is the measured peak. Steady-state steps repeat the
warmup steps' pattern, and keeping the profiler out of timed steps keeps timings honest.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints start/stop lines from C++ to fd 2 whatever its log level."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class MemoryMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profiler: profile | None = None
        self._cpu_peak: int | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profiler.__enter__()

    def stop_tracing(self) -> None:
        """End CPU allocation tracing (call after the warmup steps)."""
        if self._profiler is None:
            return
        with _quiet_stderr():
            self._profiler.__exit__(None, None, None)
        events = self._profiler.profiler.kineto_results.events()
        changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        live = peak = 0
        for _, nbytes in changes:
            live += nbytes
            peak = max(peak, live)
        self._cpu_peak = peak
        self._profiler = None

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        self.stop_tracing()
        return int(self._cpu_peak or 0)
