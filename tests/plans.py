"""TP plans for tests, passed as parallel.tp_plan."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _outer(model, tp_mesh):
    outer = {}
    if model.tok_embeddings is not None:
        outer["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        outer["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, outer)


def wo_colwise(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    _outer(model, tp_mesh)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": ColwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})


def wo_partial(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    _outer(model, tp_mesh)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Partial()),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})


def kv_replicated(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    _outer(model, tp_mesh)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})
