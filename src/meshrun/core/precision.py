"""What a run computes in: `train.precision=auto` decided for a box, and the rate its matmuls
run at (the planner's prediction and the record's MFU divide by the same peak)."""

from __future__ import annotations

from collections.abc import Sequence

from meshrun.core.config import ExperimentConfig, HardwareConfig

# Ampere (sm80) brought bf16 and TF32 tensor cores; older GPUs emulate bf16 slowly.
BF16_CAPABILITY = (8, 0)


def auto_precision(
    hardware: HardwareConfig, capabilities: Sequence[tuple[int, int] | None]
) -> tuple[str, str]:
    """(precision, why) for `hardware`: fp32 on CPU; on CUDA bf16 where every device has it,
    judged by the devices' compute capabilities where all are known (this host's), else by
    the profile's datasheet (a plan against a profile): a bf16 peak on every device kind."""
    if hardware.device_type != "cuda":
        return "fp32", "CPU"
    if capabilities and all(c is not None for c in capabilities):
        major, minor = min(c for c in capabilities if c is not None)
        sm = f"sm{major}{minor}"
        if (major, minor) >= BF16_CAPABILITY:
            return "bf16", sm
        return "fp32", f"{sm}, no bf16"
    lacking = [spec.name for spec in hardware.devices if "bf16" not in spec.peak_tflops]
    if hardware.devices and not lacking:
        return "bf16", f"{hardware.name}'s datasheet bf16 peak"
    return "fp32", f"no bf16 peak for {lacking[0] if lacking else hardware.name}"


def matmul_precision(cfg: ExperimentConfig) -> str:
    """The peak a run's matmuls reach: fp32 on CUDA with train.tf32 runs on TF32 tensor cores
    (the rank allows them: rank/device.set_fp32_matmul); anything else at its own precision.
    The planner's rate and the record's MFU both divide by this one."""
    t = cfg.train
    on_cuda = cfg.hardware.device_type == "cuda"
    return "tf32" if t.precision == "fp32" and on_cuda and t.tf32 else t.precision
