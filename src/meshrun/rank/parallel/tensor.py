"""Megatron-style tensor parallelism with torch.distributed.tensor.parallel.

Attention: q/k/v column-wise (each rank owns n_heads/tp heads), output row-wise. MLP: gate and
up column-wise, down row-wise. One all-reduce per sub-block in forward and backward. The
embedding is sharded over the vocabulary (row-wise) and the output head column-wise with its
logits gathered. With sequence parallelism the norms and residual stream are sharded over
the sequence instead of replicated, turning each all-reduce into reduce-scatter + all-gather.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshrun.core.imports import import_target


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    block_overrides: dict[str, ParallelStyle] | None = None,
) -> None:
    """Shard `model` in place over `tp_mesh` (a pipeline stage may lack embedding/head).

    `block_overrides` replaces entries of each block's plan (keys like "attention.wo"): a
    user's plan that differs in a few layers calls this instead of restating the rest."""
    residual = Shard(1) if sequence_parallel else Replicate()
    outer: dict = {}
    if model.tok_embeddings is not None:
        outer["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=residual
        )
    if model.output is not None:
        outer["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
        if sequence_parallel:
            outer["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, outer)
    for block in model.layers.values():
        plan: dict = {
            "attention": PrepareModuleInput(
                input_layouts=(residual, None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward": PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, {**plan, **(block_overrides or {})})


TpPlan = Callable[[nn.Module, DeviceMesh, bool], None]


def resolve_tp_plan(path: str | None) -> TpPlan:
    """The built-in plan, or a user's "package.module:function" with apply_tp's signature."""
    if path is None:
        return apply_tp
    plan = import_target(path)
    if not callable(plan):
        raise ValueError(f"{path} is not a callable")
    return plan
