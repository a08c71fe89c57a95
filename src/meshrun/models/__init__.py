"""The models a layout can train, one kind each (`model.kind`): meshrun's own LLaMA-style
decoder, Hugging Face transformers causal LMs, a user's own nn.Module (models/kinds.py), or a
kind of your own (models/kind.py: the ModelKind protocol, models/registry.py: by name or
import path). The rest of meshrun reaches them through these names."""

from meshrun.models.build import (
    build_model,
    count_params,
    float8_coverage,
    model_shape,
    param_counts,
    routers_of,
)
from meshrun.models.keys import from_key, model_key
from meshrun.models.kind import ModelKind
from meshrun.models.registry import model_kind

__all__ = [
    "ModelKind",
    "build_model",
    "count_params",
    "float8_coverage",
    "from_key",
    "model_key",
    "model_kind",
    "model_shape",
    "param_counts",
    "routers_of",
]
