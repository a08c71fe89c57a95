"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut by layers into pp * stages_per_rank stages; the first keeps the embedding,
the last the final norm and head. Rank r of the pp dim owns stages r, r + pp, ... (looped
placement, what the interleaved schedules expect). Stages are cut on the meta device and only
then materialised, so a rank allocates only its own layers; parameter names, and therefore
the seed-derived init, are those of the full model.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _PipelineSchedule,
)

from meshrun.config import ParallelConfig
from meshrun.models.llama import Transformer

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zb")


def stage_layer_counts(n_layers: int, n_stages: int, explicit: list[int] | None) -> list[int]:
    """Layers per stage: `explicit` as given, else as even as possible (earlier stages, which
    also hold the embedding, get no more than later ones)."""
    if explicit:
        return list(explicit)
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if stage >= n_stages - extra else 0) for stage in range(n_stages)]


def local_stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def cut_stage(full: Transformer, stage: int, counts: list[int]) -> Transformer:
    """A copy of the (meta) model holding only `stage`'s layers and ends."""
    first = sum(counts[:stage])
    keep = {str(i) for i in range(first, first + counts[stage])}
    part = copy.deepcopy(full)
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != len(counts) - 1:
        part.norm = None
        part.output = None
    return part


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    n_stages: int,
    pp_mesh: DeviceMesh,
    cfg: ParallelConfig,
    n_microbatches: int,
    device: torch.device,
) -> _PipelineSchedule:
    stages = [
        PipelineStage(part, stage_id, n_stages, device, group=pp_mesh.get_group())
        for part, stage_id in zip(parts, stage_ids, strict=True)
    ]
    schedule_cls = SCHEDULES[cfg.schedule]
    if cfg.schedule in MULTI_STAGE_SCHEDULES:
        return schedule_cls(stages, n_microbatches=n_microbatches, loss_fn=pipeline_loss)
    return schedule_cls(stages[0], n_microbatches=n_microbatches, loss_fn=pipeline_loss)


def theoretical_bubble(pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved (v stages a rank)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
