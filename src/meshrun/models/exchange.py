"""Rows traded between ranks by `all_to_all_single`, differentiable: the gradient goes back
the way the rows came. An MoE's dispatch sends each rank the rows of its experts (uneven
split sizes, models/moe.py); context parallelism's Ulysses attention trades sequence shards
for head shards (even splits, rank/parallel/context_attention.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def exchange(
    x: Tensor,
    group: dist.ProcessGroup,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> Tensor:
    """`in_splits[j]` rows of `x` (dim 0) to rank j, `out_splits[i]` rows from rank i, in
    rank order; None: dim 0 split evenly over the group both ways."""
    return _AllToAll.apply(x, group, out_splits, in_splits)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        group: dist.ProcessGroup,
        out_splits: list[int] | None,
        in_splits: list[int] | None,
    ) -> Tensor:
        ctx.group, ctx.splits = group, (in_splits, out_splits)
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _all_to_all(grad, ctx.group, *ctx.splits), None, None, None


def _all_to_all(
    x: Tensor, group: dist.ProcessGroup, out_splits: list[int] | None, in_splits: list[int] | None
) -> Tensor:
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = x.new_empty(rows, *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out
