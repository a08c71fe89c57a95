"""What happens after a step where it is due: the log step (one reduction of the buffered
losses, one read of the step clock, the records written, every rank's busy time, the guard's
judgement of the norms and losses), then a checkpoint, or instead, where a loss spiked, the
rollback to the last one (rank/train/guard.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from meshrun.core.config import TrainConfig
from meshrun.core.run_files.metrics import StepRow
from meshrun.models import moe
from meshrun.rank.mesh import mean_over_ranks
from meshrun.rank.metrics.busy import busy_fields
from meshrun.rank.profiling import StepProfiler
from meshrun.rank.train.context import LoopContext
from meshrun.rank.train.data import LocalBatches
from meshrun.rank.train.guard import Spike
from meshrun.rank.train.pending import PendingSteps, step_records
from meshrun.rank.watchdog import inside


def log_and_save(
    step: int,
    cfg: TrainConfig,
    batches: LocalBatches,
    ctx: LoopContext,
    evaluated: dict[str, float] | None,
) -> Spike | None:
    """After `step`: the log step where due, then a checkpoint (on a stop signal: the last);
    a loss spike the log step found instead, which no checkpoint may keep."""
    checkpoints = ctx.checkpoints
    stop = save = False
    if checkpoints is not None:
        if step + 1 < cfg.steps:  # after the last step, the run saves and ends anyway
            with inside(ctx.watchdog, step, "all_reduce (stop signal)", one_collective=True):
                stop = checkpoints.stop_requested()
        save = stop or checkpoints.due(step + 1)
    # A checkpoint's steps are all in metrics.jsonl: a resume appends after them.
    log = evaluated or save or (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
    if log:
        op = "all_reduce (losses of the log step)"
        with inside(ctx.watchdog, step, op, one_collective=True):
            spike = _flush(ctx.pending, batches, ctx, evaluated)
        if spike is not None:
            return spike
        save = save or (checkpoints is not None and checkpoints.due(step + 1))  # auto chose
    if stop:
        with inside(ctx.watchdog, step, "checkpoint save (stop signal)", one_collective=True):
            checkpoints.stop(step + 1, batches.offset)
    if save:
        with inside(ctx.watchdog, step, "checkpoint save", one_collective=True):
            checkpoints.save(step + 1, batches.offset)
    elif checkpoints is not None:
        checkpoints.poll()
    return None


def roll_back(spike: Spike, batches: LocalBatches, ctx: LoopContext) -> int:
    """Every rank back to the last checkpoint, the data past the spike's batch; metrics.jsonl
    keeps the steps before it (those after move to rolled_back.jsonl). The step to go on at."""
    with inside(ctx.watchdog, spike.step, "checkpoint load (rollback)", one_collective=False):
        restored = ctx.checkpoints.roll_back()
    if not restored:  # no checkpoint yet (none is saved at step 0)
        raise ctx.guards.spikes.unrecoverable(spike)
    rollback = ctx.guards.spikes.rolled_back(spike, restored, batches.offset)
    batches.offset = rollback.skipped_batches[1] + 1 - restored
    batches.seek(restored)
    ctx.pending.first_step = restored
    ctx.pending.clock.restart()
    if ctx.guards.on_rollback is not None:
        ctx.guards.on_rollback(restored, len(ctx.guards.spikes.rollbacks))
    if ctx.replicas is not None:
        ctx.replicas.rolled_back(restored)
    return restored


def _flush(
    pending: PendingSteps,
    batches: LocalBatches,
    ctx: LoopContext,
    evaluated: dict[str, float] | None = None,
) -> Spike | None:
    """The log step: one reduction of the buffered losses, one read of the step clock.
    Gradient norms are already global (the same on every rank); data waits are this rank's;
    `evaluated`: the evaluation after the last step, into its record. The steps (and their
    data waits) leave the buffer once reduced: a peer dying in the reduction leaves them to
    the salvage. Returns a loss spike among them (train.guard.spike), judged on the reduced
    losses, the same on every rank."""
    stacked = torch.stack(pending.values)
    # the losses and any router statistics in one reduction (the norms are global already)
    reduced = mean_over_ranks(
        torch.cat([stacked[:, :1], stacked[:, 2:]], 1).contiguous(), ctx.dp_group, ctx.pp_group
    )
    values = reduced[:, 0].tolist()
    norms = stacked[:, 1].tolist()
    times = pending.clock.drain()
    if ctx.checkpoints is not None:  # checkpoint.every_steps=auto measures them
        ctx.checkpoints.measured(times)
    first_step, _, lrs = pending.take()
    records = step_records(first_step, values, norms, lrs, times, batches.drain_waits())
    if r := ctx.routers:
        routed = reduced[:, 1:]
        stats = [moe.router_fields(row.view(r.layers, -1), r.balance_loss) for row in routed]
        records = [replace(record, **f) for record, f in zip(records, stats, strict=True)]
    records[-1] = replace(records[-1], **(evaluated or {}))
    if ctx.inspection.busy is not None:  # every rank's busy time, to name the slowest
        busy = busy_fields(ctx.inspection.busy.gathered())
        records = [replace(record, **b) for record, b in zip(records, busy, strict=True)]
    if ctx.inspection.profiler is not None:
        records = [_profiled(record, ctx.inspection.profiler) for record in records]
    if ctx.replicas is not None:  # torchft: how many replicas trained each step
        records = [replace(record, **ctx.replicas.take(record.step)) for record in records]
    ctx.on_log(records)
    if ctx.guards.step is not None:  # after the steps are written: a streak stops every rank here
        ctx.guards.step.logged(first_step, norms)
    spike = ctx.guards.spikes.judge(first_step, values) if ctx.guards.spikes else None
    if ctx.guards.spikes is not None and ctx.replicas is not None:  # torchft: the groups' one
        spike = ctx.replicas.same_spike(spike)
    return spike


def _profiled(record: StepRow, profiler: StepProfiler) -> StepRow:
    """A profiled step, or the one after it, marked: both are left out of the run's timing
    (driver/inspection.py)."""
    if profiler.covers(record.step):
        return replace(record, profiled=True)
    if profiler.disturbs(record.step):
        return replace(record, after_profile=True)
    return record
