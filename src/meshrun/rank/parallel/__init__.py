"""Turn the model into its parallel form for a layout.

Composition order (as in torchtitan): on the meta device, the pipeline cut, context
parallel, float8 linears (train.float8), tensor parallel, expert parallel, activation
checkpointing, torch.compile per block and FSDP2 (HSDP); then each rank materialises what it
holds, seeded or read from a checkpoint (no rank ever holds the whole model); then the
wrappers that need real tensors (DDP, DataParallel); then the pipeline schedule.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.nn.parallel import DistributedDataParallel

from meshrun.core.config import Float8Config, ParallelConfig
from meshrun.core.layout import Layout
from meshrun.core.stages import local_stage_ids, stage_layer_counts
from meshrun.rank.mesh import build_expert_mesh
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing
from meshrun.rank.parallel.compile import apply_compile
from meshrun.rank.parallel.context import apply_context_parallel
from meshrun.rank.parallel.dataparallel import apply_dataparallel
from meshrun.rank.parallel.ddp import apply_ddp
from meshrun.rank.parallel.expert import apply_expert_parallel
from meshrun.rank.parallel.fsdp import apply_fsdp
from meshrun.rank.parallel.pipeline import ScaledLoss, build_schedule, cut_stage
from meshrun.rank.parallel.tensor import resolve_tp_plan
from meshrun.rank.parallel.tied import TiedWeights, tied_weights


@dataclass
class ParallelModel:
    """What one rank trains: its model part(s) and, under PP, the schedule that drives them."""

    parts: list[nn.Module]
    schedule: _PipelineSchedule | None = None
    is_first_stage: bool = True
    is_last_stage: bool = True
    pretrained_bytes_read: int = 0
    new_schedule: Callable[[], _PipelineSchedule] | None = None  # another one over `parts`
    loss: ScaledLoss | None = None  # the training schedule's (its scale: fp16's loss scale)
    tied: TiedWeights | None = None  # a tied embedding's end on a pipeline's first/last stage
    float8_scales: bool = False  # FSDP2 all-gathers float8 weights at precomputed scales

    def refresh_float8_scales(self) -> None:
        """The float8 all-gather's scales from the weights as they now are: after each
        optimizer step and each load of the weights (parallel/float8.py)."""
        if self.float8_scales:
            from meshrun.rank.parallel.float8 import refresh_scales  # noqa: PLC0415

            refresh_scales(self.parts)

    def norm_copies(self) -> list[nn.Parameter]:
        """Parameters that copy another rank's (a tied head): left out of the gradient norm."""
        return [self.tied.param] if self.tied is not None and self.tied.is_copy else []

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters() if p.requires_grad]

    @functools.cached_property
    def eval_schedule(self) -> _PipelineSchedule:
        """The evaluation's own schedule over the same modules, only ever run forward-only.
        One schedule switched between `eval` and `step` re-initialises its stages (P2P
        warm-up, shape inference, buffers) at every switch, and the switch back would run
        inside the next timed training step."""
        return self.new_schedule()

    def run_schedule(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        train: bool = True,
        loss_scale: float = 1.0,
        loss_factor: float = 1.0,
    ) -> torch.Tensor:
        """One pass of a pipeline schedule over a batch: a training step (its backward
        from the loss times `loss_scale`; the loss itself times `loss_factor`: a corrupted
        step's), or forward only (`train` false:
        `eval_schedule.eval`, which skips every backward action). Neither keeps the last
        stage's outputs: torch's schedule would hold every micro-batch's logits until the
        step ends (m x micro-batch x seq x vocab floats), for a merged output nobody reads.
        The mean of the micro-batch losses (unscaled) on the last stage, zero elsewhere."""
        self.loss.scale = loss_scale if train else 1.0
        self.loss.factor = loss_factor if train else 1.0
        losses: list[torch.Tensor] = []
        kwargs = {
            "target": targets if self.is_last_stage else None,
            "losses": losses,
            "return_outputs": False,
        }
        run = self.schedule.step if train else self.eval_schedule.eval
        if self.is_first_stage:
            run(inputs, **kwargs)
        else:
            run(**kwargs)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([loss.detach() for loss in losses]).mean() / self.loss.scale

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
    compile: bool = False,
    seq_len: int = 0,
    float8: Float8Config | None = None,
) -> ParallelModel:
    """`model` is the full model on the meta device (meshrun.models); returns this rank's
    materialised share, its weights seeded or read from `pretrained` (a local HF directory).
    `n_microbatches`: a pipeline's per step (core.batch.n_microbatches); `compile`: each
    block through torch.compile (train.compile); `seq_len`: the sequence CP splits;
    `float8`: train.float8."""
    pp_rank = mesh.get_local_rank("pp") if layout.pp > 1 else 0
    stage_ids, n_stages = pipeline_stages(pp_rank, layout, cfg)
    wrapped, read = [], 0
    expert_mesh = build_expert_mesh(layout, device.type) if layout.splits_experts else None
    for cut in stage_parts(model, pp_rank, layout, cfg):
        if layout.cp > 1:
            cp_mesh = mesh["cp"]
            apply_context_parallel(
                cut,
                cp_mesh.get_group(),
                cfg.cp_method,
                seq_len,
                cp_mesh.get_local_rank(),
                layout.cp,
            )
        part = sharded_part(cut, mesh, layout, cfg, param_dtype, compile, expert_mesh, float8)
        read += materialise(part, device, seed, pretrained)
        wrapped.append(replicated(part, mesh, layout, cfg, device))
    schedule = new_schedule = tied = None
    loss = ScaledLoss()
    if layout.pp > 1:
        new_schedule = functools.partial(
            build_schedule, wrapped, stage_ids, n_stages, mesh["pp"], cfg, n_microbatches, device
        )
        schedule = new_schedule(loss_fn=loss)
        tied = tied_weights(wrapped, mesh)
    parallel = ParallelModel(
        wrapped, schedule, 0 in stage_ids, n_stages - 1 in stage_ids, read, new_schedule, loss, tied
    )
    parallel.float8_scales = float8_all_gather(float8, mesh, layout, cfg)
    parallel.refresh_float8_scales()
    return parallel


