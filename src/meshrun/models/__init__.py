"""The models a layout can train: meshrun's own LLaMA-style decoder (llama.py, sizes in
conf/model), Hugging Face transformers causal LMs (hf.py, conf/model/hf; the optional extra
meshrun[hf]) and a user's own nn.Module (custom.py, model=custom). All present the same parts
to the layouts: `tok_embeddings`, `pos_embeddings` (None unless learned), `layers` by name,
`norm`, `output`, with `tp_plan()`, `prepare_tp(tp)`, `tie_weights()`, `init_weights(seed)`
and `to_empty`."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import asdict

import torch
from omegaconf import OmegaConf
from torch import nn

from meshrun.core.config import CustomModelConfig, HFModelConfig, ModelConfig
from meshrun.core.model_shape import ModelShape, llama_shape
from meshrun.models.custom import build_custom, custom_shape
from meshrun.models.float8 import float8_linears
from meshrun.models.llama import build_llama


def build_model(
    cfg: ModelConfig, max_seq_len: int, device: torch.device | str, vocab_multiple: int = 1
) -> nn.Module:
    """Build on `device`; on "meta" nothing is allocated (shape and size questions only).
    `vocab_multiple`: the TP degree, which the vocabulary is padded to (vocab.py)."""
    if isinstance(cfg, HFModelConfig):
        from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

        return hf.build_hf(cfg, device, vocab_multiple)
    if isinstance(cfg, CustomModelConfig):
        return build_custom(cfg, device, vocab_multiple)
    return build_llama(cfg, max_seq_len, device, vocab_multiple)


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The sizes the layout rules and the analytic planner compute with (core/model_shape.py)."""
    if isinstance(cfg, (HFModelConfig, CustomModelConfig)):
        return _built_shape(*model_key(cfg))
    return llama_shape(cfg)


def model_key(cfg: ModelConfig) -> tuple[type[ModelConfig], str]:
    """A hashable identity of a model config, for caches: `from_key` rebuilds it."""
    return type(cfg), json.dumps(asdict(cfg), sort_keys=True, default=str)


def from_key(schema: type[ModelConfig], text: str) -> ModelConfig:
    """The config `model_key` gave (nested values typed again: model.moe)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), json.loads(text)))


@functools.cache
def _built_shape(schema: type[ModelConfig], cfg_json: str) -> ModelShape:
    """A transformers config or a user's module is built to be measured: once per config."""
    cfg = from_key(schema, cfg_json)
    if schema is CustomModelConfig:
        return custom_shape(cfg)
    from meshrun.models.hf_shape import hf_shape  # noqa: PLC0415 (optional: meshrun[hf])

    return hf_shape(cfg)


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, in matmuls): the second is N in 6N FLOPs per token; an embedding lookup is no
    matmul, but a tied embedding is also the output head, which is."""
    total = sum(p.numel() for p in model.parameters())
    head = getattr(model, "output", None)
    lookups = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and (head is None or m.weight is not head.weight)
    }
    return total, total - sum(lookups.values())


def param_counts(cfg: ModelConfig, max_seq_len: int) -> tuple[int, int]:
    """`count_params` of the model `cfg` builds (on meta: nothing allocated)."""
    return count_params(build_model(cfg, max_seq_len, "meta"))


def float8_coverage(cfg: ModelConfig, max_seq_len: int, skip: Sequence[str]) -> tuple[int, int]:
    """(how many linears train.float8 converts in the model `cfg` builds, their weight
    elements): 6 x the second is their training FLOPs a token, every token passing each."""
    return _float8_coverage(*model_key(cfg), max_seq_len, tuple(skip))


@functools.cache
def _float8_coverage(
    schema: type[ModelConfig], cfg_json: str, max_seq_len: int, skip: tuple[str, ...]
) -> tuple[int, int]:
    """Built on meta once per config: the planner asks for every candidate."""
    model = build_model(from_key(schema, cfg_json), max_seq_len, "meta")
    linears = float8_linears(model, skip).values()
    return len(linears), sum(m.in_features * m.out_features for m in linears)
