"""transformers' SDPA attention for the models meshrun builds (models/hf.py), with K/V heads
repeated first where no fused kernel takes GQA (models/attention.py): without a mask
transformers hands SDPA fewer K/V heads with enable_gqa (integrations/sdpa_attention.py,
use_gqa_in_sdpa), which in fp32 on CUDA leaves SDPA only the math kernel's s x s scores.
With a mask transformers repeats them itself. A sliding window is such a mask, which
meshrun builds itself (it calls the layers, not the model's forward that would)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PretrainedConfig
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


def sliding_windows(config: PretrainedConfig) -> dict[int, int]:
    """Each layer's sliding window, where it has one: by `config.layer_types` where the
    config lists them (Qwen2, Gemma), else `config.sliding_window` on every layer
    (Mistral), none where `use_sliding_window` is false."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return {}
    types = getattr(config, "layer_types", None)
    if types is None:
        return dict.fromkeys(range(config.num_hidden_layers), window)
    return {i: window for i, kind in enumerate(types) if kind == "sliding_attention"}


@functools.cache
def sliding_window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, seq, seq]: True where query q attends key k, k <= q < k + window: transformers'
    causal_mask_function and sliding_window_overlay (masking_utils.py:78, 97), which its own
    forward builds from the config; meshrun calls the layers itself."""
    q = torch.arange(seq, device=device)[:, None]
    k = torch.arange(seq, device=device)[None, :]
    return ((k <= q) & (q - k < window))[None, None]
