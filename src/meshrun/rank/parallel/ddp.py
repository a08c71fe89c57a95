"""Replicated data parallelism: torch's DistributedDataParallel over the dp_replicate dim."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from meshrun.core.config import DDPConfig


def apply_ddp(
    model: nn.Module, mesh: DeviceMesh, cfg: DDPConfig, device: torch.device
) -> nn.Module:
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh["dp_replicate"].get_group(),
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
    )
