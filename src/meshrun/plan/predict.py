"""The planner's predictions for any model: by formula where the model has one (memory.py,
speed.py: meshrun's decoder, the transformers families), otherwise from its parallel module
traced on fake tensors (traced.py), the speed model then costing what was counted."""

from __future__ import annotations

from types import ModuleType

from meshrun.core.calibration import Calibration
from meshrun.core.config import ExperimentConfig
from meshrun.core.flops import flops_per_token
from meshrun.core.layout import Layout
from meshrun.models import model_shape, param_counts
from meshrun.plan.memory import MemoryPrediction, predict_memory, predict_stages
from meshrun.plan.shapes import Dims, inactive_matmul_params
from meshrun.plan.speed import SpeedPrediction, predict_speed


def has_formula(cfg: ExperimentConfig) -> bool:
    return model_shape(cfg.model).formula


def _tracer() -> ModuleType:
    """traced.py, imported when a model needs it: it builds ranks with torch's whole
    distributed stack (DTensor, FSDP, pipelining: a second of imports every `meshrun` would
    pay before its first message otherwise)."""
    from meshrun.plan import traced  # noqa: PLC0415 (see the docstring)

    return traced


def memory(cfg: ExperimentConfig) -> list[MemoryPrediction]:
    return predict_memory(cfg) if has_formula(cfg) else _tracer().traced_memory(cfg)


def stage_memory(cfg: ExperimentConfig) -> list[MemoryPrediction]:
    """Per pipeline rank (its ranks hold the same): what the planner compares."""
    return predict_stages(cfg) if has_formula(cfg) else traced_stages(cfg)


def traced_stages(cfg: ExperimentConfig) -> list[MemoryPrediction]:
    """Per pipeline rank, from the rank's parallel module run on fake tensors in a fake
    process group of the layout's world size (traced.py): nothing allocated at any size."""
    per_rank = _tracer().traced_memory(cfg)
    return per_rank[:: len(per_rank) // Layout.of(cfg.parallel).pp]


def speed(
    cfg: ExperimentConfig, host_flops: float | None, calibration: Calibration | None = None
) -> SpeedPrediction | None:
    if has_formula(cfg):
        return predict_speed(cfg, host_flops, calibration=calibration)
    cost = _tracer().traced_cost(cfg)
    return predict_speed(cfg, host_flops, cost, calibration) if cost else None


def traced(cfg: ExperimentConfig) -> list[MemoryPrediction] | None:
    """The trace a run records: its only prediction without a formula, or with plan.trace."""
    return _tracer().traced_memory(cfg) if cfg.plan.trace or not has_formula(cfg) else None


def counted_flops(cfg: ExperimentConfig) -> float | None:
    """torch's count of the training FLOPs per token, where a run records the trace."""
    if cfg.plan.trace or not has_formula(cfg):
        return _tracer().counted_flops_per_token(cfg)
    return None


def training_flops_per_token(cfg: ExperimentConfig) -> float:
    """For MFU: PaLM's formula (core/flops.py) where it applies, else counted."""
    if not has_formula(cfg):
        return _tracer().counted_flops_per_token(cfg)
    _, active = _matmul_params(cfg)
    return flops_per_token(model_shape(cfg.model), active, cfg.train.seq_len)


def active_share(cfg: ExperimentConfig) -> float | None:
    """An MoE model's share of its matmul parameters a token meets (its top-k experts, not
    every expert's), which its MFU counts; None for a dense model or one without formulas."""
    if not has_formula(cfg) or not model_shape(cfg.model).experts:
        return None
    matmul, active = _matmul_params(cfg)
    return active / matmul


def _matmul_params(cfg: ExperimentConfig) -> tuple[int, int]:
    """(the matmul parameters, those a token meets: an MoE token's experts only)."""
    _, matmul = param_counts(cfg.model, cfg.train.seq_len)
    return matmul, matmul - inactive_matmul_params(Dims.of(cfg.model))
