"""meshrun's overhead over hand-written 2-way tensor parallelism, measured side by side.

(A) "hand": plain torch.distributed.tensor.parallel, as a user would write it: mp.spawn, gloo,
a 1-D DeviceMesh over the ranks, the full model initialised with `init_weights(seed)` and then
sharded by `parallelize_module` with Megatron's plan (q/k/v column-wise, wo row-wise, w1/w3
column-wise, w2 row-wise, the embedding row-wise, the head column-wise with its logits
replicated, each block's inputs replicated once before attention and MLP), AdamW, gradient
accumulation, and clipping with the norm of all gradients (DTensor shards and replicated
plain tensors, normed per kind and combined). (B) "meshrun": the same training through the
`meshrun` CLI (parallel=tp2). Every rank sees the whole global batch (there is no data
parallelism). How both are run, timed and compared: see common.py.
"""

from __future__ import annotations

import functools

import torch
from common import (
    GRAD_CLIP,
    SEED,
    HandRank,
    Setup,
    accumulate,
    adamw,
    main,
    seeded_model,
    step_tokens,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from meshrun.core.config import LlamaModelConfig
from meshrun.rank.train.data import SyntheticTokens

OUTER_PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
    "output": ColwiseParallel(output_layouts=Replicate()),
}
BLOCK_PLAN = {
    "attention": PrepareModuleInput(
        input_layouts=(Replicate(), None, None), desired_input_layouts=(Replicate(), None, None)
    ),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward": PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
    ),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def clip_grads(sharded: list[nn.Parameter], replicated: list[nn.Parameter]) -> None:
    """Clip by the norm of the whole gradient: the DTensor shards' norm (all-reduced by
    full_tensor) and the replicated plain tensors' norm, combined."""
    norm_sq = []
    for params in (sharded, replicated):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norm_sq.append(norm**2)
    total = torch.stack(norm_sq).sum().sqrt()
    for params in (sharded, replicated):  # foreach ops cannot mix DTensors and tensors
        torch.nn.utils.clip_grads_with_norm_(params, GRAD_CLIP, total, foreach=True)


def build_tensor_parallel(rank: int, setup: Setup, model_cfg: LlamaModelConfig) -> HandRank:
    """One rank of hand-written tensor parallelism over all `setup.ranks`."""
    mesh = init_device_mesh("cpu", (setup.ranks,))
    model = seeded_model(model_cfg, setup)
    parallelize_module(model, mesh, OUTER_PLAN)
    for block in model.layers.values():
        parallelize_module(block, mesh, BLOCK_PLAN)
    params = list(model.parameters())
    data = SyntheticTokens(model_cfg.vocab_size, SEED)

    def forward_backward(step: int) -> torch.Tensor:
        return accumulate(model, step_tokens(data, setup, step), setup.micro_batch_size)

    sharded = [p for p in params if isinstance(p, DTensor)]
    replicated = [p for p in params if not isinstance(p, DTensor)]
    clip = functools.partial(clip_grads, sharded, replicated)
    return HandRank(adamw(params), forward_backward, clip)


if __name__ == "__main__":
    main(
        "Tensor-parallel overhead",
        "tp2",
        build_tensor_parallel,
        __file__,
        __doc__,
        degree="tp",
        steps=16,
    )
