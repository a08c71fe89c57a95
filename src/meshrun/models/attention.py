"""Causal SDPA with GQA, and what a call's tensors tell the kernel rules
(core/attention_kernels.py): the device's capability and the SDPA backends torch has on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from meshrun.core.attention_kernels import AttentionSite, expands_kv_heads


def _enabled() -> frozenset[str]:
    """The fused backends torch may run now (torch.nn.attention.sdpa_kernel sets these)."""
    cuda = torch.backends.cuda
    on = {
        "flash": cuda.is_flash_attention_available() and cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
    }
    return frozenset(name for name, enabled in on.items() if enabled)


def sdpa_dtype(x: Tensor) -> torch.dtype:
    """The dtype SDPA computes `x` in: autocast's where autocast is on for its device (SDPA
    is on CUDA autocast's lower-precision list), else its own."""
    device = x.device.type
    if device == "cuda" and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def attention_site(q: Tensor, dtype: torch.dtype, training: bool) -> AttentionSite:
    """The kernel rules' view of an attention over `q`'s device and head dim in `dtype`."""
    cuda = q.device.type == "cuda"
    return AttentionSite(
        q.device.type,
        str(dtype).removeprefix("torch."),
        q.shape[-1],
        torch.cuda.get_device_capability(q.device) if cuda else (0, 0),
        _enabled() if cuda else frozenset(),
        training,
    )


def sdpa_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """[b, h_kv, s, d] K/V for SDPA with [b, h, s, d] queries (h a multiple of h_kv): their
    heads repeated (SDPA's enable_gqa order) where no fused kernel takes GQA
    (expands_kv_heads), else as they are."""
    groups = q.shape[1] // k.shape[1]
    training = torch.is_grad_enabled() and q.requires_grad
    if groups > 1 and expands_kv_heads(attention_site(q, sdpa_dtype(q), training)):
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return k, v


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal SDPA with GQA, its K/V as `sdpa_kv` gives them."""
    k, v = sdpa_kv(q, k, v)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
