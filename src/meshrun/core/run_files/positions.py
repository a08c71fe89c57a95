"""The watchdog's position files: where each rank is (step, operation, since when) and its
resident memory, one fixed-size record a rank in `<run dir>/watchdog/`. A rank updates its own
through a memory map (rank/watchdog.py): a memory write, no syscall, no host-device sync. The
file outlives the rank, so after a failure the driver reads every rank's last position,
whatever killed it, and names who waited in which collective and who never entered it."""

from __future__ import annotations

import mmap
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from meshrun.core.run_files.failures import FAILURES_DIR
from meshrun.core.run_files.flight_records import DUMPS_DIR, describe

POSITIONS_DIR = "watchdog"
# step, since (epoch s), resident bytes, operation ("" outside collectives); the watchdog's
# thread writes the third field, the rank the others
_RECORD = struct.Struct("<qdq88s")
_POSITION, _RSS, _OP = struct.Struct("<qd"), struct.Struct("<q"), struct.Struct("88s")


class PositionFile:
    """A rank's own record, zeroed, then mapped: each update is a memory write."""

    def __init__(self, run_dir: str, rank: int) -> None:
        path = Path(run_dir) / POSITIONS_DIR / f"rank{rank}.pos"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(_RECORD.size))
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), _RECORD.size)

    def position(self, step: int, since: float, op: str) -> None:
        _POSITION.pack_into(self._map, 0, step, since)
        _OP.pack_into(self._map, _POSITION.size + _RSS.size, op.encode())

    def resident(self, rss_bytes: int) -> None:
        _RSS.pack_into(self._map, _POSITION.size, rss_bytes)


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


def clear_records(run_dir: str) -> None:
    """Forget a previous launch's failure records and positions in this run dir (before the
    ranks start: a torchrun run's dir is its own, so there is nothing to forget)."""
    for folder in (FAILURES_DIR, POSITIONS_DIR, DUMPS_DIR):
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


def with_diagnosis(error: str, run_dir: str, failed_rank: int) -> str:
    """A rank's error, followed by where every rank was when it was inside a collective. Only
    a timeout is called a hang: a phase that communicates also computes, and an ordinary
    error raised there (a shape mismatch, say) is no hang. A hang also names the collective
    each rank's flight recorder holds (core/run_files/flight_records.py)."""
    found = diagnose(run_dir, failed_rank)
    if not found:
        return error
    timed_out = any(marker in error.lower() for marker in ("timed out", "timeout"))
    if not timed_out:
        return f"{error} -- ranks at the failure: {found}"
    world_size = len(read_positions(run_dir))
    recorded = describe(run_dir, failed_rank, world_size)
    flight = f" -- flight recorder: {recorded}" if recorded else ""
    return f"{error} -- collective hang: {found}{flight}"
