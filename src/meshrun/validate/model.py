"""The model's rules: meshrun's own decoder's sizes, and that a `pretrained` Llama
checkpoint is one it can hold, of the preset's sizes; for a Hugging Face model, that
transformers is installed, the architecture exists and can be cut into stages, every config
key is one its config class has, a `pretrained` directory matches the preset, and the
sequence fits its attention and positions; for a user's module, validate/custom.py."""

from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path

from meshrun.core.config import (
    CustomModelConfig,
    ExperimentConfig,
    HFModelConfig,
    LlamaModelConfig,
    ModelConfig,
)
from meshrun.core.errors import fail, positive
from meshrun.core.model_shape import ffn_dim, kv_heads
from meshrun.validate.custom import check_custom


def check_model(m: ModelConfig) -> None:
    positive("model.context_len", m.context_len, allow_none=True)
    if isinstance(m, HFModelConfig):
        _check_hf(m)
    elif isinstance(m, CustomModelConfig):
        check_custom(m)
    else:
        _check_llama(m)


def check_sequence(cfg: ExperimentConfig) -> None:
    """What a transformers model's attention and positions hold of train.seq_len: meshrun
    runs full causal attention (no sliding-window mask), and a learned position table has
    rows for so many positions only."""
    m, seq = cfg.model, cfg.train.seq_len
    if not isinstance(m, HFModelConfig):
        return
    from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

    c = hf.hf_config(m)
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    if window and seq > window:
        fail(
            "train.seq_len",
            seq,
            f"is longer than the model's sliding window "
            f"(model.config.sliding_window={window}), which meshrun's full causal attention "
            "does not apply",
            f"<= {window}, or model.config.sliding_window=null",
        )
    shipped = hf.SHIPPED_PLANS.get(m.architecture)
    if shipped and shipped.positions and seq > c.max_position_embeddings:
        fail(
            "train.seq_len",
            seq,
            f"is longer than the learned position table ({c.max_position_embeddings} positions)",
            f"<= {c.max_position_embeddings}, or a larger table in model.config",
        )


def _check_llama(m: LlamaModelConfig) -> None:
    for key in ("dim", "n_layers", "n_heads", "vocab_size"):
        positive(f"model.{key}", getattr(m, key))
    if m.dim % m.n_heads:
        fail(
            "model.n_heads",
            m.n_heads,
            f"does not divide model.dim ({m.dim})",
            f"a divisor of {m.dim}",
        )
    if (m.dim // m.n_heads) % 2:
        fail(
            "model.n_heads",
            m.n_heads,
            f"head dim {m.dim // m.n_heads} is odd; RoPE rotates pairs",
            "n_heads giving an even dim / n_heads",
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

    saved = _saved_config(m.pretrained, convert.ARCHITECTURE)
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
    preset = {**vars(m), "n_kv_heads": kv_heads(m), "ffn_dim": ffn_dim(m)}
    for key, value in fields.items():
        if preset[key] != value:
            fail(
                "model.pretrained",
                m.pretrained,
                f"its config.json has "
                f"{convert.CONFIG_FIELDS[key]}={value!r}, the preset model.{key}={preset[key]!r}",
                f"model.{key}={value!r}, or a checkpoint of this preset",
            )


def _check_hf(m: HFModelConfig) -> None:
    if importlib.util.find_spec("transformers") is None:
        fail(
            "model.architecture",
            m.architecture,
            f"model={m.name} needs Hugging Face transformers, which is not installed",
            "pip install 'meshrun[hf]'",
        )
    from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

    try:
        cls = hf.model_class(m.architecture)
    except ValueError:
        known = [n for n in dir(hf.transformers) if n.endswith("ForCausalLM")]
        nearest = difflib.get_close_matches(m.architecture, known, n=3)
        fail(
            "model.architecture",
            m.architecture,
            "is not a transformers model class",
            f"{' | '.join(nearest) or 'a *ForCausalLM class'} (nearest)",
        )
    defaults = cls.config_class().to_dict()
    for key in m.config:
        if key not in defaults:
            nearest = difflib.get_close_matches(key, list(defaults), n=1)
            fail(
                f"model.config.{key}",
                m.config[key],
                f"not a field of {cls.config_class.__name__}",
                f"model.config.{nearest[0]} (nearest)"
                if nearest
                else "a field of the config class",
            )
    try:
        hf.stage_names(m.architecture, hf.hf_config(m))
    except ValueError as err:
        fail(
            "model.architecture",
            m.architecture,
            str(err),
            "a Llama-family architecture "
            f"(Llama, Qwen2, Mistral) or one of {sorted(hf.SHIPPED_PLANS)}",
        )
    if m.pretrained is not None:
        _check_pretrained(m, defaults)


def _saved_config(pretrained: str, architecture: str) -> dict:
    """The config.json of a save_pretrained directory with safetensors of `architecture`."""
    root = Path(pretrained)
    if not (root / "config.json").is_file():
        fail(
            "model.pretrained",
            pretrained,
            "no config.json there",
            "a directory written by save_pretrained",
        )
    if not any(root.glob("*.safetensors")):
        fail(
            "model.pretrained",
            pretrained,
            "no .safetensors weights there",
            "save_pretrained(..., safe_serialization=True) output",
        )
    saved = json.loads((root / "config.json").read_text())
    if architecture not in saved.get("architectures", [architecture]):
        fail(
            "model.pretrained",
            pretrained,
            f"holds {saved['architectures']}, the preset is {architecture}",
            f"a {architecture} checkpoint",
        )
    return saved


def _check_pretrained(m: HFModelConfig, defaults: dict) -> None:
    saved = _saved_config(m.pretrained, m.architecture)
    for key, value in m.config.items():
        if saved.get(key, defaults.get(key)) != value:
            fail(
                "model.pretrained",
                m.pretrained,
                f"its config.json has {key}={saved.get(key)!r}, the preset {value!r}",
                f"model.config.{key}={saved.get(key)!r}, or a checkpoint of this preset",
            )
