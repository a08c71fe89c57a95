"""AdamW with LLaMA's betas (weight decay only on matrices, not norms), its LR schedule
(warmup, then constant, linear or cosine decay to a floor), and gradient clipping that works
across layouts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from meshrun.core.config import LrScheduleConfig, TrainConfig
from meshrun.models.shards import local_tensor
from meshrun.rank.train.optim_states import (
    BLOCK,
    Bf16AdamW,
    adamw_8bit,
    placed_like,
    zero_local_grads,
)

BETAS = (0.9, 0.95)


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, regroup: bool = False
) -> torch.optim.Optimizer:
    """AdamW with the moments train.optimizer_states keeps (optim_states.py); 8-bit ones
    quantized in blocks of torchao's 256 values, of half that where `regroup`
    (debug.regroup_states: the same values in other groups)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    adam = {"lr": cfg.lr, "betas": BETAS, "eps": 1e-8}
    if cfg.optimizer_states == "bf16":
        return Bf16AdamW(groups, seed=cfg.seed, **adam)
    if cfg.optimizer_states == "8bit":
        return adamw_8bit()(groups, block_size=BLOCK // 2 if regroup else BLOCK, **adam)
    return LocalAdamW(groups, **adam, **step_kernels(params))


def step_kernels(params: list[nn.Parameter]) -> dict[str, bool]:
    """AdamW's fastest implementation for these parameters: `fused` (one kernel per device
    and dtype updates every tensor; the step counts stay on the device) where torch has it for
    their device (CPU and CUDA), else `foreach` (each stage of the update one op over the
    tensor list). torch's default on CPU is a Python loop over the tensors, a dozen ops and a
    read of the step count back to the host (`.item()`) for each."""
    fused = all(
        p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
        for p in params
    )
    return {"fused": True} if fused else {"foreach": True}


class LocalAdamW(torch.optim.AdamW):
    """torch's AdamW, stepping each DTensor parameter on its local shard.

    AdamW is elementwise, so a shard's update is the shard of the whole update: the same aten
    ops DTensor would run on the same local tensors, without its sharding propagation, which
    cost seconds on the first step over a 2-D or 3-D mesh on CPU. Its state stays DTensors
    of the parameter's layout (what DCP saves and reshards); the local tensors are looked up
    at every step, since FSDP2 may swap a parameter's local tensor after construction. A
    gradient laid out otherwise than its parameter (Partial: not yet summed over a mesh dim)
    is redistributed first, as DTensor would have done inside the update.
    """

    def _init_group(
        self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
    ):
        first = len(params)
        has_complex = super()._init_group(
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        for i in range(first, len(params)):
            param, grad = params[i], grads[i]
            if not isinstance(param, DTensor):
                continue
            params[i], grads[i] = local_tensor(param), local_tensor(placed_like(grad, param))
        for states in (exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            states[first:] = [local_tensor(state) for state in states[first:]]
        return has_complex

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, on the local tensors: under fused or foreach, torch zeroes the gradients
        with one foreach op, which refuses DTensors beside plain tensors (TP's replicated
        norms)."""
        if set_to_none:
            super().zero_grad(set_to_none=True)
        else:
            zero_local_grads(self)


def lr_factor(step: int, schedule: LrScheduleConfig, steps: int) -> float:
    """The multiple of train.lr that step `step` (from 0) of `steps` trains with: warmup
    reaches 1 at its last step; decay runs from 1 at the first step after it to the floor
    at the last step of the run."""
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.decay == "constant":
        return 1.0
    progress = (step - schedule.warmup_steps) / max(1, steps - schedule.warmup_steps - 1)
    if schedule.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * shape


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once after each optimizer step: the LR of step s is lr x lr_factor(s)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.lr_schedule, cfg.steps)
    )


class LocalGrads:
    """This rank's gradients as plain local tensors, with the process groups each one's
    shards are spread over.

    The norm and the in-place scaling (clipping, fp16 unscaling) of a DTensor gradient are
    elementwise on its local shard, with a sum of squares over the mesh dims it is sharded
    on. Computed that way, not by DTensor, they cost no sharding propagation: DTensor's
    foreach strategy on a 2-D (FSDP x TP) or 3-D mesh took 2.5 s per op on first use on
    CPU, more than the whole rest of a tiny model's step 0. A Partial gradient (not yet
    reduced over a dim) is scaled in place as it is (scaling each part scales the sum); the
    norm reduces a copy, when it is taken (after any unscaling).
    """

    def __init__(self, params: list[nn.Parameter], copies: Sequence[nn.Parameter] = ()) -> None:
        """`copies`: gradients another rank holds too (a tied head's), scaled but not counted
        in the norm."""
        self.tensors: list[torch.Tensor] = []  # what scaling multiplies, in place
        self.norm_parts: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
        self.partial: list[DTensor] = []
        self.device: torch.device | None = None  # where the norm is reduced
        uncounted = {id(p) for p in copies}
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            self.device = self.device or _collective_device(grad)
            if id(p) in uncounted:
                self.tensors.append(local_tensor(grad))
                continue
            if not isinstance(grad, DTensor):
                self.tensors.append(grad)
                self.norm_parts.setdefault((), []).append(grad)
                continue
            self.tensors.append(grad.to_local())
            if any(placement.is_partial() for placement in grad.placements):
                self.partial.append(grad)
            else:
                self.norm_parts.setdefault(_sharded_over(grad), []).append(grad.to_local())

    def norm(self, pp_group: dist.ProcessGroup | None) -> torch.Tensor:
        """The norm of the whole model's gradient, whatever the layout: each part's sum of
        squares summed over the groups its shards lie on (one all-reduce per group), and
        pipeline stages, which hold disjoint layers, add theirs over the pp group."""
        parts = {key: list(tensors) for key, tensors in self.norm_parts.items()}
        for grad in self.partial:
            reduced = grad.redistribute(
                grad.device_mesh,
                [
                    Replicate() if placement.is_partial() else placement
                    for placement in grad.placements
                ],
            )
            parts.setdefault(_sharded_over(reduced), []).append(reduced.to_local())
        keys = list(parts)
        # On the device of the collectives: FSDP2's offloaded gradients are in host memory
        # (parallel.fsdp.offload), their mesh's group on the device.
        squares = [
            torch.stack(torch._foreach_norm(parts[key])).float().square().sum().to(self.device)
            for key in keys
        ]
        for group in dict.fromkeys(g for key in keys for g in key):
            over = [i for i, key in enumerate(keys) if group in key]
            summed = torch.stack([squares[i] for i in over])
            dist.all_reduce(summed, group=group)
            for i, value in zip(over, summed.unbind(), strict=True):
                squares[i] = value
        total_sq = torch.stack(squares).sum()
        if pp_group is not None:
            dist.all_reduce(total_sq, group=pp_group)
        return total_sq.sqrt()

    def scale_(self, factor: torch.Tensor | float) -> None:
        """Every gradient times `factor`, in place (a tensor factor copied to the host once
        for gradients offloaded there)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for tensor in self.tensors:
            by_device.setdefault(tensor.device, []).append(tensor)
        for device, tensors in by_device.items():
            on = factor.to(device) if isinstance(factor, torch.Tensor) else factor
            torch._foreach_mul_(tensors, on)

    def clip_(self, max_norm: float, total: torch.Tensor) -> None:
        """torch's clip_grads_with_norm_: scaled by max_norm / (total + 1e-6), at most 1."""
        self.scale_(torch.clamp(max_norm / (total + 1e-6), max=1.0))


def _sharded_over(grad: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups of the mesh dims `grad` is sharded on: every dim it is neither
    replicated nor partial on. Not `is_shard()`: FSDP2 over TP shards a TP-sharded dim again
    as `_StridedShard`, which in torch 2.13 is no `Shard` and answers False, and a norm that
    skipped that dim missed the other FSDP ranks' shares (fsdp2_tp2: 0.36 for 0.47)."""
    return tuple(
        grad.device_mesh.get_group(dim)
        for dim, placement in enumerate(grad.placements)
        if not (placement.is_replicate() or placement.is_partial())
    )


def _collective_device(grad: torch.Tensor) -> torch.device:
    """The device a gradient's norm is reduced on: a DTensor's mesh's (its local tensor may
    be in host memory under FSDP2's offload), any other tensor's own."""
    if not isinstance(grad, DTensor):
        return grad.device
    if grad.device_mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(grad.device_mesh.device_type, torch.accelerator.current_device_index())
