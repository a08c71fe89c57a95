"""Turn the model into its parallel form for a layout.

Composition order (as in torchtitan): pipeline cut (on the meta device), materialise and
init, tensor parallel, activation checkpointing, then the data-parallel wrapper outermost
(FSDP2, HSDP, DDP or DataParallel), then the pipeline schedule over the stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.nn.parallel import DistributedDataParallel

from meshrun.core.config import ParallelConfig
from meshrun.core.layout import Layout
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing
from meshrun.rank.parallel.dataparallel import apply_dataparallel
from meshrun.rank.parallel.ddp import apply_ddp
from meshrun.rank.parallel.fsdp import apply_fsdp
from meshrun.rank.parallel.pipeline import (
    build_schedule,
    cut_stage,
    local_stage_ids,
    stage_layer_counts,
)
from meshrun.rank.parallel.tensor import resolve_tp_plan


@dataclass
class ParallelModel:
    """What one rank trains: its model part(s) and, under PP, the schedule that drives them."""

    parts: list[nn.Module]
    schedule: _PipelineSchedule | None = None
    is_first_stage: bool = True
    is_last_stage: bool = True

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters() if p.requires_grad]

    @property
    def casts_params(self) -> bool:
        """FSDP casts parameters itself (MixedPrecisionPolicy); other wrappers need autocast."""
        return isinstance(self.parts[0], FSDPModule)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    layout: Layout,
    cfg: ParallelConfig,
    device: torch.device,
    seed: int,
    param_dtype: torch.dtype,
    n_microbatches: int = 1,
    pretrained: str | None = None,
) -> ParallelModel:
    """`model` is the full model on the meta device (rank/models); returns this rank's
    materialised share, its weights seeded or read from `pretrained` (a local HF directory).
    `n_microbatches`: a pipeline's per step (core.layout.n_microbatches)."""
    pp_rank = mesh.get_local_rank("pp") if layout.pp > 1 else 0
    stage_ids, n_stages = pipeline_stages(pp_rank, layout, cfg)
    wrapped = [data_parallel(sharded_part(part, mesh, layout, cfg, device, seed, pretrained),
                             mesh, layout, cfg, device, param_dtype)
               for part in stage_parts(model, pp_rank, layout, cfg)]  # fmt: skip
    schedule = None
    if layout.pp > 1:
        schedule = build_schedule(
            wrapped, stage_ids, n_stages, mesh["pp"], cfg, n_microbatches, device
        )
    return ParallelModel(wrapped, schedule, 0 in stage_ids, n_stages - 1 in stage_ids)


def pipeline_stages(pp_rank: int, layout: Layout, cfg: ParallelConfig) -> tuple[list[int], int]:
    """(the stage ids of pipeline rank `pp_rank`, the number of stages)."""
    if layout.pp == 1:
        return [0], 1
    return local_stage_ids(pp_rank, layout.pp, cfg.stages_per_rank), layout.pp * cfg.stages_per_rank


def stage_parts(model: nn.Module, pp_rank: int, layout: Layout, cfg: ParallelConfig
                ) -> list[nn.Module]:  # fmt: skip
    """Pipeline rank `pp_rank`'s model part(s) on meta, one per stage it owns."""
    if layout.pp == 1:
        return [model]
    stage_ids, n_stages = pipeline_stages(pp_rank, layout, cfg)
    counts = stage_layer_counts(len(model.layers), n_stages, cfg.pp_layers)
    return [cut_stage(model, stage, counts) for stage in stage_ids]


def sharded_part(
    part: nn.Module,
    mesh: DeviceMesh | None,
    layout: Layout,
    cfg: ParallelConfig,
    device: torch.device,
    seed: int,
    pretrained: str | None = None,
) -> nn.Module:
    """Materialised, its weights seeded or loaded, tensor-parallel and checkpointed: all but
    the data-parallel wrapper (which the planner applies apart, plan/traced.py)."""
    part.to_empty(device=device)
    if pretrained is None:
        part.init_weights(seed)
    else:
        part.load_pretrained(pretrained)
    if layout.tp > 1:
        resolve_tp_plan(cfg.tp_plan)(part, mesh["tp"], cfg.sequence_parallel)
    apply_activation_checkpointing(part, cfg.activation_checkpointing)
    return part


def data_parallel(
    part: nn.Module,
    mesh: DeviceMesh | None,
    layout: Layout,
    cfg: ParallelConfig,
    device: torch.device,
    param_dtype: torch.dtype,
) -> nn.Module:
    if cfg.data_parallel == "dataparallel":
        return apply_dataparallel(part, cfg.dataparallel_devices)
    if mesh is None or layout.dp_size == 1:
        return part
    if layout.uses_fsdp:
        # Replication next to TP/PP goes through FSDP2 on a (replicate, shard=1) mesh.
        # Under PP, keep parameters gathered across the micro-batches of a step instead of
        # re-gathering for each.
        reshard = cfg.fsdp.reshard_after_forward and layout.pp == 1
        return apply_fsdp(part, mesh, layout, reshard, param_dtype)
    return apply_ddp(part, mesh, cfg.ddp, device)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce on all but the last micro-batch.

    FSDP reduce-scatters every micro-batch instead: skipping it would accumulate unsharded
    gradients, a full-size copy per rank, which is the memory FSDP exists to save."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    yield
