"""The CUDA caching allocator's peaks of a run, on every device it computes on: the rank's
own, or each of parallel=dataparallel's (its replicas allocate on theirs, a thread each;
the gathered outputs and the summed gradients land on the first).

torch.cuda.reset_peak_memory_stats resets every peak of a device at once, the reserved
bytes' with the allocated (torch/cuda/memory.py: reset_peak_memory_stats ->
torch._C._cuda_resetPeakMemoryStats, c10's DeviceCachingAllocator::resetPeakStats sets each
stat's peak to its current value), and the memory breakdown resets them at each of its
marks to read the peak between two. Reserved bytes fall where the allocator returns cached
segments (torch.cuda.empty_cache, or a cudaMalloc that failed and is retried after freeing
them), so a peak read after a reset may have lost the run's: the run's peaks are the
highest of every reading, each taken before its reset. Once held (the baseline beside the run about
to train on the same device, rank/train/baseline_beside.py) no later reading is the run's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshrun.core.config import ParallelConfig


@dataclass(frozen=True)
class Reading:
    """One device's counters (torch/cuda/memory.py: memory_allocated now;
    max_memory_allocated and max_memory_reserved, the highest since the last reset)."""

    live: int
    allocated_peak: int
    reserved_peak: int


class RunPeaks:
    """The run's peak allocated and reserved bytes on each device, from the readings."""

    def __init__(self, n_devices: int) -> None:
        self.allocated = [0] * n_devices
        self.reserved = [0] * n_devices
        self.held = False

    def fold(self, readings: Sequence[Reading]) -> None:
        """Counts a reading of every device (taken before a reset, or at any time)."""
        if self.held:
            return
        for i, reading in enumerate(readings):
            self.allocated[i] = max(self.allocated[i], reading.allocated_peak)
            self.reserved[i] = max(self.reserved[i], reading.reserved_peak)

    def hold(self) -> None:
        self.held = True


def read(devices: Sequence[torch.device]) -> list[Reading]:
    return [
        Reading(
            torch.cuda.memory_allocated(device),
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
        )
        for device in devices
    ]


def reset(devices: Sequence[torch.device]) -> None:
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)


def metered_devices(device: torch.device, parallel: ParallelConfig) -> list[torch.device]:
    """The devices whose memory is the rank's: DataParallel's every device (its device_ids,
    0 to n - 1: rank/parallel/dataparallel.py), else the rank's own."""
    if parallel.data_parallel == "dataparallel" and device.type == "cuda":
        return [torch.device("cuda", i) for i in range(parallel.dataparallel_devices)]
    return [device]
