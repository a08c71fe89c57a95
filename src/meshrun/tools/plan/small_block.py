"""The tiny block of a model's kind that calibrate measures what does not depend on sizes
on: the aten ops a block's forward and backward dispatch (the eager dispatch a step pays per
op, however small), and the wrappers' host cost (wrapper_overhead.py)."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshrun.core.config import LlamaModelConfig, ModelConfig
from meshrun.models import build_model, model_kind

COUNTED_SEQ = 16  # the op count does not depend on sizes: counted on a small block


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_layer(model: ModelConfig) -> int:
    """The aten ops a block's forward and backward dispatch: meshrun's decoder of the model's
    kind counted at a small size with one block and with two (a transformers or custom model
    counts as meshrun's LLaMA block)."""
    small = small_block(model_kind(model).decoder(model))
    return _count(dataclasses.replace(small, n_layers=2)) - _count(small)


def small_block(model: LlamaModelConfig | None) -> LlamaModelConfig:
    """One block of the model's kind at a tiny width (64 wide, GQA kept as GQA), on which
    sizes do not matter: the ops it dispatches, what its wrappers cost the host."""
    gqa = model is not None and model.n_kv_heads is not None and model.n_kv_heads < model.n_heads
    base = model or LlamaModelConfig(name="count", dim=64, n_layers=1, n_heads=4, vocab_size=128)
    return dataclasses.replace(
        base,
        dim=64,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2 if gqa else None,
        head_dim=None,
        ffn_dim=128,
        vocab_size=128,
        pretrained=None,
    )


def _count(model_cfg: LlamaModelConfig) -> int:
    model = build_model(model_cfg, COUNTED_SEQ, "cpu")
    model.init_weights(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (1, COUNTED_SEQ))
    with _OpCounter() as counter:
        model(tokens).float().sum().backward()
    return counter.count
