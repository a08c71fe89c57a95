"""The sizes of a model that the layout rules (what TP divides, how many layers PP cuts) and
the analytic planner (parameters, activations, FLOPs) compute with, whatever its kind."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def formula(self) -> bool:
        """Whether the analytic planner's formulas apply (every width known)."""
        return None not in (self.dim, self.n_heads, self.n_kv_heads, self.ffn_dim)
