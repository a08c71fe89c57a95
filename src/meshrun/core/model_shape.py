"""The sizes of a model that the layout rules (what TP divides, how many layers PP cuts) and
the analytic planner (parameters, activations, FLOPs) compute with, whatever its kind; those of
meshrun's LLaMA from its config alone, and the vocabulary as TP pads it (models/vocab.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.core.config import LlamaModelConfig


@dataclass(frozen=True)
class ModelShape:
    """`ffn_dim`: the MLP's hidden width; `mlp_matrices`: 3 for a gated MLP (SwiGLU: gate,
    up, down), 2 for a plain one (GPT-2: up, down). A user's own module (model=custom) has no
    formula: the widths it does not tell are None, and `formula` is False."""

    dim: int | None
    n_layers: int
    n_heads: int | None
    n_kv_heads: int | None
    vocab_size: int
    ffn_dim: int | None
    tied: bool
    mlp_matrices: int = 3
    # a mixture of experts (meshrun's, models/moe.py): routed experts a block (0: a dense MLP),
    # each token's, an expert's hidden width and the shared experts' together
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    head_dim: int | None = None  # None: dim / n_heads
    # the experts' gate and up matrices are one tensor (transformers'): etp trades their
    # products between the TP ranks (models/hf_experts.py)
    fused_gate_up: bool = False

    @property
    def q_dim(self) -> int | None:
        """The width of the queries and of attention's output: n_heads x head_dim, which is
        dim unless the heads are wider (Qwen3)."""
        if self.head_dim is None or self.n_heads is None:
            return self.dim
        return self.n_heads * self.head_dim

    @property
    def formula(self) -> bool:
        """Whether the analytic planner's formulas apply (every width known)."""
        return None not in (self.dim, self.n_heads, self.n_kv_heads, self.ffn_dim)


def ffn_dim(cfg: LlamaModelConfig) -> int:
    if cfg.ffn_dim is not None:
        return cfg.ffn_dim
    hidden = int(2 * (4 * cfg.dim) / 3)
    return cfg.multiple_of * math.ceil(hidden / cfg.multiple_of)


def expert_ffn_dim(cfg: LlamaModelConfig) -> int:
    return cfg.moe.expert_ffn_dim or ffn_dim(cfg)


def kv_heads(cfg: LlamaModelConfig) -> int:
    return cfg.n_kv_heads or cfg.n_heads


def head_dim(cfg: LlamaModelConfig) -> int:
    return cfg.head_dim or cfg.dim // cfg.n_heads


def llama_shape(cfg: LlamaModelConfig) -> ModelShape:
    moe = cfg.moe
    experts = {}
    if moe.experts:
        width = expert_ffn_dim(cfg)
        experts = {
            "experts": moe.experts,
            "top_k": moe.top_k,
            "expert_ffn": width,
            "shared_ffn": moe.shared_experts * width,
        }
    return ModelShape(
        cfg.dim,
        cfg.n_layers,
        cfg.n_heads,
        kv_heads(cfg),
        cfg.vocab_size,
        ffn_dim(cfg),
        cfg.tie_embeddings,
        **experts,
        head_dim=head_dim(cfg),
    )


def padded_vocab(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple
