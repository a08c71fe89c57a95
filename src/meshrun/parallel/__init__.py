"""Turn a plain model into its parallel form for a layout.

Composition order (as in torchtitan): tensor parallel, then the pipeline split, then
activation checkpointing, then the data-parallel wrapper (FSDP2 or DDP) outermost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from meshrun.config import ParallelConfig
from meshrun.mesh import Layout
from meshrun.parallel.dataparallel import apply_dataparallel
from meshrun.parallel.ddp import apply_ddp
from meshrun.parallel.fsdp import apply_fsdp


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    layout: Layout,
    cfg: ParallelConfig,
    device: torch.device,
    param_dtype: torch.dtype,
) -> nn.Module:
    if cfg.data_parallel == "dataparallel":
        return apply_dataparallel(model, cfg.dataparallel_devices)
    if mesh is None:
        return model
    if layout.dp_shard > 1:
        return apply_fsdp(model, mesh, layout, cfg.fsdp, param_dtype)
    if layout.dp_replicate > 1:
        return apply_ddp(model, mesh, cfg.ddp, device)
    return model


def uses_fsdp(model: nn.Module) -> bool:
    """FSDP casts parameters itself (MixedPrecisionPolicy); other layouts need autocast."""
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction on all but the last micro-batch."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield
