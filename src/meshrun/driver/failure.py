"""What a failed run leaves behind, made whole: the steps its ranks finished after the last
log step (each rank wrote its own as it failed; core/run_files/failures.py), and why a rank
that died without a word died, in the run's memory terms (the plan's prediction, the rank's
last resident sample, the host, the kernel's OOM counter)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from meshrun.core.config import ExperimentConfig
from meshrun.core.hardware import HostFacts, oom_kills
from meshrun.core.layout import Layout, dp_rank, rank_coords
from meshrun.core.run_files.failures import read_unflushed
from meshrun.core.run_files.memory_snapshots import VIEWER, snapshot_path
from meshrun.core.run_files.metrics import StepRow
from meshrun.core.run_files.positions import read_positions
from meshrun.driver.launch import SIGNAL_UNSEEN, RankFailure
from meshrun.plan.run_prediction import prediction_of

GiB = 2**30


def with_unflushed(steps: list[StepRow], run_dir: str, layout: Layout) -> list[StepRow]:
    """metrics.jsonl's steps, then those the ranks wrote as they failed. A step's loss is the
    mean over the DP ranks of the last pipeline stage (any TP peer of each), in the float32
    arithmetic of the log step's reduction; where some of them wrote nothing (killed), the
    mean of the others, marked `partial_loss`. Grad norm and LR are global; step time and data
    wait are the lowest rank's, as rank 0's are logged. The steps stop at the first without
    any loss (its last stage died first)."""
    written: dict[int, dict[int, StepRow]] = {}
    for rank, records in read_unflushed(run_dir).items():
        for record in records:
            written.setdefault(record.step, {})[rank] = record
    step = steps[-1].step + 1 if steps else min(written, default=0)
    last_stage = [
        r for r in range(layout.world_size) if rank_coords(layout, r)["pp"] == layout.pp - 1
    ]
    completed = list(steps)
    while step in written:
        by_rank = written[step]
        losses = {}
        for rank in last_stage:  # rank order: each DP index's first TP peer that wrote
            if rank in by_rank:
                losses.setdefault(dp_rank(layout, rank), by_rank[rank].loss)
        if not losses:
            break
        total = torch.tensor(list(losses.values()), dtype=torch.float32).sum()
        partial = True if len(losses) < layout.dp_size else None
        loss = (total / len(losses)).item()
        completed.append(replace(by_rank[min(by_rank)], loss=loss, partial_loss=partial))
        step += 1
    return completed


def explained(cfg: ExperimentConfig, wait: Callable[[], Any]) -> Callable[[], Any]:
    """`wait`, with a rank that died for memory (or was killed the way the kernel kills for
    it) told in the run's figures."""

    def waited() -> Any:
        kills = oom_kills()
        try:
            return wait()
        except RankFailure as failure:
            raise explain(cfg, failure, kills) from None

    return waited


def explain(cfg: ExperimentConfig, failure: RankFailure, kills_before: int | None) -> RankFailure:
    if failure.error.startswith("OutOfMemoryError"):  # torch's, CUDA's allocator
        predicted = _gib(prediction_of(cfg).memory[failure.rank]["peak"])
        error = f"{failure.error} (predicted peak {predicted} per rank by the plan)"
        snapshot = snapshot_path(cfg.run_dir, failure.rank, "oom")
        if snapshot.exists():  # debug.memory_snapshot
            error += f"; the allocator's history up to it: {snapshot} (open it at {VIEWER})"
        elif cfg.hardware.device_type == "cuda":
            error += "; debug.memory_snapshot=true records what held the memory"
        return RankFailure(failure.rank, error, failure.traceback)
    if failure.signal not in ("SIGKILL", SIGNAL_UNSEEN):
        return failure
    kills = oom_kills()
    if kills is not None and kills_before is not None and kills > kills_before:
        cause = (
            f"by the kernel's OOM killer (this cgroup's oom_kill count rose by "
            f"{kills - kills_before} during the run)"
        )
    elif kills is not None:
        cause = "not by the kernel's OOM killer (this cgroup's oom_kill count did not change)"
    else:
        cause = "most likely out of host memory"
    position = read_positions(cfg.run_dir).get(failure.rank)
    measured = _gib(position.rss_bytes) + " resident" if position and position.rss_bytes else "n/a"
    host = HostFacts.detect().memory_gib
    peak = prediction_of(cfg).memory[failure.rank]["peak"]
    figures = (
        f"predicted peak {_gib(peak)} per rank (plan), "
        f"measured {measured} before it died, host has {host:.1f} GiB for "
        f"{cfg.launcher.nproc_per_node} rank(s)"
    )
    return RankFailure(failure.rank, f"{cause}: {figures}", failure.traceback, failure.signal)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
