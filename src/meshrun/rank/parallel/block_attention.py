"""One chunk pair of context parallelism's ring and allgather: its attention with the
log-sum-exp the merge needs, and its backward from the rows' final output and log-sum-exp,
by the kernel core/attention_kernels.block_kernel names. torch's fused kernels, as torch's
own context parallel calls them (torch/distributed/tensor/experimental/_context_parallel/
_attention.py: _templated_ring_attention and its backward, one op call a block):
- `cpu_flash`: aten._scaled_dot_product_flash_attention_for_cpu (+ _backward); lse [b, h, s].
- `flash`: aten._scaled_dot_product_flash_attention (+ _backward); lse [b, h, s] fp32. Takes
  fewer K/V heads than query heads (its backward sums their gradients).
- `efficient`: aten._scaled_dot_product_efficient_attention (+ _backward), log_sumexp asked
  for; its lse is [b, h, ceil(s/32)*32], the rows past s +inf (torch/_meta_registrations.py;
  mem_eff_attention/kernel_forward.h), and its backward reads it so (padded back here).
- `cudnn`: aten._scaled_dot_product_cudnn_attention (+ _backward); lse in the layout this
  torch's meta kernel gives ([b, h, s, 1] in 2.13).
- `explicit`: the pair's scores held, in fp32 with autocast off (devices without a kernel).
The fused kernels compute in the inputs' dtype (16-bit under bf16 autocast); a block's output
and log-sum-exp leave here in fp32 for the merge.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

_aten = torch.ops.aten

# A chunk pair's backward inputs: (dout, q, k, v, out, lse), the rows' final out and lse.
BlockGradInputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def attend(kernel: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """One chunk pair's output and log-sum-exp [b, h, s], both fp32."""
    if kernel == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "explicit":
        return _explicit_attend(q, k, v, causal, scale)
    q, k, v = (t.contiguous() for t in (q, k, v))  # a chunk's K/V is a slice of the block's
    if kernel == "flash":
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    elif kernel == "efficient":
        out, lse, *_ = _aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
    else:
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    return out.float(), lse.flatten(2)[..., : q.shape[2]]


def attend_grads(kernel: str, at: BlockGradInputs, causal: bool, scale: float):
    """One chunk pair's share of dq, dk, dv (flash attention's backward: the softmax rebuilt
    from the rows' final output and log-sum-exp), in the inputs' dtype."""
    if kernel == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *at, 0.0, causal, scale=scale
        )
    if kernel == "explicit":
        return _explicit_grads(at, causal, scale)
    dout, q, k, v, out, lse = at
    rng = q.new_empty((), dtype=torch.int64)  # no dropout: the kernels read no seed
    common = {"dropout_p": 0.0, "is_causal": causal, "scale": scale}
    common |= {"philox_seed": rng, "philox_offset": rng}
    rows, cols = q.shape[2], k.shape[2]
    if kernel == "flash":
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, rows, cols, **common
        )
    if kernel == "efficient":
        padded = F.pad(lse, (0, 32 * math.ceil(rows / 32) - rows), value=math.inf)
        mask = [True, True, True, False]  # no bias
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, grad_input_mask=mask, **common
        )
        return grads[:3]
    lse = lse.view(lse.shape + (1,) * _cudnn_lse_extra_dims())
    dense = {"attn_bias": None, "cum_seq_q": None, "cum_seq_k": None, "max_q": rows, "max_k": cols}
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, **dense, **common
    )


@functools.cache
def _cudnn_lse_extra_dims() -> int:
    """Trailing unit dims of cuDNN's log-sum-exp beyond [b, h, s] in this torch (its meta
    kernel's, which mirrors the CUDA kernel's), which its backward takes back as it gave."""
    x = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bfloat16)
    return _aten._scaled_dot_product_cudnn_attention(x, x, x, None, True)[1].dim() - 3


def _explicit_attend(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """`attend` with the scores held, in fp32 (autocast off: its matmuls would be 16-bit)."""
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = (t.float() for t in (q, k, v))
        scores = _masked(q @ k.transpose(-2, -1) * scale, causal)
        lse = scores.logsumexp(-1)
        return (scores - lse[..., None]).exp() @ v, lse


def _explicit_grads(at: BlockGradInputs, causal: bool, scale: float) -> tuple[Tensor, ...]:
    """`attend_grads` from the held scores, in fp32."""
    with torch.autocast(at[1].device.type, enabled=False):
        dout, q, k, v, out, lse = (t.float() for t in at)
        p = (_masked(q @ k.transpose(-2, -1) * scale, causal) - lse[..., None]).exp()
        ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True)) * scale
        return tuple(
            g.to(at[1].dtype)
            for g in (ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout)
        )


def _masked(scores: Tensor, causal: bool) -> Tensor:
    if not causal:
        return scores
    n = scores.shape[-1]
    above = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(above, float("-inf"))
