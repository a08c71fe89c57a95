"""The training loop: micro-batches with gradient accumulation, clipping, AdamW.

The only host syncs are at log steps, where the buffered per-step losses are averaged over
the data-parallel group and the step times are read. The first `warmup_steps` are excluded
from timing; on CPU they are also where peak memory is traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshrun.config import TrainConfig
from meshrun.metrics.memory import MemoryMeter
from meshrun.metrics.throughput import StepClock
from meshrun.parallel import gradient_sync
from meshrun.train.data import MicroBatches

LogFn = Callable[[list[dict]], None]


@dataclass
class LoopState:
    """What the loop has measured so far; survives (in part) a crash mid-run."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)


@dataclass
class LoopContext:
    device: torch.device
    dp_group: dist.ProcessGroup | None
    autocast_dtype: torch.dtype | None
    memory: MemoryMeter
    on_log: LogFn
    progress: Callable[[int], None] | None = None
    fault: Callable[[int], None] | None = None


def _autocast(ctx: LoopContext) -> contextlib.AbstractContextManager:
    if ctx.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=ctx.autocast_dtype)


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: MicroBatches,
    cfg: TrainConfig,
    ctx: LoopContext,
) -> LoopState:
    state = LoopState()
    clock = StepClock(ctx.device)
    pending: list[torch.Tensor] = []
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(cfg.steps):
        if step == cfg.warmup_steps:
            ctx.memory.stop_tracing()
            clock.mark()
        if ctx.fault is not None:
            ctx.fault(step)
        micro_batches = batches.for_step(step)
        step_loss = torch.zeros((), device=ctx.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            with gradient_sync(model, enabled=index == len(micro_batches) - 1):
                with _autocast(ctx):
                    logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                (loss / len(micro_batches)).backward()
            step_loss += loss.detach()
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pending.append(step_loss / len(micro_batches))
        if step >= cfg.warmup_steps:
            clock.mark()
        if ctx.progress is not None:
            ctx.progress(step + 1)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            _flush(state, pending, clock, step, cfg, ctx)
            pending = []
    return state


def _flush(
    state: LoopState,
    pending: list[torch.Tensor],
    clock: StepClock,
    last_step: int,
    cfg: TrainConfig,
    ctx: LoopContext,
) -> None:
    """The log step: one reduction of the buffered losses, one read of the step clock."""
    losses = torch.stack(pending)
    if ctx.dp_group is not None:
        dist.all_reduce(losses, group=ctx.dp_group)  # gloo has no AVG
        losses /= dist.get_world_size(ctx.dp_group)
    values = losses.tolist()
    times = clock.drain()
    first_step = last_step - len(values) + 1
    timed_from = len(values) - len(times)
    records = []
    for offset, loss in enumerate(values):
        step_time = times[offset - timed_from] if offset >= timed_from else None
        records.append({"step": first_step + offset, "loss": loss, "step_time_s": step_time})
    state.losses.extend(values)
    state.step_times.extend(times)
    ctx.on_log(records)
