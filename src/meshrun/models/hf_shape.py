"""The planner's shape (core/model_shape.py) of a transformers config: widths, heads, the
MLP and, for a mixture of experts, its experts under each family's field names."""

from __future__ import annotations

from transformers import PretrainedConfig

from meshrun.core.config import HFModelConfig
from meshrun.core.model_shape import ModelShape
from meshrun.models.hf import hf_config

# The config fields that count a block's routed experts, by family.
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def hf_shape(cfg: HFModelConfig) -> ModelShape:
    """From the config: the Llama family (Llama, Qwen2, Mistral) has a gated MLP of
    `intermediate_size`; GPT-2 a plain one of `n_inner` or 4h (its position table and biases
    are left out of the planner's count). A mixture of experts: Mixtral's num_local_experts
    of intermediate_size, Qwen-MoE's num_experts of moe_intermediate_size and its shared
    expert (whose one-unit gate is left out too), DeepSeek's n_routed_experts and
    n_shared_experts of moe_intermediate_size (Ernie's moe_num_experts, moe_k a token),
    num_experts_per_tok a token."""
    c = hf_config(cfg)
    gated = getattr(c, "intermediate_size", None)
    experts = _first(c, EXPERT_COUNTS)
    expert_ffn = getattr(c, "moe_intermediate_size", None) or gated or 0
    shared = _first(c, ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"))
    shared_ffn = getattr(c, "shared_expert_intermediate_size", None) or shared * expert_ffn
    top_k = _first(c, ("num_experts_per_tok", "moe_k", "moe_topk"))
    return ModelShape(
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        vocab_size=c.vocab_size,
        ffn_dim=gated or getattr(c, "n_inner", None) or 4 * c.hidden_size,
        tied=bool(c.tie_word_embeddings),
        mlp_matrices=3 if gated else 2,
        experts=experts,
        top_k=top_k if experts else 0,
        expert_ffn=expert_ffn if experts else 0,
        shared_ffn=shared_ffn if experts else 0,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        fused_gate_up=bool(experts),
    )


def _first(config: PretrainedConfig, keys: tuple[str, ...]) -> int:
    """The first of the fields `config` sets (not None, not 0), else 0."""
    return next((value for key in keys if (value := getattr(config, key, None))), 0)
