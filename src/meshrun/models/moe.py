"""Mixture-of-experts feed-forward: a router sends each token to its top-k experts (SwiGLU
each), shared experts see every token, and the outputs are summed by the router's weights.

Routing runs in fp32 (scores decide which expert a token meets: bf16 ties would flip it).
Tokens are sorted by expert so each expert multiplies one contiguous block: one grouped GEMM
(`torch._grouped_mm`) where the device has a native kernel for it, a loop over the experts
elsewhere, the same numbers either way (models/expert_compute.py).

Expert parallelism (rank/parallel/expert.py) splits the experts over ranks: `Experts` then
sends each block of rows to its expert's rank and back (`dispatched_compute`, all-to-alls
with autograd), and under etp each rank computes its share of every expert's hidden width.

Load balance: the sequence-wise auxiliary loss of DeepSeek-V3 (eq. 17-20): per sequence,
alpha * sum_i f_i P_i, f_i the share of the sequence's top-k assignments expert i got
(times experts / k), P_i its mean normalised score; the batch's loss is the mean over
sequences. Per sequence, not per batch: then a batch's loss is the same sum however data
parallelism and micro-batching split the batch, so every layout trains the same model. It
reaches the gradients from inside the block (`_AuxLossGrad`, as DeepSeek's own
AddAuxiliaryLoss): a pipeline stage's blocks never see the last stage's loss, so the loss
cannot be added there; the weight it enters with is the training loss's (`loss_weight`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from meshrun.core.config import MoEConfig
from meshrun.models.expert_compute import dispatched_compute, expert_compute, use_grouped_mm

_LOSS_WEIGHT = [1.0]  # what the training loss of the current micro-batch is multiplied by
_EVEN_ROUTING = [False]
_COUNTED = [True]


@contextlib.contextmanager
def _pushed(stack: list, value: object) -> Iterator[None]:
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def loss_weight(weight: float) -> contextlib.AbstractContextManager[None]:
    """The auxiliary loss enters the gradients with `weight`, the factor the step puts on
    its micro-batch's training loss (1/micro-batches, fp16's loss scale), for a forward and
    the backward that follows (activation checkpointing recomputes the forward there)."""
    return _pushed(_LOSS_WEIGHT, weight)


def even_routing() -> contextlib.AbstractContextManager[None]:
    """Every expert gets the same share of the assignments, whatever the scores: the load
    the planner assumes, and how it traces a block on fake tensors (plan/traced.py), which
    have no values to route by; no assignment is dropped."""
    return _pushed(_EVEN_ROUTING, True)


def uncounted() -> contextlib.AbstractContextManager[None]:
    """Forwards of no real tokens (a pipeline stage's shape inference, on zeros or empty
    tensors) leave the step's router statistics alone, and so load_balance=bias's update."""
    return _pushed(_COUNTED, False)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the hidden states; backward also sends the current loss weight into the
    auxiliary loss, as if it had been added to the training loss."""

    @staticmethod
    def forward(ctx, hidden: Tensor, aux: Tensor) -> Tensor:
        ctx.weight = _LOSS_WEIGHT[-1]
        return hidden

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.full((), ctx.weight, device=grad.device)


