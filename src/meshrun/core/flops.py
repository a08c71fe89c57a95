"""Model FLOPs per token and MFU, as the planner predicts them and the record reports them.

FLOPs per token for a training step (forward + backward) follow PaLM's appendix B:
6 * N + 12 * n_layers * dim * seq_len, N being the parameters that take part in matmuls
(the attention term counts QK^T and AV, which have no parameters; over the queries' width,
n_heads x head_dim, where the heads are wider than dim / n_heads).
"""

from __future__ import annotations

from meshrun.core.config import DeviceSpec
from meshrun.core.model_shape import ModelShape


def flops_per_token(shape: ModelShape, matmul_params: int, seq_len: int) -> float:
    return 6.0 * matmul_params + 12.0 * shape.n_layers * shape.q_dim * seq_len


def peak_tflops(spec: DeviceSpec, precision: str) -> float | None:
    """A device's dense peak at `precision` (core/precision.matmul_precision's); a device
    without TF32 (no tf32 figure) runs TF32-allowed matmuls in fp32, at its fp32 peak."""
    peak = spec.peak_tflops.get(precision)
    if peak is None and precision == "tf32":
        return spec.peak_tflops.get("fp32")
    return peak


def peak_flops(specs: list[DeviceSpec | None], precision: str) -> float | None:
    """Sum of the peaks of the devices a run uses; None if any of them has no known peak."""
    total = 0.0
    for spec in specs:
        peak = None if spec is None else peak_tflops(spec, precision)
        if peak is None:
            return None
        total += peak * 1e12
    return total


def mfu(tokens_per_s: float, flops_token: float, peak: float | None) -> float | None:
    return None if not peak else tokens_per_s * flops_token / peak