def pipeline_stages(pp_rank: int, layout: Layout, cfg: ParallelConfig) -> tuple[list[int], int]:
    """(the stage ids of pipeline rank `pp_rank`, the number of stages)."""
    if layout.pp == 1:
        return [0], 1
    return local_stage_ids(pp_rank, layout.pp, cfg.stages_per_rank), layout.pp * cfg.stages_per_rank


def stage_parts(
    model: nn.Module, pp_rank: int, layout: Layout, cfg: ParallelConfig
) -> list[nn.Module]:
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
    param_dtype: torch.dtype,
    compile: bool = False,
    expert_mesh: DeviceMesh | None = None,
    float8: Float8Config | None = None,
) -> nn.Module:
    """On meta: float8 linears (`float8`: train.float8), tensor-parallel, expert-parallel
    (over `expert_mesh`, rank/mesh.py), checkpointed, compiled (`compile`) and
    FSDP2-sharded, every parameter already the DTensor it trains as, so that materialising
    fills only this rank's share."""
    if float8 is not None and float8.enabled:
        from meshrun.rank.parallel.float8 import convert  # noqa: PLC0415 (meshrun[float8])

        convert(part, float8, _sharded(mesh, layout, cfg))
    if layout.tp > 1:
        resolve_tp_plan(cfg.tp_plan)(part, mesh["tp"], cfg.sequence_parallel)
    if expert_mesh is not None:
        apply_expert_parallel(part, expert_mesh, layout)
    apply_activation_checkpointing(part, cfg.activation_checkpointing, cfg.checkpoint_every)
    if compile:
        apply_compile(part)
    if not _sharded(mesh, layout, cfg):
        return part
    # Replication next to TP/PP goes through FSDP2 on a (replicate, shard=1) mesh. Under PP,
    # keep parameters gathered across the micro-batches of a step instead of re-gathering.
    reshard = cfg.fsdp.reshard_after_forward and layout.pp == 1
    return apply_fsdp(part, mesh, layout, reshard, param_dtype, expert_mesh)


def _sharded(mesh: DeviceMesh | None, layout: Layout, cfg: ParallelConfig) -> bool:
    """Whether the part goes through FSDP2 (HSDP, or replication beside TP/PP)."""
    return cfg.data_parallel != "dataparallel" and mesh is not None and layout.uses_fsdp


def float8_all_gather(
    float8: Float8Config | None, mesh: DeviceMesh | None, layout: Layout, cfg: ParallelConfig
) -> bool:
    """Whether FSDP2 all-gathers float8 weights (train.float8.fsdp_all_gather's)."""
    enabled = float8 is not None and float8.enabled
    return enabled and _sharded(mesh, layout, cfg) and float8.gathers_float8


def materialise(part: nn.Module, device: torch.device, seed: int, pretrained: str | None) -> int:
    """This rank's share of `part` on `device`, seeded or read from `pretrained` (a local HF
    directory); the checkpoint bytes it read."""
    part.to_empty(device=device)
    if pretrained is None:
        part.init_weights(seed)
        return 0
    return part.load_pretrained(pretrained)


def replicated(
    part: nn.Module,
    mesh: DeviceMesh | None,
    layout: Layout,
    cfg: ParallelConfig,
    device: torch.device,
) -> nn.Module:
    """The data-parallel wrappers whose constructors need real tensors: DataParallel, DDP."""
    if cfg.data_parallel == "dataparallel":
        return apply_dataparallel(part, cfg.dataparallel_devices)
    if mesh is None or layout.dp_size == 1 or layout.uses_fsdp:
        return part
    return apply_ddp(part, mesh, cfg.ddp, device)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Sync the gradients over the data-parallel replicas on the last micro-batch only.

    DDP skips its all-reduce (no_sync). FSDP2 still reduce-scatters every micro-batch over
    its shards (skipping that would accumulate unsharded gradients, a full-size copy per
    rank, which is the memory FSDP exists to save), but its all-reduce across replicas (HSDP,
    or replication beside TP/PP) waits for the last: the sharded sum it accumulates meanwhile
    is the size of the sharded gradient the layout holds anyway. A module without replicas
    has no all-reduce to skip."""
    if not enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    if not enabled and isinstance(model, FSDPModule):
        model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            model.set_requires_all_reduce(True)
        return
    yield
