"""How a rank's routed experts compute their rows (sorted by expert, a block each): one
grouped GEMM (`torch._grouped_mm`) where torch has its native kernel, a loop over the experts
elsewhere, the same numbers either way; under expert parallelism the rows go to the rank of
their expert first and come back after (`dispatched_compute`).

torch 2.13's `_grouped_mm_cuda` (aten/src/ATen/native/cuda/GroupedBlas.cpp) runs CUTLASS's
kernel on sm90 and sm100 with bf16 operands, the offsets read on the device; elsewhere, and on
the CPU, a loop of mm that copies the offsets to the host (`_grouped_mm_fallback`,
ATen/native/GroupedMMUtils.h), no better than meshrun's loop. Autocast has no rule for it (no
AutocastCUDA kernel: `torch._C._dispatch_dump("aten::_grouped_mm")`), so the experts choose it
by the dtype autocast gives their matmuls, and cast its operands to that dtype themselves.

The grouped GEMM's rows: each expert's block and one zero row after it (`padded_groups`). The
kernel needs no group a multiple of some rows: prepare_grouped_gemm_data
(ATen/native/cuda/GroupMMCommon.cuh) checks that only along K of a 2d x 2d product with a
row-major A and along N of 3d x 2d, and the experts' forward and input gradient are 2d x 3d,
their weight gradient 2d x 2d with a column-major A (torchtitan padded to 8 rows in bf16 until
torch dropped the check: pytorch#155466, torchtitan#2774). It needs every group non-empty: an
expert without rows is a weight gradient with K = 0, which the sm100 kernel fills with whatever
its accumulators held (NVIDIA/cutlass#2674, pytorch#172439). And the last offset is the
buffer's end: torch leaves the rows past it unwritten, in the output and in the input gradient
autograd makes (pytorch#154557, #193633). E zero rows a layer, laid out on the device without
reading anything back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from meshrun.models.exchange import exchange

# _scaled_mm_allowed_device(sm90_only=true, sm100_only=true): compute capability 9.x or 10.x
NATIVE_MAJORS = (9, 10)
NATIVE_DTYPE = torch.bfloat16
ROW_BYTES = 16  # a matrix row's stride (check_valid_strides_and_return_transposed)
Trade = Callable[[Tensor], Tensor]


def matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls compute in: autocast's where it is on for `x`'s device
    (it casts mm's operands; `x`, RMSNorm's output, is fp32 there), else `x`'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def grouped_mm_native(
    device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype, widths: Iterable[int]
) -> bool:
    """Whether `torch._grouped_mm` runs its native kernel: CUDA sm90 or sm100 (`capability`),
    bf16 operands, every row of its matrices (`widths`: the experts' model and hidden widths)
    a multiple of 16 bytes."""
    if device_type != "cuda" or capability is None or capability[0] not in NATIVE_MAJORS:
        return False
    return dtype == NATIVE_DTYPE and all(w * dtype.itemsize % ROW_BYTES == 0 for w in widths)


def use_grouped_mm(x: Tensor, w2: Tensor) -> bool:
    """`grouped_mm_native` for rows `x` here and the experts' w2 [E, f, h] (this rank's)."""
    device = x.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return grouped_mm_native(device.type, capability, matmul_dtype(x), w2.shape[-2:])


def padded_groups(counts: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(where each of `rows` rows, sorted by group with `counts` a group, sits once one zero
    row follows each group; the padded groups' end offsets, int32, the last `rows` + groups):
    computed on `counts`' device (`rows` is their sum, known without reading them)."""
    ends = counts.cumsum(0)
    index = torch.arange(rows, device=counts.device)
    positions = index + torch.searchsorted(ends, index, right=True)
    offsets = ends + torch.arange(1, counts.numel() + 1, device=counts.device)
    return positions, offsets.to(torch.int32)


