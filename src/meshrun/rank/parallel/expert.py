"""Expert parallelism: each MoE block's routed experts split over the ep group (Shard(0) of
every expert matrix: E/ep whole experts a rank) and, under `parallel.etp`, each expert's
hidden width over the TP ranks (Megatron's expert tensor parallelism: w1 and w3 column-wise,
w2 row-wise). The experts module dispatches its tokens itself (models/moe.py; transformers'
experts get a forward that does it, models/hf_experts.py). The router, the shared experts
and the rest of the model keep the layout they have."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from meshrun.core.layout import Layout
from meshrun.models import hf_experts
from meshrun.models.moe import Experts

# the dim of each of meshrun's expert matrices etp splits: the hidden width (w1, w3: [E, h, f];
# w2: [E, f, h]); transformers' are hf_experts.hidden_dim's
ETP_DIMS = {"w1": 2, "w3": 2, "w2": 1}


def routed_experts(module: nn.Module) -> list[nn.Module]:
    """The routed experts' modules in `module`: meshrun's and transformers'."""
    return [m for m in module.modules() if isinstance(m, Experts) or hf_experts.is_hf_experts(m)]


def apply_expert_parallel(part: nn.Module, expert_mesh: DeviceMesh, layout: Layout) -> None:
    """On meta, before FSDP2 (which shards each rank's experts further, fsdp.py), over
    rank/mesh.py's expert mesh."""
    dims = tuple(dim for dim, n in (("ep", layout.ep), ("tp", layout.etp)) if n > 1)
    mesh = expert_mesh[dims]
    ep_group = expert_mesh["ep"].get_group() if layout.ep > 1 else None
    tp_group = expert_mesh["tp"].get_group() if layout.etp > 1 else None
    for experts in routed_experts(part):
        ours = isinstance(experts, Experts)
        for name, param in list(experts.named_parameters(recurse=False)):
            width = ETP_DIMS[name] if ours else hf_experts.hidden_dim(experts, name)
            placements = [Shard(0) if dim == "ep" else Shard(width) for dim in dims]
            sharded = distribute_tensor(param.data, mesh, placements)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if ours:
            experts.ep_group, experts.tp_group = ep_group, tp_group
        else:
            hf_experts.dispatch_over(experts, ep_group, tp_group)
