"""The training loop: one optimizer step per global batch, its rank-local share either cut
into micro-batches with gradient accumulation or handed to the pipeline schedule.

The only host syncs are at log steps (train/log_step.py), where the buffered per-step losses
are reduced and the step times read. The first `untimed_steps` are excluded from timing; they
are also where the memory breakdown is measured (and on CPU, peak memory traced). The LR
schedule steps after each optimizer step; each step's record carries the LR it trained with.

Gradients stay allocated between steps (zeroed, not freed), as in Megatron's persistent
gradient buffers: every step then holds the same memory, the sum the planner predicts,
instead of the first micro-batch of a step running lighter than the rest.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from meshrun.core.config import TrainConfig
from meshrun.models import moe
from meshrun.rank.control_collectives import control_barrier
from meshrun.rank.device import autocast
from meshrun.rank.mesh import mean_over_ranks
from meshrun.rank.metrics.bubble import BubbleClock
from meshrun.rank.metrics.memory import FWD_BWD_END, STEP_START
from meshrun.rank.parallel.accumulation import gradient_sync
from meshrun.rank.parallel.loss import loss_context, micro_batch_loss
from meshrun.rank.parallel.parallel_model import ParallelModel
from meshrun.rank.parallel.pipeline import annotate_stages
from meshrun.rank.profiling import phase, step_range
from meshrun.rank.train.context import LoopContext, LoopState
from meshrun.rank.train.data import LocalBatches
from meshrun.rank.train.log_step import log_and_save, roll_back
from meshrun.rank.train.optim import LocalGrads
from meshrun.rank.watchdog import inside


def _autocast(ctx: LoopContext) -> contextlib.AbstractContextManager:
    return autocast(ctx.device, ctx.autocast_dtype)


def _accumulate(
    model: ParallelModel, inputs, targets, micro_batch: int, ctx, factor: float
) -> torch.Tensor:
    """Forward/backward each micro-batch; gradients reduced over DP on the last one only.
    `factor`: the loss's, 1 but on a corrupted step (debug.corrupt_step)."""
    module = model.parts[0]
    chunks = list(zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True))
    if ctx.faults.reverse_micro_batches:
        chunks.reverse()
    total = torch.zeros((), device=ctx.device)
    weight = (ctx.loss_scale.scale if ctx.loss_scale else 1.0) / len(chunks)
    method = model.loss.method
    for index, (x, y) in enumerate(chunks):
        sync = gradient_sync(module, enabled=index == len(chunks) - 1)
        # an MoE's auxiliary loss enters with the same weight; vocab_parallel's context
        # holds forward and backward
        with sync, moe.loss_weight(weight), loss_context(method):
            with phase(f"forward mb {index}"), _autocast(ctx):
                loss = micro_batch_loss(module, x, y, method) * factor
            with phase(f"backward mb {index}"):
                (loss * weight).backward()
        total += loss.detach()
    return total / len(chunks)


def _pipeline_step(
    model: ParallelModel, inputs, targets, ctx: LoopContext, factor: float
) -> torch.Tensor:
    """One schedule step; the loss exists on the last stage only (zero elsewhere)."""
    scale = ctx.loss_scale.scale if ctx.loss_scale else 1.0
    # the schedule scales each micro-batch's gradients by 1/m itself, the auxiliary's too
    with _autocast(ctx), moe.loss_weight(scale):
        return model.run_schedule(inputs, targets, loss_scale=scale, loss_factor=factor)