def expert_compute(
    x: Tensor,
    weights: tuple[Tensor, Tensor | None, Tensor],
    counts: Tensor | list[int],
    grouped: bool,
    trade: Trade | None = None,
) -> Tensor:
    """SwiGLU of each expert over its block of `x` (rows sorted by expert, `counts` a block):
    w1, w3 [E, h, f] and w2 [E, f, h]; `grouped`: one grouped GEMM a matrix, in the matmuls'
    dtype, else a loop (which splits `x` by `counts` read on the host). `trade`: w1 is a fused
    [E, h, 2f] block whose product `trade` turns into this rank's gate columns then its up
    columns (transformers' experts under etp, models/hf_experts.py); w3 is None."""
    if grouped:
        return _grouped(x, weights, torch.as_tensor(counts, device=x.device), trade)
    w1, w3, w2 = weights
    sizes = counts if isinstance(counts, list) else counts.tolist()
    blocks = x.split(sizes)
    if trade is None:
        outs = [(F.silu(block @ w1[e]) * (block @ w3[e])) @ w2[e] for e, block in enumerate(blocks)]
    else:
        gate, up = trade(torch.cat([block @ w1[e] for e, block in enumerate(blocks)])).chunk(2, -1)
        outs = [block @ w2[e] for e, block in enumerate((F.silu(gate) * up).split(sizes))]
    return torch.cat(outs) if outs else x.new_empty(0, w2.shape[-1])


def _grouped(
    x: Tensor, weights: tuple[Tensor, Tensor | None, Tensor], counts: Tensor, trade: Trade | None
) -> Tensor:
    dtype = matmul_dtype(x)
    positions, offsets = padded_groups(counts, x.shape[0])
    padded = x.new_zeros(x.shape[0] + counts.numel(), x.shape[1], dtype=dtype)
    padded = padded.index_copy(0, positions, x.to(dtype))
    w1, w3, w2 = (None if w is None else w.to(dtype) for w in weights)
    if trade is None:
        gate, up = (torch._grouped_mm(padded, w, offs=offsets) for w in (w1, w3))
    else:
        gate, up = trade(torch._grouped_mm(padded, w1, offs=offsets)).chunk(2, -1)
    return torch._grouped_mm(F.silu(gate) * up, w2, offs=offsets).index_select(0, positions)


def dispatched_compute(
    x: Tensor,
    weights: tuple[Tensor, Tensor | None, Tensor],
    counts: Tensor | list[int],
    group: dist.ProcessGroup,
    grouped: bool,
    trade: Trade | None = None,
) -> Tensor:
    """`expert_compute` with the experts split over `group` (this rank holds `weights`,
    E/ep consecutive experts): `dispatched`."""

    def compute(rows: Tensor, per_expert: Tensor | list[int]) -> Tensor:
        return expert_compute(rows, weights, per_expert, grouped, trade)

    return dispatched(x, counts, group, compute, counts_on_device=grouped)


def dispatched(
    x: Tensor,
    counts: Tensor | list[int],
    group: dist.ProcessGroup,
    compute: Callable[[Tensor, Tensor | list[int]], Tensor],
    counts_on_device: bool,
) -> Tensor:
    """Expert parallelism (this rank holds E/ep consecutive experts): each block of rows of
    `x` (sorted by expert, `counts` a block) goes to its expert's rank, the rows from every
    rank are computed there by `compute` (rows sorted by this rank's experts, how many each:
    on the device where `counts_on_device`, else a list), and come back in order. After one
    all-to-all of the counts, two of rows forward (there and back), two backward.
    all_to_all_single takes its split sizes on the host: one host sync a call, the only one
    (torchtitan's dispatch reads them back too); the grouped GEMM takes its counts from the
    device."""
    ep = dist.get_world_size(group)
    counts = torch.as_tensor(counts, device=x.device)
    local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    # [source or destination rank, expert]: what this rank sends, what it receives
    mine, theirs = torch.stack([counts, received]).cpu().view(2, ep, local).unbind(0)
    sent, arriving = mine.sum(1).tolist(), theirs.sum(1).tolist()
    rows = exchange(x, group, arriving, sent)
    # rows arrive by (source rank, expert): regrouped by expert, each a contiguous block
    expert_of_row = torch.arange(local, device=x.device).repeat(ep)
    per_row = expert_of_row.repeat_interleave(received, output_size=sum(arriving))
    order = per_row.argsort(stable=True)
    per_expert = received.view(ep, local).sum(0) if counts_on_device else theirs.sum(0).tolist()
    out = compute(rows[order], per_expert)
    return exchange(out[order.argsort()], group, sent, arriving)
