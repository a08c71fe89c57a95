"""A researcher's own model for model=custom (`model.target=tests.user_model:build`): a small
GPT written with plain torch, nothing meshrun-specific, and TP plans for it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import RowwiseParallel

TP_PLAN = {
    "blocks.*.q": "colwise",
    "blocks.*.k": "colwise",
    "blocks.*.v": "colwise",
    "blocks.*.out": "rowwise",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
}


class Embed(nn.Module):
    """Token embedding plus a fixed sinusoidal position table (a buffer)."""

    def __init__(self, vocab: int, dim: int, max_seq: int, learned_positions: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        # a second nn.Embedding: which of the two is the vocabulary's, meshrun cannot tell
        self.learned = nn.Embedding(max_seq, dim) if learned_positions else None
        position = torch.arange(max_seq).unsqueeze(1)
        freq = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        table = torch.zeros(max_seq, dim)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq)
        self.register_buffer("positions", table, persistent=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        table = self.positions if self.learned is None else self.learned.weight
        return self.tokens(ids) + (table[: ids.shape[1]] if positions is None else table[positions])


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, by_hand: bool = False) -> None:
        super().__init__()
        self.head_dim, self.by_hand = dim // heads, by_hand
        self.attn_norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.attn_norm(x)
        # -1 heads: a tensor-parallel rank holds a share of them
        q, k, v = (
            p(h).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        a = (
            attend_by_hand(q, k, v)
            if self.by_hand
            else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        )
        x = x + self.out(a.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


def attend_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out, as many models had it before SDPA."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


class TinyGPT(nn.Module):
    """`forward(ids, positions)`: positions [1, seq], each token's, where given (meshrun
    passes them with model.positions=positions); 0..seq-1 otherwise."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        n_layers: int,
        heads: int,
        max_seq: int,
        learned_positions: bool,
        attention_by_hand: bool = False,
    ) -> None:
        super().__init__()
        self.embed = Embed(vocab, dim, max_seq, learned_positions)
        self.blocks = nn.ModuleList(
            Block(dim, heads, 4 * dim, attention_by_hand) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids, positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(
    vocab: int = 256,
    dim: int = 64,
    n_layers: int = 4,
    heads: int = 4,
    max_seq: int = 128,
    learned_positions: bool = False,
    attention_by_hand: bool = False,
) -> TinyGPT:
    return TinyGPT(vocab, dim, n_layers, heads, max_seq, learned_positions, attention_by_hand)


class EmbedByAnotherName(Embed):
    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(ids, pos)


def build_positions_by_another_name() -> TinyGPT:
    """TinyGPT whose embedding takes the positions as `pos`, which model.positions=positions
    does not name: a pipeline's embedding would count 0..n-1 itself, where a CP rank's are
    not those."""
    model = build()
    model.embed.__class__ = EmbedByAnotherName
    return model


def build_tied() -> TinyGPT:
    """The head's weight the token embedding's: a module's own tie."""
    model = build()
    model.head.weight = model.embed.tokens.weight
    return model


def tp_plan(module: nn.Module) -> dict:
    return TP_PLAN


def sabotaged_tp_plan(module: nn.Module) -> dict:
    """One mistake: the attention output is row-wise but left Partial, so the per-rank partial
    sums are never all-reduced; shapes fit, so it trains, wrongly."""
    return {**TP_PLAN, "blocks.*.out": RowwiseParallel(output_layouts=Partial())}


def not_a_module() -> str:
    return "a string"


class Residual(nn.Module):
    """A block that returns only its update: the module's forward adds it to the stream."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.norm(x))


class StreamOutside(nn.Module):
    """The residual adds in the module's forward, between its blocks (`h = h + block(h)`):
    a pipeline, which runs the named parts in sequence, would train without them."""

    def __init__(self, vocab: int = 256, dim: int = 32, n_layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Residual(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)
