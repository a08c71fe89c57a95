"""The model kinds by `model.kind`: meshrun's three (models/kinds.py), and any other named by
its import path, "package.module:attribute" (a `ModelKind` in a user's module, imported the
same way in the driver and in every rank: core/imports.py)."""

from __future__ import annotations

import functools

from meshrun.core.config import ModelConfig
from meshrun.core.errors import fail
from meshrun.core.imports import import_target
from meshrun.models.kind import ModelKind
from meshrun.models.kinds import CustomKind, HFKind, LlamaKind

BUILT_IN: dict[str, ModelKind] = {k.name: k for k in (LlamaKind(), HFKind(), CustomKind())}


def model_kind(cfg: ModelConfig) -> ModelKind:
    """The kind of `cfg`; a ConfigError (exit 2) where `model.kind` names none, or a kind
    whose schema is not the config's (`model.kind` overridden on another kind's preset)."""
    kind = kind_named(cfg.kind)
    if kind is None:
        fail(
            "model.kind",
            cfg.kind,
            "is no model kind of meshrun's, nor an importable ModelKind",
            f"{' | '.join(BUILT_IN)}, or package.module:attribute of a ModelKind",
        )
    if type(cfg) is not kind.schema:
        fail(
            "model.kind",
            cfg.kind,
            f"is the kind of {kind.schema.__name__}, and model={cfg.name} is a "
            f"{type(cfg).__name__}",
            "the kind its preset names (no model.kind override)",
        )
    return kind


@functools.cache
def kind_named(name: str) -> ModelKind | None:
    """The kind `name` names, imported once; None where it names none."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    try:
        kind = import_target(name)
    except (ImportError, ValueError):
        return None
    kind = kind() if isinstance(kind, type) else kind  # a class or its instance
    return kind if isinstance(kind, ModelKind) else None
