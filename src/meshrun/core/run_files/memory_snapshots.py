"""CUDA allocator snapshots (debug.memory_snapshot; rank/metrics/memory_snapshot.py): each
rank's at its peak step and on an out-of-memory error, pickles that torch's memory_viz
(https://pytorch.org/memory_viz) opens."""

from __future__ import annotations

from pathlib import Path

SNAPSHOT_DIR = "memory_snapshot"
VIEWER = "https://pytorch.org/memory_viz"


def snapshot_path(run_dir: str, rank: int, when: str) -> Path:
    """`when`: "peak" or "oom"."""
    return Path(run_dir) / SNAPSHOT_DIR / f"rank{rank}.{when}.pickle"
