"""A rank's busy time each step, to name the slow rank: the CPU time its process used over
the step, per thread it computes with. On CPU ranks that is its compute: a rank blocked in a
collective uses none (gloo waits without spinning: measured, 0.002 CPU-s over a 0.3 s wait),
so the rank its peers wait for is the one with the most. Read with a clock call, no device
sync; gathered from every rank at the log steps only, riding their host sync. CUDA ranks
compute on the device, which this clock does not see: they report none.

`debug.slow_rank` / `slow_factor` make one rank a straggler on purpose: after each step it
spins (busy, as a slower device would be) until its busy time is factor x the step's."""

from __future__ import annotations

import statistics
import time

import torch

from meshrun.core.step_stats import slowest
from meshrun.rank.control_collectives import control_all_gather


class BusyClock:
    def __init__(self, threads: int, slow_factor: float = 1.0) -> None:
        self.threads, self.slow_factor = threads, slow_factor
        self._started = 0.0
        self._unlogged: list[float] = []  # since the last log step
        self.timed: list[float] = []  # the timed steps' (profiled ones left out)

    def start(self) -> None:
        self._started = time.process_time()

    def stop(self, timed: bool) -> None:
        busy = (time.process_time() - self._started) / self.threads
        if self.slow_factor > 1:
            _spin((self.slow_factor - 1) * busy * self.threads)
            busy = (time.process_time() - self._started) / self.threads
        self._unlogged.append(busy)
        if timed:
            self.timed.append(busy)

    def median(self) -> float | None:
        return statistics.median(self.timed) if self.timed else None

    def gathered(self) -> torch.Tensor:
        """Every rank's busy seconds of the steps since the last log step ([rank, step]);
        one collective of the world (a clock exists only where there are peers), which
        every rank joins at its log step."""
        mine = torch.tensor(self._unlogged, dtype=torch.float64)
        self._unlogged = []
        return control_all_gather(mine)


def busy_fields(per_rank: torch.Tensor) -> list[dict[str, float | int]]:
    """Each step's slowest rank, its busy seconds and the median of the other ranks', from
    [rank, step]."""
    fields = []
    for step in per_rank.T.tolist():
        rank, others = slowest(step)
        fields.append(
            {"slowest_rank": rank, "busy_max_s": step[rank], "busy_others_median_s": others}
        )
    return fields


def _spin(cpu_seconds: float) -> None:
    """Busy for `cpu_seconds` of this process's CPU time (not wall time: on a host with more
    work than cores, a wall-clock spin is descheduled and would add less busy time)."""
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass
