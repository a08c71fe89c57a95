"""Expert parallelism: each MoE block's routed experts split over the ep group (Shard(0) of
every expert matrix: E/ep whole experts a rank), its tokens sent to their experts' ranks and
back by the experts module itself (models/moe.py's dispatch; transformers' experts get a
forward that does it, models/hf_experts.py). The router, the shared experts and the rest of
the model keep the layout they have."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from meshrun.models import hf_experts
from meshrun.models.moe import Experts


def routed_experts(module: nn.Module) -> list[nn.Module]:
    """The routed experts' modules in `module`: meshrun's and transformers'."""
    return [m for m in module.modules() if isinstance(m, Experts) or hf_experts.is_hf_experts(m)]


def apply_expert_parallel(part: nn.Module, ep_mesh: DeviceMesh) -> None:
    """On meta, before FSDP2 (which shards each rank's experts further, fsdp.py)."""
    group = ep_mesh.get_group()
    for experts in routed_experts(part):
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if isinstance(experts, Experts):
            experts.ep_group = group
        else:
            hf_experts.dispatch_over(experts, group)
