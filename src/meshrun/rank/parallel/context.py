"""Context parallelism applied to a model: its blocks' attention shared by the CP group, its
tokens at their global positions.

Each block's forward runs inside a torch function mode that sends causal
`scaled_dot_product_attention` to the configured method (context_attention.py), as torch's
own context_parallel does; a module's code is not changed, so any model whose attention calls
SDPA is reached. The forward is wrapped on the block itself, so an activation checkpoint's
recompute (which calls the block again) runs inside the mode too. What the methods cannot
compute exactly (a mask of the model's own, dropout, non-causal attention) is refused when it
is called; the calls are counted, so validation can probe a user's module on meta for an
attention CP reaches (validate/custom.py). The model's rotary tables (or a user's module, by
its positions keyword) take the rank's global positions (`use_positions`), set on meta and
filled when the model is materialised.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from meshrun.models.moe import MoEFeedForward
from meshrun.rank.parallel.context_attention import AttentionFn, context_attention
from meshrun.rank.parallel.context_shards import sequence_positions

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


class ContextAttention(TorchFunctionMode):
    """Causal SDPA on a rank's sequence shard -> the CP group's attention."""

    def __init__(self, attend: AttentionFn, group: ProcessGroup | None) -> None:
        super().__init__()
        self.attend, self.group = attend, group
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        given = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
        if (
            given.get("attn_mask") is not None
            or given.get("dropout_p", 0.0)
            or not given.get("is_causal", False)
        ):
            raise ValueError(
                "context parallelism computes causal attention without a mask or dropout; this "
                f"model's SDPA call has attn_mask={given.get('attn_mask') is not None}, "
                f"dropout_p={given.get('dropout_p', 0.0)}, is_causal={given.get('is_causal')}"
            )
        q, k, v = given["query"], given["key"], given["value"]
        self.calls += 1
        return self.attend(q, k, v, self.group, scale=given.get("scale"))


def apply_context_parallel(
    model: nn.Module, group: ProcessGroup, method: str, seq_len: int, cp_rank: int, cp: int
) -> None:
    """On meta: every block's attention through `method` over `group`, and the model's
    positions those of CP rank `cp_rank`'s tokens of a `seq_len` sequence; its MoE blocks'
    balance loss over the whole sequence."""
    share_attention(model, ContextAttention(context_attention(method), group))
    model.use_positions(sequence_positions(seq_len, cp_rank, cp))
    for block in model.modules():  # the sequence-wise balance loss sums over the group
        if isinstance(block, MoEFeedForward):
            block.sequence_group = group


def share_attention(model: nn.Module, mode: ContextAttention) -> None:
    """Every block's forward runs inside `mode`."""
    for block in model.layers.values():
        block.forward = _inside(mode, block.forward)


def _inside(mode: ContextAttention, forward) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Tensor:
        with mode:
            return forward(*args, **kwargs)

    return run
