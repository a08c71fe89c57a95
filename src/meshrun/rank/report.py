"""What rank 0 hands the driver once the loop is done: every rank's figures of itself,
gathered in one collective, beside rank 0's own (core/rank_report.RankReport)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from meshrun.core.hardware import host_fingerprint
from meshrun.core.rank_report import CheckpointSave, RankReport, Rollback, StageSplit
from meshrun.rank.metrics.bubble import bubble_per_rank
from meshrun.rank.metrics.host import other_cpu_share
from meshrun.rank.metrics.memory import ModelState
from meshrun.rank.place import Rank
from meshrun.rank.setup import Setup
from meshrun.rank.train.context import (
    LoopContext,
    LoopState,
)
from meshrun.rank.watchdog import inside


@dataclass(frozen=True)
class RankFigures:
    """What each rank measured of itself, gathered to rank 0 for the report."""

    memory: list[dict[str, int]]  # one a device it computes on (DataParallel: several)
    pipeline_busy: list[float] | None
    pipeline_span: list[float] | None
    pretrained_read: int
    host_load: dict[str, object] | None
    compile_s: float | None
    busy_s: float | None  # the median timed step's (rank/metrics/busy.py)
    rollbacks: list[Rollback]  # train.guard.spike's, the same on every rank
    host: str  # the node it ran on


def own_figures(setup: Setup, state: LoopState, ctx: LoopContext) -> RankFigures:
    model, memory = setup.training.model, setup.memory
    split = memory.breakdowns(ModelState.of(model.parameters(), setup.training.optimizer))
    return RankFigures(
        memory=split or [{"peak": peak} for peak in memory.peaks()],
        pipeline_busy=state.pipeline_busy_per_step,
        pipeline_span=state.pipeline_span_per_step,
        pretrained_read=model.pretrained_bytes_read,
        host_load=state.host_load,
        compile_s=ctx.inspection.compiling.seconds if ctx.inspection.compiling else None,
        busy_s=ctx.inspection.busy.median() if ctx.inspection.busy else None,
        rollbacks=ctx.guards.spikes.rollbacks if ctx.guards.spikes else [],
        host=socket.gethostname(),
    )


def gathered(at: Rank, mine: RankFigures) -> list[RankFigures]:
    """Every rank's figures, on every rank (one collective, after the last step)."""
    if not dist.is_initialized():
        return [mine]
    ranks: list[Any] = [None] * dist.get_world_size()
    op = "all_gather_object (measurements)"
    with inside(at.watchdog, at.cfg.train.steps, op, one_collective=True):
        dist.all_gather_object(ranks, mine)
    return ranks


def build_report(
    at: Rank, setup: Setup, ranks: list[RankFigures], split: StageSplit | None
) -> RankReport | None:
    """Rank 0's report of the run: its own figures beside every rank's."""
    if at.rank != 0:
        return None
    cfg = at.cfg
    spans = [r.pipeline_span for r in ranks]
    loads = [r.host_load for r in ranks]
    compiled = [r.compile_s for r in ranks if r.compile_s is not None]
    checkpoints = setup.checkpoints
    return RankReport(
        memory_per_rank=[
            {"rank": i, **m} for i, m in enumerate(m for r in ranks for m in r.memory)
        ],
        fingerprint=host_fingerprint(cfg.launcher.threads_per_rank),
        resumed_from_step=setup.resumed_from_step,
        requeues=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        host_per_rank=[r.host for r in ranks],
        pipeline_bubble_per_rank=bubble_per_rank([r.pipeline_busy for r in ranks], spans)
        if ranks[0].pipeline_span
        else None,
        pp_split=split,
        pretrained_read_bytes_per_rank=[r.pretrained_read for r in ranks]
        if cfg.model.pretrained
        else None,
        baseline_steps=setup.baseline_beside.steps if setup.baseline_beside else None,
        host_other_cpu_share=other_cpu_share(loads) if all(loads) else None,
        # the ranks compile at once; the run waits for the slowest
        compile_s=max(compiled) if compiled else None,
        busy_per_rank=[r.busy_s for r in ranks] if all(r.busy_s for r in ranks) else None,
        rollbacks=ranks[0].rollbacks or None,
        checkpoint_saves=[CheckpointSave(s.step, s.blocked_s, s.total_s) for s in checkpoints.saves]
        if checkpoints
        else None,
        auto_checkpoint=checkpoints.auto.chosen if checkpoints and checkpoints.auto else None,
    )
