"""Meshrun's LLaMA (llama.py) <-> Hugging Face's LlamaForCausalLM checkpoints.

The two compute the same function under other names but for one layout: meshrun's RoPE
rotates each head's (even, odd) pairs, transformers' (`rotate_half`) its (i, i + head_dim/2)
halves, which is why Meta's checkpoints were permuted for it. Rotating q and k alike leaves
q.k as it is, so each head's rows of q and k are permuted on the way in and back on the way
out; every other tensor is copied as it is. The model is read through its own attributes:
llama.py imports this module to load, so this one does not import llama.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from meshrun.core.model_shape import head_dim
from meshrun.models.checkpoint_files import SAFETENSORS, SavedTensors
from meshrun.models.shards import Reordered, fill, named_tensors
from meshrun.models.vocab import unpadded_shape

ARCHITECTURE = "LlamaForCausalLM"
# LlamaModelConfig field -> the LlamaConfig field it is (rope_theta: in rope_parameters).
CONFIG_FIELDS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
}
REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
)
# LlamaConfig's defaults for the fields a config.json may leave out.
HF_DEFAULTS = {
    "num_key_value_heads": None,
    "head_dim": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
}
TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
ROTATED = ("attention.wq.weight", "attention.wk.weight")


def hf_name(name: str) -> str:
    """A meshrun parameter's name in transformers' checkpoint."""
    module, leaf = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, index, inner = module.split(".", 2)
        return f"model.layers.{index}.{LAYER_NAMES[inner]}.{leaf}"
    return f"{TOP_NAMES[module]}.{leaf}"


def interleave(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q or k rows from transformers' halves to meshrun's pairs: (i, i + head_dim/2) of each
    head become (2i, 2i + 1)."""
    return w.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def halve(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `interleave` (Meta's `permute` for transformers)."""
    return w.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


def hf_rope(config: dict[str, Any]) -> tuple[str, float]:
    """(rope type, theta) of a config with HF_DEFAULTS: transformers 5 keeps them in
    `rope_parameters`, config.json files of earlier versions in `rope_theta` and
    `rope_scaling`."""
    rope = {
        "rope_theta": config["rope_theta"],
        **(config.get("rope_scaling") or {}),
        **(config.get("rope_parameters") or {}),
    }
    return rope.get("rope_type", rope.get("type", "default")), float(rope["rope_theta"])


def llama_config_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """LlamaModelConfig's fields for a LlamaForCausalLM config.json; ValueError for what
    meshrun's LLaMA cannot hold (biases, a scaled rotary, another activation)."""
    c = {**HF_DEFAULTS, **config}
    missing = [key for key in REQUIRED if key not in c]
    if missing:
        raise ValueError(f"its config.json has no {', '.join(missing)}")
    if c["attention_bias"] or c["mlp_bias"]:
        raise ValueError("its attention_bias/mlp_bias are set; meshrun's LLaMA has no biases")
    rope_type, theta = hf_rope(c)
    if rope_type != "default":
        raise ValueError(
            f"its rotary embedding is rope_type={rope_type!r}; meshrun's LLaMA has "
            "only the default (unscaled) one"
        )
    dim, heads = c["hidden_size"], c["num_attention_heads"]
    if c["head_dim"] is None and dim % heads:
        raise ValueError(f"its num_attention_heads={heads} does not divide hidden_size={dim}")
    if c["hidden_act"] != "silu":
        raise ValueError(f"its hidden_act={c['hidden_act']!r}; meshrun's LLaMA has SwiGLU (silu)")
    values = {
        **c,
        "num_key_value_heads": c["num_key_value_heads"] or heads,
        "head_dim": c["head_dim"] or dim // heads,
        "rope_theta": theta,
    }
    fields = {ours: values[theirs] for ours, theirs in CONFIG_FIELDS.items()}
    return {**fields, "tie_embeddings": bool(fields["tie_embeddings"])}


@torch.no_grad()
def load_hf(model: nn.Module, directory: str | Path) -> int:
    """This rank's share of each of `model`'s parameters (a pipeline stage has only its
    own) from a Hugging Face Llama save_pretrained directory, q and k permuted to pairs, into
    an embedding and head that may be padded (vocab.py); the bytes read."""
    saved = SavedTensors(directory)
    width = head_dim(model.cfg)
    for name, param in named_tensors(model):
        source = saved[hf_name(name)]
        if name.endswith(ROTATED):
            source = Reordered(source, interleave(torch.arange(source.shape[0]), width))
        fill(param, source)
    return saved.bytes_read


def hf_config(model: nn.Module) -> dict[str, Any]:
    """The config.json of `model` as a LlamaForCausalLM (sizes read off its first block)."""
    cfg = model.cfg
    block = next(iter(model.layers.values()))
    fields = {
        "dim": cfg.dim,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_kv_heads": block.attention.n_kv_heads,
        "vocab_size": cfg.vocab_size,
        "ffn_dim": block.feed_forward.w1.out_features,
        "norm_eps": cfg.norm_eps,
        "tie_embeddings": cfg.tie_embeddings,
    }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **{CONFIG_FIELDS[key]: value for key, value in fields.items()},
        "head_dim": head_dim(cfg),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": model.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


@torch.no_grad()
def export_hf(model: nn.Module, directory: str | Path) -> None:
    """A whole meshrun LLaMA (one process, no DTensors) as a directory that
    `LlamaForCausalLM.from_pretrained` loads: config.json and model.safetensors, the
    vocabulary unpadded, q and k permuted back; a tied head is saved as the embedding alone,
    which transformers ties on load."""
    width = head_dim(model.cfg)
    tensors = {}
    for name, param in model.named_parameters():
        tensor = param[: unpadded_shape(name, param, model.vocab_size)[0]]
        if name.endswith(ROTATED):
            tensor = halve(tensor, width)
        tensors[hf_name(name)] = tensor.contiguous().cpu()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, root / SAFETENSORS, metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(hf_config(model), indent=2) + "\n")
