"""Context parallelism: one sequence's causal attention shared by the ranks of a CP group.

Each rank holds its load-balanced shard of the sequence (context_shards.py).

Attention. Each method takes causal SDPA's arguments on a rank's shards, q [b, h, s, d] and
k, v [b, h_kv, s, d] (GQA: h a multiple of h_kv), and returns this rank's rows of the full
sequence's causal attention, forward and backward:
- `ring`: K/V blocks go round the group by send/recv, the next block's transfer posted
  before the current block's attention computes; partial outputs merge by log-sum-exp and
  the backward passes K/V with their gradient accumulators round the same way (Liu et al.
  2023). No rank ever holds more than two blocks of K/V.
- `allgather`: K/V gathered once per call (backward: dK/dV reduce-scattered), then the
  ring's chunk-pair attention over all blocks at once; cheap when GQA leaves few K/V heads.
- `alltoall`: Ulysses (Jacobs et al. 2023): an all-to-all turns sequence shards into head
  shards (h/cp heads of the whole sequence), plain causal SDPA, and an all-to-all back.

A ring or allgather chunk pair runs the kernel core/attention_kernels.block_kernel names
(block_attention.py): torch's fused one that returns the log-sum-exp where one applies, in
SDPA's dtype (16-bit under bf16 autocast), the scores held in fp32 only where none does;
partial outputs and log-sum-exps merge in fp32, gradients sum over blocks in fp32.

Every collective is torch.distributed's on the `group` passed in, waited on with the group's
own timeout (gloo's send/recv included: a recv whose peer never sends raises after it). gloo
on CPU has every op used here: batch_isend_irecv, all_gather_into_tensor (flat buffers: gloo
refuses a stacked [cp, ...] output), reduce_scatter_tensor, all_to_all_single, all_reduce.
The collectives autograd must see through sit inside small autograd.Functions over those
public ops; torch's autograd functional collectives work too, but live in a private module
whose names change between the torch versions meshrun supports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from meshrun.core.attention_kernels import block_kernel, takes_gqa
from meshrun.core.collective_names import ALL_GATHER, REDUCE_SCATTER
from meshrun.models.attention import attention_site, causal_sdpa, sdpa_dtype
from meshrun.models.exchange import exchange
from meshrun.rank.parallel.block_attention import attend, attend_grads
from meshrun.rank.parallel.context_shards import (
    load_balanced_chunks,
    shard_sequence,
    unshard_sequence,
)

AttentionFn = Callable[..., Tensor]

# p2p tags: K/V blocks and their gradient accumulators travel the ring side by side.
_KV_TAG, _GRAD_TAG = 0, 1

# ---- shared checks and GQA ---------------------------------------------------------------


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Refuse shards the methods cannot pair: they all assume two equal chunks per rank."""
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not pair")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"heads ({q.shape[1]}) must be a multiple of K/V heads ({k.shape[1]})")
    if q.shape[2] % 2:
        raise ValueError(f"a rank's shard has two chunks; its length {q.shape[2]} is odd")


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    """K/V heads repeated for their query heads (SDPA's enable_gqa order)."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _fold_kv(x: Tensor, groups: int) -> Tensor:
    """The gradient of `_expand_kv`: each K/V head sums its query heads' share."""
    return x.unflatten(1, (-1, groups)).sum(2) if groups > 1 else x


# ---- ring ---------------------------------------------------------------------------------


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, scale: float | None = None
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence, K/V passed round."""
    _check_shapes(q, k, v)
    return _RingAttention.apply(q, k, v, group, _scale(q, scale))


def post_shift(x: Tensor, group: ProcessGroup, tag: int) -> Callable[[], Tensor]:
    """Send `x` to the next rank and receive the previous rank's, now; the returned wait
    gives what arrived. Posted before compute, so the transfer runs behind it."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:
        return lambda: x
    received = torch.empty_like(x)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % cp, tag=tag),
            dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % cp, tag=tag),
        ]
    )

    def wait() -> Tensor:
        for work in works:
            work.wait()  # the group's timeout applies
        return received

    return wait


@dataclass(frozen=True)
class _Ring:
    """What every ring step needs to know: who this rank is, the shards' geometry, and the
    chunk pairs' kernel (block_attention.py) with the dtype it computes in."""

    group: ProcessGroup
    rank: int
    cp: int
    chunk: int  # tokens per chunk
    repeats: int  # K/V heads repeated for the kernel: query heads per K/V head, or 1
    scale: float
    kernel: str
    dtype: torch.dtype

    @classmethod
    def of(cls, q: Tensor, k: Tensor, group: ProcessGroup, scale: float) -> _Ring:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        kernel, dtype = _kernel(q)
        repeats = 1 if takes_gqa(kernel) else q.shape[1] // k.shape[1]
        return cls(group, rank, cp, q.shape[2] // 2, repeats, scale, kernel, dtype)

    @property
    def accumulate(self) -> torch.dtype:
        """Gradients summed over blocks in fp32 at least: bf16 partial sums would drift."""
        return torch.promote_types(self.dtype, torch.float32)

    def pairs(self, step: int) -> Iterator[tuple[slice, slice, bool]]:
        """Every (query chunk, K/V chunk) of this rank's rows and the block held at `step`
        (rank - step's) with any entry visible: the query rows, the block's rows, and whether
        they are the same chunk (causal within it; an earlier chunk is all visible)."""
        c = self.chunk
        kv_chunks = load_balanced_chunks((self.rank - step) % self.cp, self.cp)
        for i, q_chunk in enumerate(load_balanced_chunks(self.rank, self.cp)):
            for j, kv_chunk in enumerate(kv_chunks):
                if kv_chunk <= q_chunk:
                    yield slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), kv_chunk == q_chunk


