"""Context parallelism's causal load balance: causal attention's work grows along the
sequence (the last token sees every key, the first only itself), so cutting it into cp
contiguous pieces would leave the last rank with most of the work. The sequence is cut into
2 x cp chunks instead and CP rank r holds chunks r and 2cp-1-r: an early and a late chunk,
the same work on every rank. Every token keeps its global position (RoPE, masks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def load_balanced_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) CP rank `rank` holds: r and 2cp-1-r, ascending."""
    return rank, 2 * cp - 1 - rank


def chunk_length(seq: int, cp: int) -> int:
    """Tokens per chunk; a sequence that 2 x cp does not divide cannot be balanced."""
    if cp < 1 or seq % (2 * cp):
        raise ValueError(
            f"sequence length {seq} is not divisible by 2 x cp = {2 * cp}: context "
            f"parallelism cuts the sequence into 2 x cp chunks (causal load balance)"
        )
    return seq // (2 * cp)


def shard_sequence(x: Tensor, rank: int, cp: int, dim: int = 1) -> Tensor:
    """This CP rank's tokens of `x` (the sequence along `dim`): its two chunks, in order."""
    c = chunk_length(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in load_balanced_chunks(rank, cp)], dim)


def sequence_positions(
    seq: int, rank: int, cp: int, device: torch.device | str | None = None
) -> Tensor:
    """Global position of each of this CP rank's tokens (RoPE and masks need the true ones)."""
    c = chunk_length(seq, cp)
    return torch.cat([chunk_positions(i, c, device) for i in load_balanced_chunks(rank, cp)])


def unshard_sequence(shards: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The whole sequence from every CP rank's shard (listed in CP rank order)."""
    cp = len(shards)
    halves = [shard.chunk(2, dim) for shard in shards]
    # chunk i < cp is rank i's first half; chunk 2cp-1-r is rank r's second half
    ordered = [halves[i][0] for i in range(cp)] + [halves[r][1] for r in reversed(range(cp))]
    return torch.cat(ordered, dim)


def chunk_positions(chunk: int, c: int, device: torch.device | str | None) -> Tensor:
    return torch.arange(chunk * c, (chunk + 1) * c, device=device)
