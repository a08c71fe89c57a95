"""The sizes of a model that the layout rules (what TP divides, how many layers PP cuts) and
the analytic planner (parameters, activations, FLOPs) compute with, whatever its kind."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """`ffn_dim`: the MLP's hidden width; `mlp_matrices`: 3 for a gated MLP (SwiGLU: gate,
    up, down), 2 for a plain one (GPT-2: up, down)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    tied: bool
    mlp_matrices: int = 3
