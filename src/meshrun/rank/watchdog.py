"""Hang watchdog: where each rank is (step, operation, since when), so that a collective
that times out names who waited where and who never arrived.

Each rank keeps its position in a small memory-mapped file in the run dir: an update is a
memory write (no syscall, no host-device sync), and the file outlives the rank, so the driver
reads every rank's last position after a failure, whatever killed the rank (an exception, or
the NCCL watchdog's abort). The backend's own timeout (`backend.timeout_s`) normally ends a
stuck collective. When it does not fire (NCCL blocked while setting up a communicator, say),
this rank's watchdog thread records the failure and exits `GRACE_S` later, so the launcher
tears all ranks down either way; it does so only in phases that are one collective, since a
phase that also computes (a training step's forward/backward) may legitimately run longer.

The thread also samples the rank's resident memory into the same file each second: a rank
the kernel kills for memory records nothing itself, and its last sample is the figure the
driver reports.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from meshrun.rank.failures import FAILURES_DIR, record_failure

POSITIONS_DIR = "watchdog"
GRACE_S = 5.0
# step, since (epoch s), resident bytes, operation ("" outside collectives); the thread
# writes the third field, the rank the others
_RECORD = struct.Struct("<qdq88s")
_POSITION, _RSS, _OP = struct.Struct("<qd"), struct.Struct("<q"), struct.Struct("88s")


class CollectiveHang(RuntimeError):
    """A collective outlived the backend's timeout without the backend noticing."""


@dataclass(frozen=True)
class Position:
    rank: int
    step: int
    op: str
    since: float
    rss_bytes: int  # resident memory, sampled each second (0: not yet)

    def where(self) -> str:
        step = f"step {self.step}" if self.step >= 0 else "before the first step"
        return f"{self.op} at {step}" if self.op else f"{step}, outside any collective"


class Watchdog:
    def __init__(self, run_dir: str, rank: int, timeout_s: float) -> None:
        path = Path(run_dir) / POSITIONS_DIR / f"rank{rank}.pos"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(_RECORD.size))
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), _RECORD.size)
        self.run_dir, self.rank, self.timeout_s = run_dir, rank, timeout_s
        self._step, self._op, self._since, self._bounded = -1, "", time.time(), False
        self._stop = threading.Event()
        self._set(-1, "")
        _RSS.pack_into(self._map, _POSITION.size, _resident_bytes())
        threading.Thread(target=self._watch, name="meshrun-watchdog", daemon=True).start()

    def _set(self, step: int, op: str, bounded: bool = False) -> None:
        self._step, self._op, self._since, self._bounded = step, op, time.time(), bounded
        _POSITION.pack_into(self._map, 0, step, self._since)
        _OP.pack_into(self._map, _POSITION.size + _RSS.size, op.encode())

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
        while not self._stop.wait(1.0):
            _RSS.pack_into(self._map, _POSITION.size, _resident_bytes())
            op, step, stuck_s = self._op, self._step, time.time() - self._since
            if op and self._bounded and stuck_s > self.timeout_s + GRACE_S:
                hang = CollectiveHang(
                    f"rank {self.rank} stuck in {op} at step {step} for {stuck_s:.0f} s, past "
                    f"backend.timeout_s={self.timeout_s:g} (the backend did not time out)"
                )
                record_failure(self.run_dir, self.rank, hang)
                os._exit(1)


def inside(
    watchdog: Watchdog | None, step: int, op: str, *, one_collective: bool
) -> AbstractContextManager[None]:
    """`watchdog.inside(...)`; nothing where the run has none (a single rank)."""
    if watchdog is None:
        return nullcontext()
    return watchdog.inside(step, op, one_collective)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def clear_records(run_dir: str) -> None:
    """Forget a previous launch's failure records and positions in this run dir (before the
    ranks start: a torchrun run's dir is its own, so there is nothing to forget)."""
    for folder in (FAILURES_DIR, POSITIONS_DIR):
        shutil.rmtree(Path(run_dir) / folder, ignore_errors=True)


def read_positions(run_dir: str) -> dict[int, Position]:
    positions = {}
    for path in (Path(run_dir) / POSITIONS_DIR).glob("rank*.pos"):
        rank = int(path.stem.removeprefix("rank"))
        step, since, rss, op = _RECORD.unpack(path.read_bytes()[: _RECORD.size])
        positions[rank] = Position(rank, step, op.rstrip(b"\0").decode(), since, rss)
    return positions


def diagnose(run_dir: str, failed_rank: int) -> str | None:
    """Who waited in which collective and who never entered it; None when the failed rank
    was not inside a collective (an ordinary error, not a hang)."""
    positions = read_positions(run_dir)
    failed = positions.get(failed_rank)
    if failed is None or not failed.op:
        return None
    waiting = [p.rank for p in positions.values() if (p.step, p.op) == (failed.step, failed.op)]
    parts = [f"{_ranks(waiting)} waited in {failed.where()}"]
    parts += [
        f"rank {p.rank} never entered it (was at {p.where()})"
        for p in sorted(positions.values(), key=lambda p: p.rank)
        if p.rank not in waiting
    ]
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    listed = ", ".join(map(str, sorted(ranks)))
    return f"rank {listed}" if len(ranks) == 1 else f"ranks {listed}"


def step_collectives(degrees: dict[str, int]) -> str:
    """What a training step's forward/backward communicates under a layout's degrees."""
    kinds = {
        "pp": "pipeline send/recv",
        "dp_replicate": "gradient all_reduce",
        "dp_shard": "FSDP all_gather/reduce_scatter",
        "tp": "tensor-parallel collectives",
    }
    used = [kinds[dim] for dim, n in degrees.items() if n > 1]
    return f"forward/backward ({', '.join(used)})" if used else "forward/backward"


def with_diagnosis(error: str, run_dir: str, failed_rank: int) -> str:
    """A rank's error, followed by where every rank was when it was inside a collective. Only
    a timeout is called a hang: a phase that communicates also computes, and an ordinary
    error raised there (a shape mismatch, say) is no hang."""
    found = diagnose(run_dir, failed_rank)
    if not found:
        return error
    timed_out = any(marker in error.lower() for marker in ("timed out", "timeout"))
    return f"{error} -- {'collective hang' if timed_out else 'ranks at the failure'}: {found}"
