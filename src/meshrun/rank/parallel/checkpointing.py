"""Activation checkpointing per transformer block: `full` recomputes the whole block in
backward; `selective` keeps the matmul and attention outputs (the expensive ops) and
recomputes the cheap elementwise ones (norms, SiLU, RoPE); `op` is torchtitan's op-level
policy: attention outputs and every other matmul's output kept (the 1st, 3rd, ... of a
block's forward), the rest recomputed. Both keep what ALWAYS_KEPT names (SP's
reduce-scatters, the router's top-k) as torchtitan does. `every` = n checkpoints only every
n-th block of the whole model (the n-th, 2n-th, ...: torchtitan's per-layer frequency), the
others keep all their activations; by the blocks' global index, so a pipeline stage
checkpoints the blocks it would in one piece."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._grouped_mm.default}
# Kept under both policies, as torchtitan keeps them (torchtitan/distributed/
# activation_checkpoint.py, _get_default_save_ops): every SDPA kernel a CPU or CUDA device
# runs (the math one is CompositeImplicit, its matmuls seen as bmm); sequence parallelism's
# reduce-scatter of a row-parallel output (a collective not to run again in backward); the
# router's top-k, so that a recompute routes every token as its forward did. torchtitan's
# others are not meshrun's: max (float8 scales), flex attention, compiled regions, DeepEP,
# the functional all_to_all (meshrun's expert exchange is c10d's own, models/exchange.py),
# the overrideable attention (PrivateUse1 devices) and linear (a PrivateUse1 leaf op).
ATTENTION = {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
ALWAYS_KEPT = {
    *ATTENTION,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    _aten.topk.default,
}
Policy = Callable[..., CheckpointPolicy]


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in MATMULS or op in ALWAYS_KEPT:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _every_other_matmul() -> Policy:
    """A block's own counter of its matmuls, one for its forward and one for its recompute
    (SAC requires the recompute to decide as the forward did): odd ones kept."""
    seen: Counter[bool] = Counter()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in ALWAYS_KEPT:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMULS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_contexts():
    """A new policy each time a checkpointed block runs, so its counts start at zero."""
    return create_selective_checkpoint_contexts(_every_other_matmul())


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> None:
    if mode == "none":
        return
    kwargs = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    elif mode == "op":
        kwargs["context_fn"] = _op_contexts
    for position, (name, block) in enumerate(list(model.layers.items())):
        index = int(name) if name.isdigit() else position  # (a user's ModuleDict's names)
        if (index + 1) % every == 0:
            model.layers[name] = checkpoint_wrapper(block, **kwargs)
