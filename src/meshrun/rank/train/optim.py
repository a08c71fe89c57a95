"""AdamW with LLaMA's betas (weight decay only on matrices, not norms), its LR schedule
(warmup, then constant, linear or cosine decay to a floor), and gradient clipping that works
across layouts."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.core.config import LrScheduleConfig, TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


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


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig
                      ) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    """Stepped once after each optimizer step: the LR of step s is lr x lr_factor(s)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.lr_schedule, cfg.steps)
    )


GradGroups = dict[object, list[nn.Parameter]]


def grad_norm(groups: GradGroups, pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The norm of the whole model's gradient, whatever the layout.

    Gradients may be plain tensors (single, DDP) or DTensors on different meshes (FSDP, TP,
    both): each mesh's group is normed by DTensor itself (which knows what is sharded and
    what replicated), the squares are added, and pipeline stages, which hold disjoint
    layers, add theirs over the pp group.
    """
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total_sq = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_grads(groups: GradGroups, max_norm: float, total: torch.Tensor) -> None:
    for group in groups.values():  # one mesh at a time: foreach ops cannot mix them
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)


def grads_by_mesh(params: list[nn.Parameter]) -> GradGroups:
    """Parameters with a gradient, grouped by the mesh of their (DTensor) gradient."""
    groups: GradGroups = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    return groups
