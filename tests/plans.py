"""User TP plans for tests (`parallel.tp_plan=tests.plans:<function>`), imported by the ranks."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def wrong_wo_sharding(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The built-in plan (meshrun.parallel.tensor.apply_tp) with one mistake: the attention
    output projection `wo` is row-wise but its output is left Partial, so the per-rank partial
    sums are never all-reduced. Shapes still fit, so it trains without an error, just wrongly
    (a column-wise `wo` would not: its input is head-sharded, and the matmul fails at once)."""
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
            "attention.wo": RowwiseParallel(output_layouts=Partial()),  # the mistake
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
        parallelize_module(block, tp_mesh, plan)
