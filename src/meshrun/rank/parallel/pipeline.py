"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut by layers into pp * stages_per_rank stages; the first keeps the embedding,
the last the final norm and head (a tied head as a copy of the embedding's weight: tied.py).
Rank r of the pp dim owns stages r, r + pp, ... (looped placement, what the interleaved
schedules expect). Stages are cut on the meta device and only
then materialised, so a rank allocates only its own layers; parameter names, and therefore
the seed-derived init, are those of the full model.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
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

from meshrun.core.choices import Schedule
from meshrun.core.config import ParallelConfig
from meshrun.core.stages import MULTI_STAGE_SCHEDULES
from meshrun.models.moe import uncounted
from meshrun.rank.parallel import transfers
from meshrun.rank.parallel.loss import cross_entropy, stage_loss
from meshrun.rank.parallel.tied import mark_head_copy
from meshrun.rank.parallel.transfers import Transfer
from meshrun.rank.profiling import phase

# Keyed by the config's enum, which is the one list of schedule names (tests check they agree).
SCHEDULES = {
    Schedule["gpipe"]: ScheduleGPipe,
    Schedule["1f1b"]: Schedule1F1B,
    Schedule["interleaved_1f1b"]: ScheduleInterleaved1F1B,
    Schedule["interleaved_zb"]: ScheduleInterleavedZeroBubble,
}


def cut_stage(full: nn.Module, stage: int, counts: list[int]) -> nn.Module:
    """A copy of the (meta) model holding only `stage`'s layers and ends."""
    first = sum(counts[:stage])
    keep = {str(i) for i in range(first, first + counts[stage])}
    part = copy.deepcopy(full)
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
        part.pos_embeddings = None  # a learned position table, where the model has one
    if stage != len(counts) - 1:
        part.norm = None
        part.output = None
    elif stage != 0 and part.tied:
        mark_head_copy(part)  # the head keeps the (meta) embedding weight it was tied to
    return part


def prefetches(schedule: str, device: torch.device) -> bool:
    """GPipe and 1F1B over gloo receive ahead. Torch posts each receive just before it waits
    on it, and gloo moves data only once the receive is posted: every hop then waits out a
    handshake and a copy (on 2 CPU ranks, 1.5 MB: ~1 ms posted late, 0.03 ms posted ahead),
    which add up along the critical path (GPipe m=8: measured bubble +32% over theory in three
    runs, +16% with prefetching). The interleaved schedules post their own receives ahead;
    NCCL was not measured this way, so it keeps torch's order."""
    return schedule in ("gpipe", "1f1b") and device.type == "cpu"


COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def stage_compute(schedule: _PipelineSchedule) -> Iterator[tuple[PipelineStage, str]]:
    """(stage, method name) of each compute a schedule's stages run per micro-batch: what
    the bubble clock times and a profiled step's trace names (a stage that waits for its
    inputs inside forward_one_chunk names its compute in `compute_methods`)."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for method in getattr(stage, "compute_methods", COMPUTE_METHODS):
            if hasattr(stage, method):
                yield stage, method


def annotate_stages(schedule: _PipelineSchedule) -> None:
    """Each pipeline stage's compute per micro-batch named in a profiled step's trace,
    `meshrun:forward stage S mb I` (backward alike): the timeline's boxes (rank/profiling.py).
    Wraps what the bubble clock times."""
    for stage, method in stage_compute(schedule):
        kind = "forward" if "forward" in method else "backward"
        kind += " (weights)" if "weight" in method else ""
        setattr(stage, method, _named(getattr(stage, method), kind, stage.stage_index))


def _named(fn: Callable[..., Any], kind: str, stage: int) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(chunk: int, *args: Any, **kwargs: Any) -> Any:
        with phase(f"{kind} stage {stage} mb {chunk}"):
            return fn(chunk, *args, **kwargs)

    return wrapper


class UncountedInference(PipelineStage):
    """A stage whose shape inference (a forward, in torch 2.13 a backward too, of zeros or
    empty tensors before the first micro-batch) leaves the MoE routers' counts alone
    (models/moe.uncounted), so load_balance=bias moves by the batch's tokens only. The
    inference is torch 2.11's `_shape_inference` (torch/distributed/pipelining/stage.py:1421)
    and 2.13's `_forward_metadata_inference` and `_backward_metadata_inference` (stage.py:1883,
    1976); a version has one or the other, the other override is never called."""

    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
        with uncounted():
            return super()._shape_inference(*args, **kwargs)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with uncounted():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with uncounted():
            return super()._backward_metadata_inference(*args, **kwargs)


class PrefetchingStage(UncountedInference):
    """A stage that posts micro-batch i+1's receive when the schedule asks for i's, so that
    transfer runs while i computes. The schedule gets no receive ops to post or wait on: the
    stage waits for a micro-batch's input (or gradient) right before computing with it, after
    the sends the schedule batched with the receive are posted (1F1B pairs each receive with
    a send the peer is waiting for: waiting first could deadlock). The compute itself is
    `compute_forward` / `compute_backward`, which the bubble clock times: the wait is idle.
    Its sends and receives are noted (rank/parallel/transfers.py): gloo's flight recorder
    keeps none, and a pipeline hang is a receive that never completes."""

    compute_methods = ("compute_forward", "compute_backward")

    def __init__(self, *args, n_microbatches: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._n_microbatches = n_microbatches
        self._posted: dict[tuple[str, int], tuple[list[dist.Work], list[Transfer]]] = {}

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._post_through("fwd", fwd_chunk_id, super().get_fwd_recv_ops)
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        self._post_through("bwd", bwd_chunk_id, super().get_bwd_recv_ops)
        return []

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        transfers.posted("send", CARRIES["fwd"], fwd_chunk_id, ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        transfers.posted("send", CARRIES["bwd"], bwd_chunk_id, ops)
        return ops

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._wait("fwd", fwd_chunk_id)
        return self.compute_forward(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._wait("bwd", bwd_chunk_id)
        return self.compute_backward(bwd_chunk_id, *args, **kwargs)

    def compute_forward(self, fwd_chunk_id: int, *args, **kwargs):
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def compute_backward(self, bwd_chunk_id: int, *args, **kwargs):
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _post_through(
        self, kind: str, chunk: int, ops_of: Callable[[int], list[dist.P2POp]]
    ) -> None:
        """`chunk`'s receive posted (if the previous call did not already) and the next's."""
        for i in (chunk, chunk + 1):
            if i < self._n_microbatches and (kind, i) not in self._posted:
                ops = ops_of(i)
                noted = transfers.posted("recv", CARRIES[kind], i, ops)
                self._posted[(kind, i)] = (_post(ops), noted)

    def _wait(self, kind: str, chunk: int) -> None:
        works, noted = self._posted.pop((kind, chunk), ([], []))
        for work in works:
            work.wait()
        transfers.done(noted)


# What a stage receives for a forward and for a backward (and sends after them)
CARRIES = {"fwd": "activations", "bwd": "gradients"}


def _post(ops: list[dist.P2POp]) -> list[dist.Work]:
    return dist.batch_isend_irecv(ops) if ops else []


class ScaledLoss:
    """A training schedule's loss (train.loss's `method`: parallel/loss.py) times `factor`
    (1, or debug.corrupt_step's NaN or spike) and `scale` (fp16's loss scale), both set
    before each step: the schedule runs backward from what its loss function returns, and
    hands that back."""

    def __init__(self, method: str = "full") -> None:
        self.method = method
        self.scale = 1.0
        self.factor = 1.0

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return stage_loss(output, targets, self.method) * self.factor * self.scale


def build_schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    n_stages: int,
    pp_mesh: DeviceMesh,
    cfg: ParallelConfig,
    n_microbatches: int,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy,
) -> _PipelineSchedule:
    group = pp_mesh.get_group()
    stages = [
        PrefetchingStage(
            part, stage_id, n_stages, device, group=group, n_microbatches=n_microbatches
        )
        if prefetches(cfg.schedule, device)
        else UncountedInference(part, stage_id, n_stages, device, group=group)
        for part, stage_id in zip(parts, stage_ids, strict=True)
    ]
    schedule_cls = SCHEDULES[cfg.schedule]
    if cfg.schedule in MULTI_STAGE_SCHEDULES:
        return schedule_cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return schedule_cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