class _ScaledGrad(torch.autograd.Function):
    """Identity; the gradient times `factor`. An ep-sharded expert's gradient sums the
    tokens of all its ep group's ranks, each rank's loss a mean over its own: what the dense
    weights' data-parallel mean makes of it is that sum over ep (FSDP2 averages over the
    ranks it reduces the expert over, which ep is not among)."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def local_experts(weight: Tensor, ep_group: dist.ProcessGroup | None) -> Tensor:
    """This rank's share of an expert weight split over ep (Shard(0)) and/or the TP ranks
    (a DTensor), with the gradient `_ScaledGrad` gives an ep-split one."""
    local = weight.to_local()
    return local if ep_group is None else _ScaledGrad.apply(local, 1 / ep_group.size())


class GroupRegion(torch.autograd.Function):
    """Megatron's f and g over a group: around a tensor-parallel block of the experts (etp),
    and g around the balance loss's per-sequence sums under CP: `reduce`
    False, identity forward and the gradient all-reduced over the TP ranks (each computed
    its share of the hidden width from the same rows); True, the partial outputs all-reduced
    forward and the gradient passed as it is."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, reduce: bool) -> Tensor:
        ctx.group, ctx.reduce = group, reduce
        if not reduce:
            return x.view_as(x)
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        if not ctx.reduce:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def sorted_by_expert(chosen: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """(the assignments sorted by expert: token t's j-th expert at t * k + j, stable within
    an expert, so in token order; how many each expert got, counted on the device: bincount
    reads the largest value back on CUDA, SummaryOps.cu's _bincount_cuda)."""
    assigned = chosen.flatten()
    counts = assigned.new_zeros(experts).scatter_add_(0, assigned, torch.ones_like(assigned))
    return assigned.argsort(stable=True), counts


@dataclass
class Routing:
    """What a router decided for a micro-batch: what the metrics report (tokens per expert,
    dropped assignments, the auxiliary loss before its coefficient)."""

    tokens_per_expert: Tensor
    dropped: Tensor
    aux_loss: Tensor


# A step's router statistics a layer: tokens per expert, then dropped assignments, the
# summed balance loss and the forwards they came from.
STAT_EXTRA = 3


class Experts(nn.Module):
    """The routed experts' weights, one 3-D tensor a matrix (dim 0: the expert), so FSDP
    shards them by expert and a checkpoint holds each matrix once. A module of its own with
    its own forward, so FSDP2 can gather them as a unit (expert parallelism shards them
    over other ranks than the rest of the block). `grouped_mm` False: the loop over the
    experts wherever the grouped GEMM would run (model.moe.grouped_mm)."""

    def __init__(self, experts: int, dim: int, hidden: int, grouped_mm: bool = True) -> None:
        super().__init__()
        self.grouped_mm = grouped_mm
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        # expert parallelism's groups (rank/parallel/expert.py): the ranks the experts are
        # split over, and the TP ranks each expert's hidden width is split over (etp)
        self.ep_group: dist.ProcessGroup | None = None
        self.tp_group: dist.ProcessGroup | None = None

    def forward(self, x: Tensor, counts: Tensor | list[int]) -> Tensor:
        """Each expert's SwiGLU over its block of `x` (rows sorted by expert)."""
        w = (self.w1, self.w3, self.w2)
        if self.ep_group is not None or self.tp_group is not None:
            w = tuple(local_experts(t, self.ep_group) for t in w)
        grouped = self.grouped_mm and use_grouped_mm(x, w[2])
        if self.tp_group is not None:
            x = GroupRegion.apply(x, self.tp_group, False)
        if self.ep_group is None:
            out = expert_compute(x, w, counts, grouped)
        else:
            out = dispatched_compute(x, w, counts, self.ep_group, grouped)
        return out if self.tp_group is None else GroupRegion.apply(out, self.tp_group, True)


class MoEFeedForward(nn.Module):
    def __init__(
        self, cfg: MoEConfig, dim: int, hidden: int, shared: nn.Module | None, layer: int
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, dim, hidden, cfg.grouped_mm)
        self.shared = shared
        self.layer = layer  # the block's index in the whole model
        self.routing: Routing | None = None  # the last forward's
        self.step_stats: Tensor | None = None  # summed since `take_router_stats`
        # load_balance=bias: added to the scores that pick a token's experts (a checkpoint
        # keeps it: it is what the steps so far learnt of the loads)
        self.register_buffer("expert_bias", torch.zeros(cfg.experts, dtype=torch.float32))
        # context parallelism's group (rank/parallel/context.py): the ranks holding the rest
        # of each sequence, whose tokens the sequence-wise balance loss counts too
        self.sequence_group: dist.ProcessGroup | None = None

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, chosen, scores = self._route(tokens)
        k, experts = self.cfg.top_k, self.cfg.experts
        if _EVEN_ROUTING[-1]:
            kept, counts, dropped = _even(tokens.shape[0] * k, experts, x.device)
        else:
            order, counts = sorted_by_expert(chosen, experts)
            kept, counts, dropped = self._capacity(order, chosen.flatten(), counts, tokens.shape[0])
        rows = kept // k
        out = self.experts(tokens[rows], counts)
        out = out * weights.flatten()[kept, None].to(out.dtype)
        routed = torch.zeros_like(tokens).index_add_(0, rows, out.to(tokens.dtype))
        if self.shared is not None:
            routed = routed + self.shared(tokens)
        aux = self._aux_loss(scores, chosen, batch, seq)
        self.routing = Routing(torch.as_tensor(counts), dropped, aux.detach())
        # (a checkpointed block's recompute counts again: the ratios stay)
        if self.training and _COUNTED[-1]:
            self._count(self.routing)
        routed = routed.view(batch, seq, dim)
        if self.training and self.cfg.load_balance == "aux_loss" and aux.requires_grad:
            # under CP each rank holds the sequence's loss whole, and FSDP2 averages the CP
            # ranks' gradients: each sends its share's times their number
            spread = 1 if self.sequence_group is None else self.sequence_group.size()
            routed = _AuxLossGrad.apply(routed, aux * self.cfg.aux_loss_coef * spread)
        return routed

    def _count(self, r: Routing) -> None:
        one = torch.ones((), device=r.aux_loss.device)
        extra = torch.stack([r.dropped.to(one), r.aux_loss, one])
        row = torch.cat([r.tokens_per_expert.to(one), extra])
        self.step_stats = row if self.step_stats is None else self.step_stats + row

    def _route(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(top-k weights [T, k], their experts [T, k], every expert's score [T, E]), fp32;
        the top-k weights renormalised to sum to one (Mixtral, DeepSeek-V3)."""
        logits = F.linear(tokens.float(), self.gate.weight.float())
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        if self.cfg.load_balance == "bias":
            chosen = (scores + self.expert_bias.float()).topk(self.cfg.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
        else:
            weights, chosen = scores.topk(self.cfg.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), chosen, scores

    def _capacity(
        self, order: Tensor, assigned: Tensor, counts: Tensor, n_tokens: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(the assignments computed, sorted by expert; tokens each expert computes; how
        many were dropped): each expert's first `capacity` in token order, all without a
        capacity factor."""
        factor = self.cfg.capacity_factor
        if factor is None:
            return order, counts, torch.zeros((), dtype=torch.long, device=order.device)
        capacity = math.ceil(factor * n_tokens * self.cfg.top_k / self.cfg.experts)
        starts = counts.cumsum(0) - counts
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[assigned[order]]
        keep = rank_in_expert < capacity
        return order[keep], counts.clamp(max=capacity), (~keep).sum()

    def _aux_loss(self, scores: Tensor, chosen: Tensor, batch: int, seq: int) -> Tensor:
        """The sequence-wise balance loss (module docstring), mean over the sequences; under
        CP each sequence's counts and scores summed over its ranks (Megatron all-reduces them
        over its TP x CP group), the scores' gradient each rank's own."""
        experts, k = self.cfg.experts, self.cfg.top_k
        picks = chosen.view(batch, seq * k)
        per_sequence = scores.new_zeros(batch, experts).scatter_add_(
            1, picks, torch.ones_like(picks, dtype=scores.dtype)
        )
        shares = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, experts).sum(1)
        if self.sequence_group is not None:
            dist.all_reduce(per_sequence, group=self.sequence_group)
            shares = GroupRegion.apply(shares, self.sequence_group, True)
            seq *= self.sequence_group.size()
        f = per_sequence * experts / (k * seq)
        return (f * shares / seq).sum(-1).mean()


def _even(assignments: int, experts: int, device: torch.device) -> tuple[Tensor, list[int], Tensor]:
    """`even_routing`'s assignments, sorted by expert: assignment a goes to expert a mod E."""
    kept = (torch.arange(assignments, device=device) % experts).argsort(stable=True)
    counts = [assignments // experts + (e < assignments % experts) for e in range(experts)]
    return kept, counts, torch.zeros((), dtype=torch.long)


def _blocks(modules: list[nn.Module]) -> Iterator[MoEFeedForward]:
    return (b for module in modules for b in module.modules() if isinstance(b, MoEFeedForward))


def take_router_stats(
    modules: list[nn.Module], layers: int, experts: int, device: torch.device
) -> Tensor:
    """The step's router statistics of every MoE block in `modules` ([layers, experts + 3],
    zero rows for the blocks another pipeline rank holds, so a sum over the stages has them
    all); the blocks start counting the next step."""
    stats = torch.zeros(layers, experts + STAT_EXTRA, device=device)
    for block in _blocks(modules):
        if block.step_stats is not None:
            stats[block.layer] = block.step_stats
            block.step_stats = None
    return stats


def router_fields(stats: Tensor, balance_loss: bool) -> dict[str, float | list[float]]:
    """A step's record of its routers ([layers, experts + 3], summed over micro-batches; a
    mean over data-parallel ranks leaves the ratios as they are; NaN: not counted): the
    busiest expert's load over the mean (the worst layer's, and each layer's), the share of
    assignments dropped, and where the model trains with it, the balance loss (mean over
    layers and micro-batches, before its coefficient; under CP a rank's would be its chunks')."""
    counts, (dropped, aux, forwards) = stats[:, :-STAT_EXTRA], stats[:, -STAT_EXTRA:].unbind(1)
    if stats.isnan().any() or not forwards.any():  # (DataParallel's replicas count apart)
        return {}
    per_layer = (counts.max(-1).values / counts.mean(-1).clamp(min=1e-12)).tolist()
    assigned = counts.sum() + dropped.sum()
    fields = {
        "moe_max_load": max(per_layer),
        "moe_max_load_per_layer": per_layer,
        "moe_dropped": (dropped.sum() / assigned.clamp(min=1e-12)).item(),
    }
    if balance_loss:
        fields["moe_aux_loss"] = (aux / forwards.clamp(min=1)).mean().item()
    return fields


@torch.no_grad()
def update_biases(modules: list[nn.Module], counts: Tensor, rate: float) -> None:
    """load_balance=bias after a step: each expert's bias up by `rate` where the step's
    batch gave it fewer tokens than the mean, down where more (`counts`: [layers, experts],
    the same on every data-parallel rank, so their biases stay equal)."""
    for block in _blocks(modules):
        load = counts[block.layer].to(block.expert_bias.device)
        block.expert_bias += rate * torch.sign(load.mean() - load)


@dataclass(frozen=True)
class Routers:
    """What a training loop needs to know of an MoE model's routers: the statistics' shape,
    whether the balance loss is trained (and so recorded), and load_balance=bias's rate
    (0: no biases to move)."""

    layers: int
    experts: int
    balance_loss: bool
    bias_rate: float

    @classmethod
    def of(cls, layers: int, moe: MoEConfig) -> Routers | None:
        """The routers of `layers` blocks of meshrun's MoE `moe`; None where it is dense."""
        if not moe.experts:
            return None
        rate = moe.bias_update_rate if moe.load_balance == "bias" else 0.0
        return cls(layers, moe.experts, moe.load_balance == "aux_loss", rate)
