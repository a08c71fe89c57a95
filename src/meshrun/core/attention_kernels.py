"""Which attention kernel runs a causal attention, as a pure function of what decides it, so
the model (models/attention.py), context parallelism's chunk pairs
(rank/parallel/block_attention.py) and the planner (plan/memory.py) agree, and a CPU tests it.

The CUDA rules are torch 2.13's for the inputs meshrun gives (dense, causal, no mask, no
dropout, one head dim for q, k and v), from aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp: `can_use_flash_attention` (sm80 to sm121; fp16/bf16; head dim <= 256; on
sm86-89 and sm120-121 no training with a head dim in (192, 224]), `can_use_mem_efficient_
attention` (sm50 to sm121; fp16, fp32, and bf16 from sm80; the head dim a multiple of
`minimum_gemm_alignment`: 8 in 16-bit, 4 in fp32 from sm80) and `can_use_cudnn_attention`
(sm80 to sm121; fp16/bf16; a head dim <= 128 and a multiple of 8, which every cuDNN 9 takes).
torch's default order tries flash, then efficient, then the math kernel (its s x s scores),
cuDNN last (Context's sDPPriorityOrder); torch's `sdpa_kernel` context turns backends off.

GQA (fewer K/V heads than query heads): of the fused CUDA kernels only flash takes it in
torch 2.13 (flash_api's mha_fwd takes num_heads_k; the memory-efficient kernel indexes K/V
by the query's head, mem_eff_attention/kernel_forward.h); anywhere else SDPA's enable_gqa
falls to the math kernel, unless K/V heads are repeated first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

HALF = ("float16", "bfloat16")
FUSED = ("flash", "efficient", "cudnn")  # torch's default order (math between efficient and cudnn)


@dataclass(frozen=True)
class AttentionSite:
    """What decides the kernel: the device type, the dtype SDPA computes in (torch's name,
    e.g. 'bfloat16'), the head dim, CUDA's (major, minor) capability, the fused backends
    torch has on (torch.backends.cuda.*_sdp_enabled), and whether a backward follows."""

    device_type: str
    dtype: str
    head_dim: int
    capability: tuple[int, int] = (0, 0)
    enabled: frozenset[str] = frozenset(FUSED)
    training: bool = True


def _flash(site: AttentionSite) -> bool:
    cap = site.capability
    if not (8, 0) <= cap <= (12, 1) or site.dtype not in HALF or site.head_dim > 256:
        return False
    consumer = (8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)
    return not (site.training and consumer and 192 < site.head_dim <= 224)


def _efficient(site: AttentionSite) -> bool:
    cap = site.capability
    if not (5, 0) <= cap <= (12, 1):
        return False
    dtypes = ("float16", "float32", "bfloat16") if cap >= (8, 0) else ("float16", "float32")
    if site.dtype not in dtypes:
        return False
    half = site.dtype in HALF
    tensor_cores = cap >= (8, 0) or (cap >= (7, 0) and half)
    alignment = max(4 if cap >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)
    return site.head_dim % alignment == 0


def _cudnn(site: AttentionSite) -> bool:
    return (
        (8, 0) <= site.capability <= (12, 1)
        and site.dtype in HALF
        and site.head_dim <= 128
        and site.head_dim % 8 == 0
    )


_APPLIES = {"flash": _flash, "efficient": _efficient, "cudnn": _cudnn}


def fused_kernel(site: AttentionSite) -> str | None:
    """The fused CUDA kernel torch's order reaches first for a causal attention with equal
    heads (None: the math kernel or another device)."""
    if site.device_type != "cuda":
        return None
    return next((k for k in FUSED if k in site.enabled and _APPLIES[k](site)), None)


def block_kernel(site: AttentionSite) -> str:
    """The kernel of one chunk pair of context parallelism's ring and allgather, which must
    return the log-sum-exp: `cpu_flash` (torch's fused CPU flash kernel) on a CPU, a fused
    CUDA kernel (flash, efficient, cudnn), else `explicit` (the pair's scores held)."""
    if site.device_type == "cpu":
        return "cpu_flash"
    if site.head_dim % 8:  # SDPA pads flash's head dim to a multiple of 8 (attention.cpp's
        site = replace(site, enabled=site.enabled - {"flash"})  # pad_last_dim); a pair does not
    return fused_kernel(site) or "explicit"


def takes_gqa(kernel: str) -> bool:
    """Whether `kernel` attends with fewer K/V heads than query heads itself (the CPU's
    does too, but its chunk pairs keep repeating K/V as they always have)."""
    return kernel == "flash"


def expands_kv_heads(site: AttentionSite) -> bool:
    """Whether GQA attention repeats its K/V heads before SDPA: on CUDA where flash does not
    apply (fp32, say), so that the memory-efficient kernel runs instead of the math kernel's
    s x s scores. Elsewhere SDPA takes enable_gqa itself (the CPU flash kernel does)."""
    return site.device_type == "cuda" and not ("flash" in site.enabled and _flash(site))
