"""torch's fused CUDA attention ops (flash, memory-efficient, cuDNN) given CPU kernels for a
test, so context parallelism's chunk pairs (rank/parallel/block_attention.py) run their CUDA
code on a CPU. Each op answers in the layout torch 2.13's CUDA kernel gives (its meta kernel,
torch/_meta_registrations.py: flash's log-sum-exp [b, h, s], efficient's padded to a
multiple of 32 with +inf rows, cuDNN's [b, h, s, 1]) and refuses what the CUDA kernel
refuses (the memory-efficient and cuDNN kernels read K/V by the query's head; efficient's
backward wants its forward's padded log-sum-exp, 8-aligned, sdp_utils.cpp and
mem_eff_attention/kernel_backward.h), and computes with torch's CPU flash kernel. The CUDA
kernels themselves are proved on a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

_aten = torch.ops.aten
_cpu, _cpu_backward = (
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward,
)


def _rng() -> Tensor:
    return torch.empty((), dtype=torch.int64)


def _equal_heads(q: Tensor, k: Tensor, kernel: str) -> None:
    if q.shape[1] != k.shape[1]:
        raise RuntimeError(f"{kernel}: q has {q.shape[1]} heads, k {k.shape[1]}")


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _cpu(q, k, v, dropout_p, is_causal, scale=scale)
    s_q, s_k = q.shape[2], k.shape[2]
    return out, lse, _rng(), _rng(), s_q, s_k, _rng(), _rng(), _rng()


def _flash_backward(
    dout, q, k, v, out, lse, cq, ck, mq, mk, p, causal, seed, offset, *, scale=None
):
    if lse.shape != q.shape[:3] or not lse.is_contiguous():
        raise RuntimeError(f"flash backward: lse {tuple(lse.shape)} is not a contiguous [b, h, s]")
    return _cpu_backward(dout, q, k, v, out, lse, p, causal, scale=scale)


def _efficient(q, k, v, bias, lse_wanted, dropout_p=0.0, is_causal=False, *, scale=None):
    _equal_heads(q, k, "efficient")
    out, lse = _cpu(q, k, v, dropout_p, is_causal, scale=scale)
    padded = 32 * math.ceil(q.shape[2] / 32)
    return (
        out,
        torch.nn.functional.pad(lse, (0, padded - q.shape[2]), value=math.inf),
        _rng(),
        _rng(),
    )


def _efficient_backward(
    dout, q, k, v, bias, out, lse, seed, offset, p, mask, causal=False, *, scale=None
):
    _equal_heads(q, k, "efficient backward")
    rows = q.shape[2]
    if lse.shape[-1] != 32 * math.ceil(rows / 32) or lse.stride(1) % 8 or lse.stride(0) % 8:
        raise RuntimeError(f"efficient backward: lse {tuple(lse.shape)} is not as its forward gave")
    if not torch.isinf(lse[..., rows:]).all():
        raise RuntimeError("efficient backward: lse's padding rows are not +inf")
    grads = _cpu_backward(dout, q, k, v, out, lse[..., :rows].contiguous(), p, causal, scale=scale)
    return (*grads, torch.empty(0))


def _cudnn(q, k, v, bias, lse_wanted, dropout_p=0.0, is_causal=False, debug=False, *, scale=None):
    _equal_heads(q, k, "cudnn")
    out, lse = _cpu(q, k, v, dropout_p, is_causal, scale=scale)
    s_q, s_k = q.shape[2], k.shape[2]
    return out, lse.unsqueeze(-1), _rng(), _rng(), s_q, s_k, _rng(), _rng(), _rng()


def _cudnn_backward(
    dout, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, p, causal, *, scale=None
):
    _equal_heads(q, k, "cudnn backward")
    if lse.shape != (*q.shape[:3], 1):
        raise RuntimeError(f"cudnn backward: lse {tuple(lse.shape)} is not [b, h, s, 1]")
    return _cpu_backward(dout, q, k, v, out, lse.squeeze(-1), p, causal, scale=scale)


_KERNELS = {
    "_scaled_dot_product_flash_attention": _flash,
    "_scaled_dot_product_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_efficient_attention": _efficient,
    "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
    "_scaled_dot_product_cudnn_attention": _cudnn,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_backward,
}


@contextlib.contextmanager
def cuda_attention_on_cpu() -> Iterator[None]:
    """Inside, the CUDA attention ops run on CPU tensors as described above."""
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in _KERNELS.items():
        lib.impl(name, kernel, "CPU")
    try:
        yield
    finally:
        lib._destroy()
