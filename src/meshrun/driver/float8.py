"""A float8 run's record fields (train.float8): what ran in float8 and its MFU against the
float8 peak, beside the record's own MFU against the run's precision's (bf16) peak."""

from __future__ import annotations

from typing import Any

from meshrun.core.baseline import n_devices
from meshrun.core.config import ExperimentConfig
from meshrun.core.flops import mfu, peak_flops
from meshrun.core.hardware import device_for_rank
from meshrun.models import float8_coverage, model_shape
from meshrun.plan import predict

EXPERTS_NOTE = (
    "the MoE experts' matmuls stay in {precision}: torchao's float8 grouped GEMM "
    "(torchao.prototype.moe_training, CUDA sm90/sm100 only) is not used"
)


def float8_fields(cfg: ExperimentConfig, tokens_per_s: float | None) -> dict[str, Any]:
    """The recipe, the linears converted and their share of a token's training FLOPs
    (6 x their weights over PaLM's count: predict.training_flops_per_token), a note of
    what stayed in high precision, MFU against the fp8 peak; nothing where float8 is off."""
    f8 = cfg.train.float8
    if not f8.enabled:
        return {}
    linears, elements = float8_coverage(cfg.model, cfg.train.seq_len, f8.skip)
    per_token = predict.training_flops_per_token(cfg)
    specs = [device_for_rank(cfg.hardware.devices, i) for i in range(n_devices(cfg))]
    peak = peak_flops(specs, "fp8")
    experts = model_shape(cfg.model).experts
    return {
        "float8_recipe": str(f8.recipe),
        "float8_linears": linears,
        "float8_flops_share": 6 * elements / per_token,
        "float8_note": EXPERTS_NOTE.format(precision=cfg.train.precision) if experts else None,
        "mfu_fp8_peak": mfu(tokens_per_s, per_token, peak) if tokens_per_s else None,
    }
