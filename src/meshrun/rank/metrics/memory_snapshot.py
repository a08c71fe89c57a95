"""debug.memory_snapshot: CUDA's caching allocator records every allocation and free with
its stack (torch.cuda.memory._record_memory_history, the last MAX_ENTRIES), and the rank
writes the history whenever a step raised its peak (so the file left is the peak step's)
and when it runs out of memory (core/run_files/memory_snapshots.py names the files). Reading
the peak is a host-side allocator statistic: no device sync."""

from __future__ import annotations

import torch

from meshrun.core.run_files.memory_snapshots import snapshot_path

MAX_ENTRIES = 100_000  # torchtitan's default (profiling.memory_snapshot)


class MemorySnapshots:
    def __init__(self, run_dir: str, rank: int, device: torch.device) -> None:
        self.run_dir, self.rank, self.device = run_dir, rank, device
        self.peak = 0
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, device=device)

    def after_step(self) -> bool:
        """True where the step raised the peak and its snapshot was written."""
        peak = torch.cuda.max_memory_allocated(self.device)
        if peak <= self.peak:
            return False
        self.peak = peak
        self._dump("peak")
        return True

    def out_of_memory(self) -> None:
        self._dump("oom")

    def _dump(self, when: str) -> None:
        path = snapshot_path(self.run_dir, self.rank, when)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
