"""What a rank's step does on its device alike everywhere: the run's autocast, and waiting
for the device's queued work before a clock is read (CPU ops are done when they return)."""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """bf16 autocast where the parameters are fp32 (`dtype` None: FSDP casts, or fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
