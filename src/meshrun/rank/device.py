"""What a rank's step does on its device alike everywhere: the run's autocast, fp32's
matmul precision on CUDA, and waiting for the device's queued work before a clock is read
(CPU ops are done when they return)."""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """bf16 autocast where the parameters are fp32 (`dtype` None: FSDP casts, or fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def set_fp32_matmul(device: torch.device, precision: str, tf32: bool) -> None:
    """An fp32 run on CUDA: matmuls and cuDNN's convolutions on TF32 tensor cores where
    train.tf32 allows them (the rate the planner and MFU count, core/precision.py), in full
    fp32 where not. Nothing changes elsewhere: a CPU rank keeps torch's defaults (there
    "high" would also let oneDNN's matmuls drop precision). torch.set_float32_matmul_precision
    sets cuBLAS's TF32 switch with the legacy and per-backend flags in step (torch/__init__.py;
    setting torch.backends.cuda.matmul.fp32_precision alone makes torch.get_float32_matmul_
    precision(), which inductor's autotune cache reads, raise: aten/src/ATen/Context.cpp)."""
    if device.type != "cuda" or precision != "fp32":
        return
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32  # torch/backends/cudnn/__init__.py (default True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
