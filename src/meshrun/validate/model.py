"""The model's rules, each its kind's (models/kinds.py: meshrun's decoder's sizes and
checkpoint, a transformers model's class, config and checkpoint, a user's module's names and
TP plan; a kind of your own checks its own): reached through the kind, as is model=hf/auto's
`read_pretrained`, called by every command that resolves an experiment before its rules."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig, ModelConfig
from meshrun.core.errors import positive
from meshrun.models import model_kind


def check_model(m: ModelConfig, read_from: str | None = None) -> None:
    """`read_from`: the config.json model=hf/auto was read from, which its checkpoint then
    matches by construction (read_pretrained checked the overrides)."""
    positive("model.context_len", m.context_len, allow_none=True)
    model_kind(m).check(m, read_from)


def check_sequence(cfg: ExperimentConfig) -> None:
    """What the model's positions hold of train.seq_len (a transformers model's learned
    position table has rows for so many positions only)."""
    model_kind(cfg.model).check_sequence(cfg.model, cfg.train.seq_len)


def model_context(m: ModelConfig) -> tuple[int, str] | None:
    """The sequence the model was made for and the key that says so: `model.context_len`
    (meshrun's presets: the pretraining sequence), else a transformers model's
    `max_position_embeddings`; None where neither is known."""
    return model_kind(m).context(m)


def read_pretrained(m: ModelConfig) -> tuple[ModelConfig, str | None]:
    """The model as its kind completes it from `model.pretrained` (model=hf/auto: the
    architecture and config of its config.json, models/hf_rules.py), with the file it was
    read from; any other model as it is, with None."""
    return model_kind(m).read_pretrained(m)


def describe_read(m: ModelConfig, read_from: str | None) -> str | None:
    """What `read_pretrained` read from `read_from`, for the record and the console; None for
    a model that was not read."""
    return None if read_from is None else model_kind(m).describe_read(m, read_from)


def model_overrides(m: ModelConfig) -> str:
    """The overrides that select the model (as composed, before read_pretrained) again: its
    preset, or hf/auto and the directory."""
    return model_kind(m).overrides(m)
