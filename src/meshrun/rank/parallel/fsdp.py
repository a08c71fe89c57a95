"""Sharded data parallelism with FSDP2 (`fully_shard`) over the data-parallel dims: 1-D for
FSDP, 2-D (replicate, shard) for HSDP, or (replicate, 1) for plain replication beside TP/PP;
the shard dim takes in CP's (dp_shard x cp), whose ranks hold the same parameters. Under
expert parallelism each block's experts are a unit of their own on the expert mesh."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from meshrun.core.layout import Layout
from meshrun.rank.parallel.expert import routed_experts


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    layout: Layout,
    reshard_after_forward: bool,
    param_dtype: torch.dtype,
    expert_mesh: DeviceMesh | None = None,
    offload: bool = False,
) -> nn.Module:
    """Shard each transformer block as its own unit (so only one block is gathered at a
    time), then the root, which holds the embedding, final norm and head. The root is never
    resharded after forward (torch's own default for a root): backward starts with the head,
    so it would be all-gathered again at once, with no compute to hide that behind.
    `offload` (parallel.fsdp.offload=cpu): every unit's sharded parameters and gradients in
    host memory, copied to the device for its all-gather and back after its
    reduce-scatter, so the optimizer steps on the host (pinned memory on CUDA, for the
    copies to run asynchronously; a CPU mesh's ranks hold them where they were)."""
    shard = "dp_shard"
    if layout.cp > 1:  # CP peers hold the same parameters: shard over both (dp_shard_cp)
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)
    dp_mesh = mesh["dp_replicate", shard] if layout.dp_replicate > 1 else mesh[shard]
    policies = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
        ),
    }
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        # The last block is resharded by the root right after anyway: keep it gathered.
        reshard = reshard_after_forward and index < len(blocks) - 1
        if expert_mesh is not None:
            _shard_experts(block, expert_mesh, layout, policies, reshard)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **policies)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **policies)
    # Under TP the root's logits are a slice of the padded vocabulary (models/vocab.py), a
    # view, which FSDP2 warns about on every forward: an in-place op on it would skip the
    # pre-backward hook. The loss reads the logits out of place, and dp2_tp2's parity with
    # one device (tests/test_layouts.py) shows the gradients whole.
    warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(.*\) returned a view tensor")
    return model


def _shard_experts(
    block: nn.Module,
    expert_mesh: DeviceMesh,
    layout: Layout,
    policies: dict,
    reshard: bool,
) -> None:
    """Each rank's experts (DTensors over ep) sharded over the rest of dp_shard x cp (and
    replicated over dp_replicate), whose gradients FSDP2 averages (the ep group's share of
    the mean is taken in the block, models/moe.py's dispatch)."""
    dims = ("dp_replicate", "expert_shard") if layout.dp_replicate > 1 else ("expert_shard",)
    for experts in routed_experts(block):
        fully_shard(experts, mesh=expert_mesh[dims], reshard_after_forward=reshard, **policies)
