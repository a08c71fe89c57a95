"""A model config to what the layouts and the planner ask of it, through its kind
(models/registry.py): the module, its sizes, its parameter counts, float8's coverage, an MoE
model's routers."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from meshrun.core.config import ModelConfig
from meshrun.core.model_shape import ModelShape
from meshrun.models.float8 import float8_linears
from meshrun.models.keys import from_key, model_key
from meshrun.models.moe import Routers
from meshrun.models.registry import model_kind


def build_model(
    cfg: ModelConfig, max_seq_len: int, device: torch.device | str, vocab_multiple: int = 1
) -> nn.Module:
    """Build on `device`; on "meta" nothing is allocated (shape and size questions only).
    `vocab_multiple`: the TP degree, which the vocabulary is padded to (vocab.py)."""
    return model_kind(cfg).build(cfg, max_seq_len, device, vocab_multiple)


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The sizes the layout rules and the analytic planner compute with (core/model_shape.py)."""
    return model_kind(cfg).shape(cfg)


def routers_of(cfg: ModelConfig) -> Routers | None:
    """What a training loop needs of the model's MoE routers; None without meshrun's own."""
    moe = model_kind(cfg).moe(cfg)
    return Routers.of(model_shape(cfg).n_layers, moe) if moe is not None else None


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
