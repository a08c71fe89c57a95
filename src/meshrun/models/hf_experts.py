"""transformers' routed experts under expert parallelism: the 3-D `gate_up_proj` [E, 2f, h]
and `down_proj` [E, h, f] of Mixtral, Qwen2-MoE, Qwen3-MoE and the like (transformers 5),
their forward replaced by one that sends each token to the rank of its experts and back
(models/moe.py's dispatch). transformers' router, shared experts and auxiliary loss are
untouched."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshrun.models.expert_compute import dispatched_compute, use_grouped_mm
from meshrun.models.moe import local_experts, sorted_by_expert

WEIGHTS = ("gate_up_proj", "down_proj")


def is_hf_experts(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return set(params) == set(WEIGHTS) and all(p.dim() == 3 for p in params.values())


# transformers' record of an experts module's layout (integrations/moe.py,
# use_experts_implementation): the value that the dispatched forward computes.
LAYOUT_FLAGS = {
    "has_gate": (True, "no gate"),
    "has_bias": (False, "biases"),
    "is_concatenated": (True, "gate and up rows interleaved"),
    "has_post_expert_norm": (False, "a norm after each expert"),
}


def unsplittable(experts: nn.Module) -> str | None:
    """Why the dispatched forward (SiLU(x Wg) * x Wu, then Wd, over [gate; up]) would not
    compute what `experts` does, or None: a gate function of the family's own (its class
    overrides `_apply_gate`, as MiniMax-M3's clamped one), an activation other than SiLU, or a
    layout flag of another value (LAYOUT_FLAGS; `is_transposed` is followed)."""
    from transformers.activations import SiLUActivation  # noqa: PLC0415 (meshrun[hf])
    from transformers.integrations.moe import _default_apply_gate  # noqa: PLC0415

    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return "they gate with a function of their own (_apply_gate), not SwiGLU"
    act = getattr(experts, "act_fn", None)
    if not isinstance(act, (nn.SiLU, SiLUActivation)):  # ACT2FN's "swish" and "silu"
        return f"their activation is {type(act).__name__}, not SiLU"
    for flag, (plain, what) in LAYOUT_FLAGS.items():
        if getattr(experts, flag, plain) != plain:
            return f"they have {what}"
    return None


def dispatch_over(experts: nn.Module, group: dist.ProcessGroup) -> None:
    """`experts` (its weights already DTensors over `group`, Shard(0)) computes its tokens
    on the ranks that hold their experts."""
    experts.ep_group = group
    experts.forward = types.MethodType(_dispatched_forward, experts)


def _dispatched_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' experts forward (its signature and result): each token's top-k experts
    summed by the router's weights; SwiGLU (validate refuses what `unsplittable` names)."""
    order, counts = sorted_by_expert(top_k_index, self.gate_up_proj.shape[0])
    rows = order // top_k_index.shape[1]
    gate_up, down = (local_experts(getattr(self, name), self.ep_group) for name in WEIGHTS)
    if getattr(self, "is_transposed", False):  # [E, in, out] (Aria's): as dispatched_compute
        f = down.shape[1]
        weights = (gate_up[..., :f], gate_up[..., f:], down)
    else:  # [E, out, in]
        f = down.shape[-1]
        weights = (gate_up[:, :f].mT, gate_up[:, f:].mT, down.mT)
    x = hidden_states[rows]
    out = dispatched_compute(x, weights, counts, self.ep_group, use_grouped_mm(x, weights[2]))
    out = out * top_k_weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, rows, out.to(hidden_states.dtype))
