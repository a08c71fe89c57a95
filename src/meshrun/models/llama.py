"""LLaMA-style decoder: RMSNorm, RoPE, SwiGLU, causal SDPA attention with optional GQA.

Layers live in a ModuleDict keyed by their global index so a pipeline stage can drop the
ones it does not own and keep names (and thus checkpoints and init) stable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.core.config import LlamaModelConfig
from meshrun.core.model_shape import expert_ffn_dim, ffn_dim, head_dim, kv_heads
from meshrun.models.attention import causal_sdpa
from meshrun.models.init import seeded_normal
from meshrun.models.moe import MoEFeedForward
from meshrun.models.shards import fill, named_tensors
from meshrun.models.vocab import pad_vocab, unpad_logits, unpadded_shape


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) pairs of x: [batch, seq, heads, head_dim]."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = kv_heads(cfg)
        self.head_dim = head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = causal_sdpa(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def feed_forward(cfg: LlamaModelConfig, layer: int) -> nn.Module:
    """SwiGLU, or a mixture of SwiGLU experts (`model.moe.experts` > 0)."""
    moe = cfg.moe
    if not moe.experts:
        return FeedForward(cfg.dim, ffn_dim(cfg))
    hidden = expert_ffn_dim(cfg)
    shared = FeedForward(cfg.dim, moe.shared_experts * hidden) if moe.shared_experts else None
    return MoEFeedForward(moe, cfg.dim, hidden, shared, layer)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = feed_forward(cfg, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.pos_embeddings = None  # positions are rotary
        self.positions: torch.Tensor | None = None  # a CP rank's tokens' (use_positions)
        self.vocab_size = cfg.vocab_size
        self.tied = cfg.tie_embeddings

    def tie_weights(self) -> None:
        if self.tied and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Transformer:
        """Materialise (from meta); `nn.Module.to_empty` gives each module its own new
        tensor, which would silently untie a tied head from the embedding."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits; a pipeline stage without the embedding takes hidden states,
        one without the head returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.output is None:
            return h
        return unpad_logits(self.output(self.norm(h)), self.vocab_size)

    def prepare_tp(self, tp: int) -> None:
        """Nothing to regroup: q, k and v are separate projections."""

    def tp_plan(self) -> dict[str, str]:
        """Attention: q/k/v column-wise (each rank owns n_heads/tp heads), output row-wise;
        MLP: gate and up column-wise, down row-wise (parallel/tensor.py's styles)."""
        return {
            "tok_embeddings": "embedding",
            "norm": "sequence_parallel",
            "output": "head",
            "layers.*.attention_norm": "sequence_parallel",
            "layers.*.attention": "gather_input",
            "layers.*.attention.wq": "colwise",
            "layers.*.attention.wk": "colwise",
            "layers.*.attention.wv": "colwise",
            "layers.*.attention.wo": "rowwise",
            "layers.*.ffn_norm": "sequence_parallel",
            "layers.*.feed_forward": "gather_input",
            "layers.*.feed_forward.w1": "colwise",
            "layers.*.feed_forward.w3": "colwise",
            "layers.*.feed_forward.w2": "rowwise",
        }

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Same seed, same weights, whatever the device or layout that follows (init.py)."""
        self._reset_rope()
        depth_scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in named_tensors(self):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            out_projection = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
            std = 0.02 * (depth_scale if out_projection else 1.0)
            fill(
                param, seeded_normal(seed, name, unpadded_shape(name, param, self.vocab_size), std)
            )
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.expert_bias.zero_()  # nothing learnt of the loads yet

    @torch.no_grad()
    def load_pretrained(self, directory: str) -> int:
        """This rank's share of this part's weights from a Hugging Face Llama
        save_pretrained directory (convert.py); the bytes it read."""
        from meshrun.models import convert  # noqa: PLC0415 (optional: meshrun[hf])

        read = convert.load_hf(self, directory)
        self._reset_rope()
        return read

    def use_positions(self, positions: torch.Tensor) -> None:
        """The global positions of the tokens this rank sees (a context-parallel rank's
        shard of each sequence); the rotary tables are taken at them when filled."""
        self.positions = positions

    def _reset_rope(self) -> None:
        """The rotary tables, which a model built on meta does not have."""
        device = self.rope_cos.device
        cos, sin = rope_tables(head_dim(self.cfg), self.max_seq_len, self.cfg.rope_theta)
        if self.positions is not None:
            cos, sin = cos[self.positions], sin[self.positions]
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)


def build_llama(
    cfg: LlamaModelConfig, max_seq_len: int, device: torch.device | str, vocab_multiple: int = 1
) -> Transformer:
    """Build on `device`; on "meta" nothing is allocated (shape and size questions only).
    `vocab_multiple`: the TP degree the vocabulary is padded for (vocab.py)."""
    with torch.device(device):
        model = Transformer(cfg, max_seq_len)
    pad_vocab(model, cfg.vocab_size, vocab_multiple)
    return model
