"""Activation checkpointing per transformer block: `full` recomputes the whole block in
backward; `selective` keeps the matmul and attention outputs (the expensive ops) and
recomputes the cheap elementwise ones (norms, SiLU, RoPE). `every` = n checkpoints only
every n-th block of the whole model (the n-th, 2n-th, ...: torchtitan's per-layer
frequency), the others keep all their activations; by the blocks' global index, so a
pipeline stage checkpoints the blocks it would in one piece."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> None:
    if mode == "none":
        return
    kwargs = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    for position, (name, block) in enumerate(list(model.layers.items())):
        index = int(name) if name.isdigit() else position  # (a user's ModuleDict's names)
        if (index + 1) % every == 0:
            model.layers[name] = checkpoint_wrapper(block, **kwargs)
