"""Single-process torch.nn.DataParallel: scatters each batch over several CUDA devices and
gathers outputs on the first. Kept as the baseline that DDP was built to beat."""

from __future__ import annotations

from torch import nn


def apply_dataparallel(model: nn.Module, n_devices: int) -> nn.Module:
    return nn.DataParallel(model, device_ids=list(range(n_devices)))
