"""Expert parallelism: each MoE block's routed experts split over the ep group (Shard(0) of
every expert matrix: E/ep whole experts a rank), its tokens sent to their experts' ranks and
back by the block itself (models/moe.py's dispatch). The router, the shared experts and the
rest of the model keep the layout they have."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from meshrun.models.moe import moe_blocks


def apply_expert_parallel(part: nn.Module, ep_mesh: DeviceMesh) -> None:
    """On meta, before FSDP2 (which shards each rank's experts further, fsdp.py)."""
    for block in moe_blocks([part]):
        experts = block.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
