"""How busy the host was with work that is not this run's, while the run was timed.

Each rank notes its own process's CPU seconds (all its threads) over the timed steps, and
the first rank of each host the host's busy CPU seconds over the same window (/proc/stat).
What the host spent beyond the sum of its ranks' (another job, a compile, a CPU hog) is the
disturbance: as a share of all the host's cores over the window, it goes into the record and
the summary, so that a figure measured beside other work says so. Where /proc/stat is not
there (not Linux), the share is unknown.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def host_busy_s() -> float | None:
    """CPU seconds the host's cores have spent busy since boot (all but idle and iowait)."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class HostLoad:
    """One rank's window: start() at the first timed step, stop() after the last."""

    measure_host: bool  # the host's first rank reads the host's counters
    _wall: float = 0.0
    _cpu: float = 0.0
    _host: float | None = None

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        self._host = host_busy_s() if self.measure_host else None

    def stop(self) -> dict[str, object]:
        """This rank's share of the figures: its host, wall and CPU seconds, and (the host's
        first rank) the host's busy seconds and cores."""
        host = host_busy_s() if self._host is not None else None
        return {
            "host": socket.gethostname(),
            "wall_s": time.perf_counter() - self._wall,
            "cpu_s": time.process_time() - self._cpu,
            "host_busy_s": host - self._host
            if host is not None and self._host is not None
            else None,
            "host_cpus": os.cpu_count(),
        }


def other_cpu_share(ranks: list[dict[str, object]]) -> float | None:
    """The share of the first rank's host's cores that processes other than its ranks kept
    busy over the window (0 when the ranks account for all of it); None if not measured."""
    first = ranks[0]
    measured = [r for r in ranks if r["host"] == first["host"] and r["host_busy_s"] is not None]
    if not measured:
        return None
    window = measured[0]
    ours = sum(float(r["cpu_s"]) for r in ranks if r["host"] == first["host"])
    capacity = float(window["wall_s"]) * int(window["host_cpus"] or 1)
    if capacity <= 0:
        return None
    return max(0.0, float(window["host_busy_s"]) - ours) / capacity
