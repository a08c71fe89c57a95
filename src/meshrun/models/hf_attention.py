"""transformers' SDPA attention for the models meshrun builds (models/hf.py), with K/V heads
repeated first where no fused kernel takes GQA (models/attention.py): without a mask
transformers hands SDPA fewer K/V heads with enable_gqa (integrations/sdpa_attention.py,
use_gqa_in_sdpa), which in fp32 on CUDA leaves SDPA only the math kernel's s x s scores.
With a mask transformers repeats them itself."""

from __future__ import annotations

from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa

from meshrun.models.attention import sdpa_kv


def _sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs,
) -> tuple[Tensor, None]:
    if use_gqa_in_sdpa(attention_mask, key, value):
        key, value = sdpa_kv(query, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_meshrun_sdpa() -> None:
    """transformers' `sdpa` attention, in every model of this process, the one above (the
    same but on CUDA where a fused kernel takes no GQA)."""
    AttentionInterface.register("sdpa", _sdpa)