def train_step(
    model: ParallelModel,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    batches: LocalBatches,
    step: int,
    cfg: TrainConfig,
    ctx: LoopContext,
    breakdown: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """One optimizer step on the step's batch: (loss, global gradient norm, both still on
    device; the LR it trained with); None where a torchft replica failed during the step,
    which then applies nothing. `breakdown`: the step the memory breakdown reads, marked."""
    if breakdown:
        ctx.memory.mark(STEP_START)
    with phase("data"):
        inputs, targets = batches.for_step(step)
    # keyed by the batch, as a bad batch would be: a rollback that skips it skips the fault
    factor = ctx.faults.corruption(batches.batch_index(step)) if ctx.faults.corruption else 1.0
    with inside(ctx.watchdog, step, ctx.step_collectives, one_collective=False):
        if model.schedule is not None:
            step_loss = _pipeline_step(model, inputs, targets, ctx, factor)
        else:
            step_loss = _accumulate(model, inputs, targets, cfg.micro_batch_size, ctx, factor)
    if model.tied is not None:  # a pipeline's tied embedding and head: one gradient
        with inside(ctx.watchdog, step, "all_reduce (tied embedding)", one_collective=True):
            model.tied.sum_grads()
    if breakdown:
        ctx.memory.mark(FWD_BWD_END)
    if ctx.faults.grad_error:  # planted: meshrun-verify must tell it from the reference
        model.parameters()[-1].grad.mul_(1 + ctx.faults.grad_error)
    grads = LocalGrads(model.parameters(), model.norm_copies())
    if ctx.replicas is not None:  # torchft: averaged with the other replica groups' ranks'
        ctx.replicas.average(grads.tensors)
    if ctx.loss_scale:
        ctx.loss_scale.unscale(grads)
    with inside(ctx.watchdog, step, "all_reduce (gradient norm)", one_collective=True):
        norm = grads.norm(ctx.pp_group)
    # torchft: the loss the quorum's mean, the step applied only where all replicas' succeeded
    if ctx.replicas is not None and not ctx.replicas.agreed(step, step_loss):
        optimizer.zero_grad(set_to_none=False)
        return None
    if cfg.grad_clip is not None:
        with phase("clip"):
            grads.clip_(cfg.grad_clip, norm)
    lr = schedule.get_last_lr()[0]
    _update(optimizer, schedule, norm, ctx)
    model.refresh_float8_scales()  # float8 all-gather's scales of the updated weights
    return step_loss, norm, lr


def _update(
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    norm: torch.Tensor,
    ctx: LoopContext,
) -> None:
    """The optimizer's step where the gradients are finite (fp16: as its loss scale decides),
    the LR schedule's either way, the gradients zeroed."""
    if ctx.loss_scale is not None:  # fp16: its scale's decision, read on the host
        stepped = ctx.loss_scale.update(norm)
    else:  # a non-finite norm leaves the weights as they are (on the device where it can)
        stepped = ctx.guards.step is None or ctx.guards.step.gate(norm)
    if stepped:
        with phase("optimizer"):
            optimizer.step()
    with warnings.catch_warnings():
        if not stepped:  # the LR follows the steps, applied or skipped (non-finite)
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
        schedule.step()
    optimizer.zero_grad(set_to_none=False)


def train_loop(
    model: ParallelModel,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    batches: LocalBatches,
    cfg: TrainConfig,
    ctx: LoopContext,
) -> LoopState:
    """Steps `ctx.start_step` to `cfg.steps`; the first `untimed_steps` of them untimed."""
    state = LoopState()
    bubble = BubbleClock(model.schedule, ctx.device) if model.schedule is not None else None
    if ctx.inspection.profiler is not None and model.schedule is not None:
        annotate_stages(model.schedule)
    first_timed = ctx.start_step + cfg.untimed_steps
    step = ctx.start_step
    while step < cfg.steps:
        if step == first_timed and not ctx.pending.clock.started:
            _start_timing(step, ctx, bubble)
        _before_step(step, ctx)
        timed = step >= first_timed
        # The breakdown is read from an untimed step after the first: optimizer state exists.
        breakdown = ctx.start_step + 1 <= step < first_timed
        with _measured(step, ctx, timed):
            done = train_step(model, optimizer, schedule, batches, step, cfg, ctx, breakdown)
        if done is None:  # a torchft replica failed during it: the live ones train it again
            batches.again(step)
            continue
        loss, norm, lr = done
        values = torch.stack([loss, norm])
        if ctx.routers:  # after the loss and the norm, each router's counts of the step
            values = torch.cat([values, _routed(model, step, ctx).flatten()])
        ctx.pending.add(values, lr)
        if timed:
            _end_timed_step(step, ctx)  # the clock's mark, then the baseline's step
        if ctx.progress is not None:
            ctx.progress.step(step + 1)
        evaluated = _evaluate(step, ctx, timed)
        spike = log_and_save(step, cfg, batches, ctx, evaluated)
        _after_step(step, ctx, timed)
        step = roll_back(spike, batches, ctx) if spike else step + 1
    _finish(cfg, state, ctx, bubble)
    return state


def _before_step(step: int, ctx: LoopContext) -> None:
    """Where the rank is, the failure it injects, the profiler's start, torchft's quorum."""
    if ctx.watchdog is not None:
        ctx.watchdog.at(step)
    if ctx.faults.failure is not None:
        ctx.faults.failure(step)
    if ctx.inspection.profiler is not None:
        ctx.inspection.profiler.before(step)
    if ctx.replicas is not None:
        ctx.replicas.begin(step)


@contextlib.contextmanager
def _measured(step: int, ctx: LoopContext, timed: bool) -> Iterator[None]:
    """The step as its clock times it, less the baseline's: a range in a trace, and the rank's
    busy time (a profiled step's left out of the timed ones)."""
    busy, profiler = ctx.inspection.busy, ctx.inspection.profiler
    with step_range(step):
        if busy is not None:
            busy.start()
        yield
        if busy is not None:
            busy.stop(timed=timed and not (profiler is not None and profiler.disturbs(step)))


def _after_step(step: int, ctx: LoopContext, timed: bool) -> None:
    """The trace or a memory snapshot written (outside every step's clock); slow_step_s."""
    profiler, snapshots = ctx.inspection.profiler, ctx.inspection.snapshots
    written = profiler is not None and profiler.after(step)
    written = (snapshots is not None and snapshots.after_step(ctx.memory.peaks())) or written
    if written and timed:
        ctx.pending.clock.restart()
    if ctx.faults.slow_step_s:
        time.sleep(ctx.faults.slow_step_s)


def _routed(model: ParallelModel, step: int, ctx: LoopContext) -> torch.Tensor:
    """The step's router statistics (moe.take_router_stats); under load_balance=bias the
    whole batch's loads (the mean over data-parallel ranks: the sign is the sum's) move each
    router's biases."""
    r = ctx.routers
    stats = moe.take_router_stats(model.parts, r.layers, r.experts, ctx.device)
    if r.bias_rate:
        counts = stats[:, : -moe.STAT_EXTRA].contiguous()
        with inside(ctx.watchdog, step, "all_reduce (expert loads)", one_collective=True):
            counts = mean_over_ranks(counts, ctx.dp_group, None)
        moe.update_biases(model.parts, counts, r.bias_rate)
    return stats


def _start_timing(step: int, ctx: LoopContext, bubble: BubbleClock | None) -> None:
    """The first timed step's start: memory tracing and the compile clock end, the baseline
    beside the run runs its own untimed steps, and all ranks leave the untimed steps together."""
    ctx.memory.stop_tracing()
    if ctx.inspection.compiling is not None:
        ctx.inspection.compiling.stop()  # the untimed steps' compiling, not the baseline's
    if ctx.baseline_beside is not None:
        ctx.memory.hold()  # what the baseline allocates is not the run's
        with inside(ctx.watchdog, step, "baseline's untimed steps (rank 0)", one_collective=False):
            ctx.baseline_beside.untimed_steps()
    if dist.is_initialized():
        with inside(ctx.watchdog, step, "barrier (end of the untimed steps)", one_collective=True):
            control_barrier()  # ranks end their untimed steps at different times: level the clocks
    ctx.pending.clock.mark()
    if bubble is not None:
        bubble.start()
    if ctx.inspection.host_load is not None:
        ctx.inspection.host_load.start()


def _end_timed_step(step: int, ctx: LoopContext) -> None:
    """The step's clock mark; then one step of the baseline beside the run, outside the run's
    clock."""
    ctx.pending.clock.mark()
    if ctx.baseline_beside is not None:
        with inside(
            ctx.watchdog, step, "baseline beside the run step (rank 0)", one_collective=False
        ):
            ctx.baseline_beside.step()
        ctx.pending.clock.restart()  # the baseline's step is none of the run's


def _evaluate(step: int, ctx: LoopContext, timed: bool) -> dict[str, float] | None:
    """train.eval's held-out loss where due after `step`, outside the step clock."""
    if ctx.evaluate is None or not ctx.evaluate.due(step + 1):
        return None
    with inside(ctx.watchdog, step, "evaluation", one_collective=False):
        evaluated = ctx.evaluate()
    if timed:
        ctx.pending.clock.restart()  # the evaluation is no step's time
    return evaluated


def _finish(
    cfg: TrainConfig, state: LoopState, ctx: LoopContext, bubble: BubbleClock | None
) -> None:
    """After the last step: the host's load, the checkpoint still being written, the bubble."""
    if ctx.inspection.host_load is not None:
        state.host_load = ctx.inspection.host_load.stop()
    if ctx.checkpoints is not None:
        last = cfg.steps - 1
        with inside(ctx.watchdog, last, "checkpoint save (finishing)", one_collective=True):
            ctx.checkpoints.wait()
    if bubble is not None:
        state.pipeline_busy_per_step, state.pipeline_span_per_step = bubble.per_step()
