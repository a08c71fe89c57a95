"""A model config as a hashable key, for caches of what is built from it (shapes, coverage),
and the config again from its key."""

from __future__ import annotations

import json
from dataclasses import asdict

from omegaconf import OmegaConf

from meshrun.core.config import ModelConfig


def model_key(cfg: ModelConfig) -> tuple[type[ModelConfig], str]:
    """A hashable identity of a model config, for caches: `from_key` rebuilds it."""
    return type(cfg), json.dumps(asdict(cfg), sort_keys=True, default=str)


def from_key(schema: type[ModelConfig], text: str) -> ModelConfig:
    """The config `model_key` gave (nested values typed again: model.moe)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), json.loads(text)))
