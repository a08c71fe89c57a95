"""The rules of meshrun's own decoder (kind=meshrun): its sizes, and that a `pretrained`
Llama checkpoint is one it can hold, of the preset's sizes."""

from __future__ import annotations

import importlib.util

from meshrun.core.config import LlamaModelConfig
from meshrun.core.errors import fail, positive
from meshrun.core.model_shape import ffn_dim, head_dim, kv_heads
from meshrun.models.hf_rules import saved_config


def check_llama(m: LlamaModelConfig) -> None:
    for key in ("dim", "n_layers", "n_heads", "vocab_size"):
        positive(f"model.{key}", getattr(m, key))
    if m.head_dim is not None:
        positive("model.head_dim", m.head_dim)
    elif m.dim % m.n_heads:
        fail(
            "model.n_heads",
            m.n_heads,
            f"does not divide model.dim ({m.dim})",
            f"a divisor of {m.dim}, or model.head_dim set",
        )
    if head_dim(m) % 2:
        key = "model.head_dim" if m.head_dim is not None else "model.n_heads"
        fail(
            key,
            getattr(m, key.removeprefix("model.")),
            f"head dim {head_dim(m)} is odd; RoPE rotates pairs",
            "an even head dim (dim / n_heads, or model.head_dim)",
        )
    kv = m.n_kv_heads or m.n_heads
    if kv <= 0 or m.n_heads % kv:
        fail(
            "model.n_kv_heads",
            m.n_kv_heads,
            f"must divide model.n_heads ({m.n_heads})",
            f"a divisor of {m.n_heads}, or null for n_heads",
        )
    if m.pretrained is not None:
        _check_llama_pretrained(m)


def _check_llama_pretrained(m: LlamaModelConfig) -> None:
    if importlib.util.find_spec("safetensors") is None:
        fail(
            "model.pretrained",
            m.pretrained,
            "reading a checkpoint needs safetensors, which is not installed",
            "pip install 'meshrun[hf]'",
        )
    from meshrun.models import convert  # noqa: PLC0415 (optional dependency: meshrun[hf])

    saved = saved_config(m.pretrained, convert.ARCHITECTURE)
    try:
        fields = convert.llama_config_from_hf(saved)
    except ValueError as err:
        fail(
            "model.pretrained",
            m.pretrained,
            str(err),
            "a Llama checkpoint meshrun's LLaMA "
            "can hold, or model=hf/... (transformers' own Llama) to load it",
        )
    preset = {**vars(m), "n_kv_heads": kv_heads(m), "ffn_dim": ffn_dim(m), "head_dim": head_dim(m)}
    for key, value in fields.items():
        if preset[key] != value:
            fail(
                "model.pretrained",
                m.pretrained,
                f"its config.json has "
                f"{convert.CONFIG_FIELDS[key]}={value!r}, the preset model.{key}={preset[key]!r}",
                f"model.{key}={value!r}, or a checkpoint of this preset",
            )
