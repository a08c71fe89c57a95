"""transformers' routed experts under expert parallelism: the 3-D `gate_up_proj` [E, 2f, h]
and `down_proj` [E, h, f] of Mixtral, Qwen2-MoE, Qwen3-MoE and the like (transformers 5),
their forward replaced by one that sends each token to the rank of its experts and back
(models/moe.py's dispatch) and, under `parallel.etp`, computes each expert's share of the
hidden width on each TP rank (Megatron's expert TP, as meshrun's own experts do).
transformers' router, shared experts and auxiliary loss are untouched."""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshrun.models.exchange import exchange
from meshrun.models.expert_compute import (
    dispatched,
    dispatched_compute,
    expert_compute,
    use_grouped_mm,
)
from meshrun.models.moe import GroupRegion, local_experts, sorted_by_expert

WEIGHTS = ("gate_up_proj", "down_proj")
HIDDEN_DIMS = {"gate_up_proj": 1, "down_proj": 2}  # [E, 2f, h], [E, h, f]


def is_hf_experts(module: nn.Module) -> bool:
    """transformers' experts (a class under its use_experts_implementation, which records
    their layout): every weight [E, ...], the down projection 3-D."""
    params = dict(module.named_parameters(recurse=False))
    down = params.get("down_proj")
    return hasattr(module, "is_concatenated") and down is not None and down.dim() == 3


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


def hidden_dim(experts: nn.Module, name: str) -> int:
    """The dim of `name`'s matrices that runs along the hidden width f: [E, 2f, h] and
    [E, h, f], or transposed (Aria's) [E, h, 2f] and [E, f, h]."""
    along = HIDDEN_DIMS[name]
    return 3 - along if getattr(experts, "is_transposed", False) else along


def dispatch_over(
    experts: nn.Module, ep_group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None
) -> None:
    """`experts` (its weights already DTensors: Shard(0) over `ep_group`, and over
    `tp_group` Shard(hidden_dim)) computes its tokens on the ranks that hold their experts,
    each TP rank its share of their hidden width: plain SwiGLU experts by meshrun's own
    compute, others (`unsplittable`; validate refuses them etp) by their own forward."""
    experts.ep_group, experts.tp_group = ep_group, tp_group
    own = unsplittable(experts) is not None
    experts.forward = types.MethodType(_own_forward if own else _dispatched_forward, experts)


def gate_and_up_by_rank(held: Tensor, group: dist.ProcessGroup) -> Tensor:
    """This TP rank's gate columns then up columns of its share of the hidden width, from
    x times the rows of [gate; up] it holds (`held`, [rows, 2f/tp]). Under etp the fused
    matrix is sharded as DCP and transformers see it, rank r holding its r-th contiguous block
    of 2f/tp rows (a checkpoint or an export is the same under any etp), while SwiGLU on rank r
    needs gate's and up's columns r*f/tp..(r+1)*f/tp: one all-to-all over the TP ranks trades
    them (differentiable: the gradients go back the same way). The products are traded, not
    the weights: nothing is kept for backward beyond what SwiGLU keeps anyway. Columns arrive
    in their order in [gate; up], so gate's first."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    order, sent, arriving = _trade_plan(tp, rank, held.shape[-1], held.device)
    # columns sorted by owner, as rows to trade; rows again after (row-major, as the grouped
    # GEMM takes its operands, and their gradients as the GEMM's backward takes them)
    columns = held[:, order].mT.contiguous()
    return exchange(columns, group, arriving, sent).mT.contiguous()


@functools.cache
def _trade_plan(
    tp: int, rank: int, width: int, device: torch.device
) -> tuple[Tensor, list[int], list[int]]:
    """The trade's plan, once a layer width: the held columns in the order they are sent (on
    the device: no copy from the host each forward) and how many go to, and come from, each
    TP rank."""
    f = width * tp // 2
    share = f // tp

    def owners(block: int) -> Tensor:
        columns = torch.arange(block * width, (block + 1) * width)
        return torch.where(columns < f, columns // share, (columns - f) // share)

    mine = owners(rank)
    sent = torch.bincount(mine, minlength=tp).tolist()
    arriving = [int((owners(source) == rank).sum()) for source in range(tp)]
    return mine.argsort(stable=True).to(device), sent, arriving


def _dispatched_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' experts forward (its signature and result): each token's top-k experts
    summed by the router's weights; SwiGLU (validate refuses what `unsplittable` names)."""
    order, counts = sorted_by_expert(top_k_index, self.gate_up_proj.shape[0])
    rows = order // top_k_index.shape[1]
    gate_up, down = (local_experts(getattr(self, name), self.ep_group) for name in WEIGHTS)
    tp = self.tp_group
    if not getattr(self, "is_transposed", False):  # [E, out, in]; Aria's [E, in, out]
        gate_up, down = gate_up.mT, down.mT
    if tp is None:
        f = down.shape[1]
        weights, trade = (gate_up[..., :f], gate_up[..., f:], down), None
    else:  # the rows of [gate; up] this TP rank holds, its products traded
        weights, trade = (gate_up, None, down), functools.partial(gate_and_up_by_rank, group=tp)
    x = hidden_states[rows] if tp is None else GroupRegion.apply(hidden_states[rows], tp, False)
    grouped = use_grouped_mm(x, weights[2])
    if self.ep_group is None:
        out = expert_compute(x, weights, counts, grouped, trade)
    else:
        out = dispatched_compute(x, weights, counts, self.ep_group, grouped, trade)
    if tp is not None:  # each TP rank's share of the hidden width: partial sums
        out = GroupRegion.apply(out, tp, True)
    out = out * top_k_weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, rows, out.to(hidden_states.dtype))


class _Held:
    """`experts` as this rank holds them: its share of every weight (E/ep experts), the
    rest (flags, gate function, activation, norms) the module's own."""

    def __init__(self, experts: nn.Module, held: dict[str, Tensor]) -> None:
        self.__dict__.update(held)
        self.num_experts = next(iter(held.values())).shape[0]
        self._experts = experts

    def __getattr__(self, name: str) -> object:
        value = getattr(self._experts, name)
        if isinstance(value, types.MethodType) and value.__self__ is self._experts:
            return types.MethodType(value.__func__, self)
        return value


def _own_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' experts forward for experts meshrun does not compute itself (a gate of
    their own, biases, no gate, a norm after each): each token's rows sent to their experts'
    rank, computed there by the family's own forward (the implementation its config names,
    as transformers runs it) over the experts held, each row one assignment of weight 1, and
    brought back to be summed by the router's weights."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: PLC0415 (meshrun[hf])

    order, counts = sorted_by_expert(top_k_index, self.down_proj.shape[0])
    rows = order // top_k_index.shape[1]
    held = _Held(
        self, {n: local_experts(p, self.ep_group) for n, p in self.named_parameters(recurse=False)}
    )
    own = ALL_EXPERTS_FUNCTIONS.get_interface(
        self.config._experts_implementation, type(self).forward.__wrapped__
    )

    def compute(received: Tensor, per_expert: Tensor | list[int]) -> Tensor:
        local = torch.arange(held.num_experts, device=received.device)
        ids = local.repeat_interleave(torch.as_tensor(per_expert, device=received.device))
        ones = torch.ones(len(ids), 1, dtype=received.dtype, device=received.device)
        return own(held, received, ids[:, None], ones)

    out = dispatched(hidden_states[rows], counts, self.ep_group, compute, counts_on_device=True)
    out = out * top_k_weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, rows, out.to(hidden_states.dtype))
