"""`meshrun-plan calibrate`'s checkpoint rates (plan/checkpoint_cost.py): how fast a node
writes to the checkpoint dir, every rank a file of its own at once, each synced to disk as
DCP's FileSystemWriter syncs its files (`sync_files=True`); and how fast a rank stages its
state into host memory as `dcp.async_save` does, with torch's own DefaultStager made afresh
(async_save makes one a save: no pinned or cached storage, so every save's copy lands in
memory never touched)."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail

BYTES_PER_RANK = 64 * 2**20  # per rank, per figure: seconds of I/O, not of noise
GB = 1e9


def storage_dir(cfg: ExperimentConfig) -> Path:
    """Where the runs' checkpoints go: checkpoint.dir where given, else beside the results
    store, where runs' own dirs (and their checkpoints/) are by default."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.store.path).parent


def write_rate(directory: Path, ranks: int) -> float:
    """GB/s the node wrote, its `ranks` writers at once; refused where the disk has no room."""
    directory.mkdir(parents=True, exist_ok=True)
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    if free < 2 * ranks * BYTES_PER_RANK:
        fail(
            "checkpoint.dir",
            str(directory),
            f"has {free / 2**20:.0f} MiB free; calibrate writes {ranks * BYTES_PER_RANK >> 20} MiB",
            "a checkpoint dir on a disk with room",
        )
    data = os.urandom(BYTES_PER_RANK)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".meshrun-calibrate-") as tmp:

        def write(rank: int) -> None:
            with open(Path(tmp) / f"rank{rank}", "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        started = time.perf_counter()
        with ThreadPoolExecutor(ranks) as pool:
            list(pool.map(write, range(ranks)))
        took = time.perf_counter() - started
    return ranks * BYTES_PER_RANK / took / GB


def staging_rate(ranks: int, cuda: bool) -> float:
    """GB/s one rank staged a state of BYTES_PER_RANK, the `ranks` staging at once (threads:
    the copies release the GIL), from its device (rank r's GPU) into host memory."""
    numel = BYTES_PER_RANK // 4

    def stage(rank: int) -> float:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        state = {"weight": torch.ones(numel, device=device)}
        stager = DefaultStager(StagingOptions(False, False, False, False))
        started = time.perf_counter()
        stager.stage(state)
        took = time.perf_counter() - started
        stager.close()
        return took

    with ThreadPoolExecutor(ranks) as pool:
        slowest = max(pool.map(stage, range(ranks)))
    return BYTES_PER_RANK / slowest / GB