def _kernel(q: Tensor) -> tuple[str, torch.dtype]:
    """The chunk pairs' kernel for `q` and the dtype they compute in: a fused CUDA kernel's
    is SDPA's (16-bit under bf16 autocast); the CPU kernel and held scores compute in fp32
    at least."""
    dtype = sdpa_dtype(q)
    kernel = block_kernel(attention_site(q, dtype, training=True))
    if kernel in ("cpu_flash", "explicit"):
        dtype = torch.promote_types(q.dtype, torch.float32)
    return kernel, dtype


def _merge(
    out: Tensor | None, lse: Tensor | None, block: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Two partial softmax outputs as one, weighted by their log-sum-exps (stable form)."""
    if out is None or lse is None:
        return block, block_lse
    out = out - torch.sigmoid(block_lse - lse)[..., None] * (out - block)
    return out, lse - F.logsigmoid(lse - block_lse)


def _ring_blocks(kv: Tensor, ring: _Ring) -> Iterator[Tensor]:
    """The K/V block held at each ring step; the next one's transfer is posted before the
    current one is handed out, so it runs behind that block's attention."""
    for step in range(ring.cp):
        arriving = post_shift(kv, ring.group, _KV_TAG) if step + 1 < ring.cp else None
        yield kv
        if arriving:
            kv = arriving()


def _blocks_forward(q: Tensor, blocks: Iterable[Tensor], ring: _Ring) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp of this rank's rows from every rank's K/V block, `blocks`
    giving the block of rank (rank - step) at each step: chunk pair by chunk pair, merged."""
    outs: list[Tensor | None] = [None, None]
    lses: list[Tensor | None] = [None, None]
    for step, kv in enumerate(blocks):
        for rows, cols, causal in ring.pairs(step):
            i = rows.start // ring.chunk
            k, v = (_expand_kv(t[:, :, cols], ring.repeats) for t in kv)
            q_rows = q[:, :, rows].contiguous()
            block, lse = attend(ring.kernel, q_rows, k, v, causal, ring.scale)
            outs[i], lses[i] = _merge(outs[i], lses[i], block, lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)  # type: ignore[arg-type]


def _block_grads(
    saved: tuple[Tensor, Tensor, Tensor, Tensor], kv: Tensor, step: int, ring: _Ring
) -> tuple[Tensor, Tensor]:
    """This rank's queries' gradients against the block of rank (rank - step): (dq, [dk, dv]
    of the block)."""
    q, dout, out, lse = saved
    dq = torch.zeros_like(q, dtype=ring.accumulate)
    dkv = torch.zeros_like(kv, dtype=ring.accumulate)
    for rows, cols, causal in ring.pairs(step):
        k, v = (_expand_kv(t[:, :, cols], ring.repeats) for t in kv)
        at = (dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows])
        contiguous = tuple(t.contiguous() for t in at)
        dq_part, dk, dv = attend_grads(ring.kernel, contiguous, causal, ring.scale)  # type: ignore[arg-type]
        dq[:, :, rows] += dq_part
        dkv[0, :, :, cols] += _fold_kv(dk.to(ring.accumulate), ring.repeats)
        dkv[1, :, :, cols] += _fold_kv(dv.to(ring.accumulate), ring.repeats)
    return dq, dkv


class _RingAttention(torch.autograd.Function):
    """Ring attention; backward passes K/V round again, each block's dK/dV accumulator
    travelling with it (one step behind) and arriving home after the last step."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        ring = _Ring.of(q, k, group, scale)
        qc, kv = q.to(ring.dtype), torch.stack([k, v]).to(ring.dtype)
        out, lse = _blocks_forward(qc, _ring_blocks(kv, ring), ring)  # merged in fp32
        out = out.to(ring.dtype)  # what the kernels' backward takes
        ctx.save_for_backward(qc, kv, out, lse)
        ctx.ring, ctx.dtype = ring, q.dtype
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        dout = dout.to(q.dtype)
        saved = (q, dout, out, lse)
        dq, grads_arriving = torch.zeros_like(q, dtype=ring.accumulate), None
        for step in range(ring.cp):
            kv_arriving = post_shift(kv, ring.group, _KV_TAG) if step + 1 < ring.cp else None
            dq_step, dkv = _block_grads(saved, kv, step, ring)
            dq += dq_step
            if grads_arriving:  # the earlier ranks' share of the same block
                dkv += grads_arriving()
            if kv_arriving:
                kv = kv_arriving()
            grads_arriving = post_shift(dkv, ring.group, _GRAD_TAG)
        dkv = grads_arriving()  # type: ignore[misc]  # own block, every rank's share in
        return dq.to(ctx.dtype), dkv[0].to(ctx.dtype), dkv[1].to(ctx.dtype), None, None


# ---- all-gather ---------------------------------------------------------------------------


def allgather_attention(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, scale: float | None = None
) -> Tensor:
    """Causal attention of this rank's queries against K/V gathered from the whole group."""
    _check_shapes(q, k, v)
    return _AllGatherAttention.apply(q, k, v, group, _scale(q, scale))


class _AllGatherAttention(torch.autograd.Function):
    """The ring's chunk-pair attention over every rank's K/V block at once: gathered in one
    all-gather forward, their dK/dV reduce-scattered backward. Chunk pairs rather than one
    masked SDPA over the gathered sequence: a mask costs bytes per query-key pair, and CPU's
    SDPA materializes the masked scores."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        ring = _Ring.of(q, k, group, scale)
        qc = q.to(ring.dtype)
        blocks = _gather(torch.stack([k, v]).to(ring.dtype), group)  # [cp, 2, b, h_kv, s, d]
        out, lse = _blocks_forward(qc, _owned(blocks, ring), ring)  # merged in fp32
        out = out.to(ring.dtype)  # what the kernels' backward takes
        ctx.save_for_backward(qc, blocks, out, lse)
        ctx.ring, ctx.dtype = ring, q.dtype
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, blocks, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        saved = (q, dout.to(q.dtype), out, lse)
        dq = torch.zeros_like(q, dtype=ring.accumulate)
        dblocks = torch.empty_like(blocks, dtype=ring.accumulate)
        for step, kv in enumerate(_owned(blocks, ring)):
            dq_step, dkv = _block_grads(saved, kv, step, ring)
            dq += dq_step
            dblocks[(ring.rank - step) % ring.cp] = dkv
        dkv = dblocks.new_empty(blocks.shape[1:])
        REDUCE_SCATTER(dkv.view(-1), dblocks.view(-1), group=ring.group)
        return dq.to(ctx.dtype), dkv[0].to(ctx.dtype), dkv[1].to(ctx.dtype), None, None


def _owned(blocks: Tensor, ring: _Ring) -> Iterator[Tensor]:
    """The gathered blocks in the ring's order: rank (rank - step)'s at step `step`."""
    return (blocks[(ring.rank - step) % ring.cp] for step in range(ring.cp))


def _gather(x: Tensor, group: ProcessGroup) -> Tensor:
    """Every rank's `x` stacked along a new dim 0 (flat buffers: gloo wants dim 0 joined)."""
    out = x.new_empty((dist.get_world_size(group), *x.shape))
    ALL_GATHER(out.view(-1), x.contiguous().view(-1), group=group)
    return out


# ---- all-to-all (Ulysses) -----------------------------------------------------------------


def alltoall_attention(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, scale: float | None = None
) -> Tensor:
    """Causal attention with heads, not the sequence, split over the group for the SDPA."""
    _check_shapes(q, k, v)
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(
            f"alltoall splits heads over cp: heads ({q.shape[1]}) and K/V heads "
            f"({k.shape[1]}) must both be divisible by cp ({cp})"
        )
    # one exchange for q, k and v: each peer's share of all three packed in a row
    parts = [t.unflatten(1, (cp, -1)).transpose(0, 1) for t in (q, k, v)]  # [cp, b, h/cp, ..]
    packed = torch.cat([p.reshape(cp, -1) for p in parts], 1)
    received = exchange(packed, group).split([p[0].numel() for p in parts], 1)
    q_h, k_h, v_h = (
        unshard_sequence(list(r.view(p.shape).unbind(0)), dim=2)  # [b, h/cp, seq, d]
        for r, p in zip(received, parts, strict=True)
    )
    out = causal_sdpa(q_h, k_h, v_h, scale=scale)
    back = torch.stack([shard_sequence(out, r, cp, dim=2) for r in range(cp)])
    back = exchange(back, group)  # [cp (head group), b, h/cp, s, d]
    return back.transpose(0, 1).flatten(1, 2)


# ---- lookup and loss ----------------------------------------------------------------------

METHODS: dict[str, AttentionFn] = {
    "ring": ring_attention,
    "allgather": allgather_attention,
    "alltoall": alltoall_attention,
}


def context_attention(method: str) -> AttentionFn:
    """The attention function of `parallel.cp_method`."""
    try:
        return METHODS[method]
    except KeyError:
        raise ValueError(f"no CP method {method!r}; valid: {', '.join(METHODS)}") from None
