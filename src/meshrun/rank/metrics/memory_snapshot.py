"""debug.memory_snapshot: CUDA's caching allocator records every allocation and free with
its stack (torch.cuda.memory._record_memory_history, the last MAX_ENTRIES, of every device:
torch/cuda/memory.py's _record_memory_history_impl does not pass its `device` argument on),
and the rank writes the history whenever a step raised the run's peak (so the file left is
the peak step's) and when it runs out of memory (core/run_files/memory_snapshots.py names
the files). The peak is the run's own, as its memory meter reads it
(metrics/memory.MemoryMeter.peaks): the breakdown's resets of torch's peak counters do not
hide an earlier step's, and once the meter holds, before the baseline beside the run trains on rank
0's device between the run's steps, no later step writes a peak snapshot, so the file holds
none of the baseline's. Reading the peaks is a host-side allocator statistic: no device sync."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest

import torch

from meshrun.core.run_files.memory_snapshots import snapshot_path

MAX_ENTRIES = 100_000  # torchtitan's default (profiling.memory_snapshot)


def raised(peaks: Sequence[int], written: Sequence[int]) -> bool:
    """Whether the run's peak on any of its devices rose above the snapshot's last written."""
    return any(peak > was for peak, was in zip_longest(peaks, written, fillvalue=0))


class MemorySnapshots:
    def __init__(self, run_dir: str, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.written: Sequence[int] = ()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    def after_step(self, peaks: Sequence[int]) -> bool:
        """`peaks`: the run's on each of its devices. True where the step raised one and its
        snapshot was written."""
        if not raised(peaks, self.written):
            return False
        self.written = tuple(peaks)
        self._dump("peak")
        return True

    def out_of_memory(self) -> None:
        self._dump("oom")

    def _dump(self, when: str) -> None:
        path = snapshot_path(self.run_dir, self.rank, when)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
