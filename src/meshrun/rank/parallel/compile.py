"""torch.compile per decoder block (train.compile), torchtitan's way: each block of the
model's block list compiled in place, after tensor parallelism and activation checkpointing
(both traced into the block's graph) and before FSDP2 (whose hooks run around the blocks),
on the meta model. The blocks share one compiled graph (the same code under the same guards),
so a model of any depth compiles once per graph (forward, backward).

A fully checkpointed block is compiled inside its checkpoint instead, the recompute calling
the compiled forward again: traced whole, its checkpoint saves what a TP block's DTensors
carry, a DeviceMesh, which AOT autograd refuses (torch 2.13: "expected all
tensors_saved_with_vc_check to be Tensors"). Selective checkpointing stays traced: its
policy picks among the ops of the graph.

In place (`Module.compile`), a block keeps its name and its parameters theirs: checkpoints,
TP plans and FSDP see the model they would without compile."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor


def apply_compile(model: nn.Module) -> None:
    """Compile each block of `model.layers` (a pipeline stage's own blocks only) with inductor.
    Not `fullgraph`: a transformers or user block may break its graph, which dynamo then
    splits into several compiled pieces."""
    for name in ("tok_embeddings", "pos_embeddings"):
        embedding = getattr(model, name, None)
        if embedding is not None:
            embedding.register_forward_hook(_settled)
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        full = inner is not None and "context_fn" not in block.checkpoint_fn.keywords
        (inner if full else block).compile()


def _settled(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A TP embedding's output as a plain tensor, its collective waited for. Left in flight
    (an AsyncCollectiveTensor) into a compiled block, its gradient reaches the embedding's
    redistribution as a plain tensor, not a DTensor, and backward fails (torch 2.13); the
    first block also compiles twice (a guard on the input's type). The copy is
    differentiable, unlike the collective's own wait."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output
