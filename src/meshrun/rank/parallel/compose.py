"""parallelize(): the model on meta into one rank's parallel form, in torchtitan's order.

On the meta device, the pipeline cut, context parallel, float8 linears (train.float8),
tensor parallel, expert parallel, activation checkpointing, torch.compile per block and
FSDP2 (HSDP; its state in host memory under parallel.fsdp.offload), then the blocks' saved
activations sent to the host (parallel.activation_offload); then each rank materialises
what it holds, seeded or read from a checkpoint (no rank ever holds the whole model); then
the wrappers that need real tensors (DDP, DataParallel); then the pipeline schedule. Each
step is one dimension's apply_* function.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.core.config import Float8Config, ParallelConfig
from meshrun.core.layout import Layout
from meshrun.core.stages import local_stage_ids, stage_layer_counts
from meshrun.rank.mesh import build_expert_mesh
from meshrun.rank.parallel.activation_offload import apply_activation_offload
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing
from meshrun.rank.parallel.compile import apply_compile
from meshrun.rank.parallel.context import apply_context_parallel
from meshrun.rank.parallel.dataparallel import apply_dataparallel
from meshrun.rank.parallel.ddp import apply_ddp
from meshrun.rank.parallel.expert import apply_expert_parallel
from meshrun.rank.parallel.fsdp import apply_fsdp
from meshrun.rank.parallel.loss import apply_chunked_loss
from meshrun.rank.parallel.parallel_model import ParallelModel
from meshrun.rank.parallel.pipeline import ScaledLoss, build_schedule, cut_stage
from meshrun.rank.parallel.tensor import resolve_tp_plan
from meshrun.rank.parallel.tied import tied_weights


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
    loss: str = "full",
    loss_kernel: str = "torch",
) -> ParallelModel:
    """`model` is the full model on the meta device (meshrun.models); returns this rank's
    materialised share, its weights seeded or read from `pretrained` (a local HF directory).
    `n_microbatches`: a pipeline's per step (core.batch.n_microbatches); `compile`: each
    block through torch.compile (train.compile); `seq_len`: the sequence CP splits;
    `float8`: train.float8; `loss`: the loss it trains with (models/loss.loss_method), a
    chunked one computed by `loss_kernel` (models/loss.loss_kernel)."""
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
        part = sharded_part(
            cut, mesh, layout, cfg, param_dtype, compile, expert_mesh, float8, loss, loss_kernel
        )
        if cfg.activation_offload == "cpu":
            apply_activation_offload(part, device)
        read += materialise(part, device, seed, pretrained, _offloaded(mesh, layout, cfg))
        wrapped.append(replicated(part, mesh, layout, cfg, device))
    schedule = new_schedule = tied = None
    scaled = ScaledLoss(loss)
    if layout.pp > 1:
        new_schedule = functools.partial(
            build_schedule, wrapped, stage_ids, n_stages, mesh["pp"], cfg, n_microbatches, device
        )
        schedule = new_schedule(loss_fn=scaled)
        tied = tied_weights(wrapped, mesh)
    parallel = ParallelModel(
        wrapped,
        schedule,
        0 in stage_ids,
        n_stages - 1 in stage_ids,
        read,
        new_schedule,
        scaled,
        tied,
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
    loss: str = "full",
    loss_kernel: str = "torch",
) -> nn.Module:
    """On meta: float8 linears (`float8`: train.float8), the head computing the loss
    (`loss` chunked), tensor-parallel (the head's logits left sharded: `loss`
    vocab_parallel), expert-parallel (over `expert_mesh`, rank/mesh.py), checkpointed,
    compiled (`compile`) and FSDP2-sharded, every parameter already the DTensor it trains
    as, so that materialising fills only this rank's share."""
    if float8 is not None and float8.enabled:
        from meshrun.rank.parallel.float8 import convert  # noqa: PLC0415 (meshrun[float8])

        convert(part, float8, _sharded(mesh, layout, cfg))
    if loss == "chunked":
        apply_chunked_loss(part, loss_kernel)
    if layout.tp > 1:
        vocab = {"vocab_parallel": True} if loss == "vocab_parallel" else {}  # meshrun's plans
        resolve_tp_plan(cfg.tp_plan)(part, mesh["tp"], cfg.sequence_parallel, **vocab)
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
    offload = _offloaded(mesh, layout, cfg)
    return apply_fsdp(part, mesh, layout, reshard, param_dtype, expert_mesh, offload)


def _sharded(mesh: DeviceMesh | None, layout: Layout, cfg: ParallelConfig) -> bool:
    """Whether the part goes through FSDP2 (HSDP, or replication beside TP/PP)."""
    return cfg.data_parallel != "dataparallel" and mesh is not None and layout.uses_fsdp


def _offloaded(mesh: DeviceMesh | None, layout: Layout, cfg: ParallelConfig) -> bool:
    """Whether FSDP2 keeps the part's parameters in host memory (parallel.fsdp.offload)."""
    return cfg.fsdp.offload == "cpu" and _sharded(mesh, layout, cfg)


def float8_all_gather(
    float8: Float8Config | None, mesh: DeviceMesh | None, layout: Layout, cfg: ParallelConfig
) -> bool:
    """Whether FSDP2 all-gathers float8 weights (train.float8.fsdp_all_gather's)."""
    enabled = float8 is not None and float8.enabled
    return enabled and _sharded(mesh, layout, cfg) and float8.gathers_float8


def materialise(
    part: nn.Module,
    device: torch.device,
    seed: int,
    pretrained: str | None,
    params_on_host: bool = False,
) -> int:
    """This rank's share of `part` on `device`, seeded or read from `pretrained` (a local HF
    directory); the checkpoint bytes it read. `params_on_host` (parallel.fsdp.offload=cpu):
    the parameters in host memory, where FSDP2's offload keeps them, the buffers on
    `device` (torchtitan's init_device and buffer_device)."""
    part.to_empty(device="cpu" if params_on_host else device)
    read = 0
    if pretrained is None:
        part.init_weights(seed)
    else:
        read = part.load_pretrained(pretrained)
    if params_on_host:
        for module in part.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
    return read


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
    if mesh is None or not layout.uses_ddp:
        return part
    return apply_ddp(part, mesh, cfg.ddp, device)
