"""Hang watchdog: where each rank is (step, operation, since when), so that a collective
that times out names who waited where and who never arrived.

Each rank keeps its position in a small memory-mapped file in the run dir
(core/run_files/positions.py): an update is a memory write (no syscall, no host-device sync),
and the file outlives the rank, so the driver reads every rank's last position after a
failure, whatever killed the rank (an exception, or the NCCL watchdog's abort). The backend's
own timeout (`backend.timeout_s`) normally ends a stuck collective. When it does not fire
(NCCL blocked while setting up a communicator, say), this rank's watchdog thread records the
failure and exits `GRACE_S` later, so the launcher tears all ranks down either way; it does
so only in phases that are one collective, since a phase that also computes (a training
step's forward/backward) may legitimately run longer.

When a failing peer asks for every rank's flight recorder (rank/flight_recorder.py), this
thread writes this rank's, whatever the main thread is stuck in.

The thread also samples the rank's resident memory into the same file each second: a rank
the kernel kills for memory records nothing itself, and its last sample is the figure the
driver reports.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from meshrun.core.layout import DIMENSIONS
from meshrun.core.run_files.failures import record_failure
from meshrun.core.run_files.positions import PositionFile
from meshrun.rank import flight_recorder
from meshrun.rank.profiling import phase

GRACE_S = 5.0


class CollectiveHang(RuntimeError):
    """A collective outlived the backend's timeout without the backend noticing."""


class Watchdog:
    def __init__(self, run_dir: str, rank: int, world_size: int, timeout_s: float) -> None:
        self._file = PositionFile(run_dir, rank)
        self.run_dir, self.rank, self.timeout_s = run_dir, rank, timeout_s
        self.world_size = world_size
        self._step, self._op, self._since, self._bounded = -1, "", time.time(), False
        self._stop = threading.Event()
        self._set(-1, "")
        self._file.resident(_resident_bytes())
        threading.Thread(target=self._watch, name="meshrun-watchdog", daemon=True).start()

    def _set(self, step: int, op: str, bounded: bool = False) -> None:
        self._step, self._op, self._since, self._bounded = step, op, time.time(), bounded
        self._file.position(step, self._since, op)

    def at(self, step: int) -> None:
        """This rank works on `step`, outside any collective."""
        self._set(step, "")

    @contextmanager
    def inside(self, step: int, op: str, one_collective: bool = False) -> Iterator[None]:
        """`op` (which runs collectives) of `step`; `one_collective`: it is a single collective,
        bounded by the timeout. Left only on success: after a failure the position stays, for
        the diagnosis."""
        self._set(step, op, one_collective)
        yield
        self._set(step, "")

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        dumped = False
        while not self._stop.wait(1.0):
            self._file.resident(_resident_bytes())
            if not dumped and flight_recorder.requested(self.run_dir):
                flight_recorder.dump(self.run_dir, self.rank)
                dumped = True
            op, step, stuck_s = self._op, self._step, time.time() - self._since
            if op and self._bounded and stuck_s > self.timeout_s + GRACE_S:
                hang = CollectiveHang(
                    f"rank {self.rank} stuck in {op} at step {step} for {stuck_s:.0f} s, past "
                    f"backend.timeout_s={self.timeout_s:g} (the backend did not time out)"
                )
                record_failure(self.run_dir, self.rank, hang)
                flight_recorder.dump_all(self.run_dir, self.rank, self.world_size)
                os._exit(1)


@contextmanager
def inside(
    watchdog: Watchdog | None, step: int, op: str, *, one_collective: bool
) -> Iterator[None]:
    """`watchdog.inside(...)` (nothing where the run has none: a single rank), named in a
    profiled step's trace too."""
    with phase(op), watchdog.inside(step, op, one_collective) if watchdog else nullcontext():
        yield


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step_collectives(degrees: dict[str, int]) -> str:
    """What a training step's forward/backward communicates under a layout's degrees."""
    used = [dim.collectives for dim in DIMENSIONS if degrees.get(dim.name, 1) > 1]
    return f"forward/backward ({', '.join(used)})" if used else "forward/backward"
