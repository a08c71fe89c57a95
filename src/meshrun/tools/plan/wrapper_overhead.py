"""What a block's forward and backward cost the host beyond the plain block's under each
parallel wrapper: DTensor's dispatch under TP (sharding propagation, redistributions; more
of them with sequence parallelism), FSDP2's hooks around each unit. Measured on a mesh of
one rank at a tiny size, where the kernels cost next to nothing and no collective moves
data, as the difference a layer from the plain block (three blocks less one: the embedding
and head cancel), the median of a few steps. The collectives themselves are the link's
(plan/comm_time.py), FSDP2's copies of real sizes the memory's (`fsdp_copies`)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from meshrun.core.config import LlamaModelConfig
from meshrun.models import build_model
from meshrun.rank.parallel.tensor import apply_tp

WRAPPERS = ("tp", "sp", "fsdp")
LAYERS = (1, 3)
SEQ = 16
WARMUP, STEPS = 3, 15


def wrapper_overheads(model_cfg: LlamaModelConfig, device: torch.device | None) -> dict[str, float]:
    """Seconds a layer's forward and backward cost the host under each of WRAPPERS beyond
    the plain block (0 where the difference is within noise below it). Joins a process group
    of its own (one rank) for the mesh and leaves it."""
    device_type = device.type if device is not None else "cpu"
    if device is not None:
        torch.cuda.set_device(device)  # the mesh's device: this rank's, not the first GPU
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device_type, (1,))
        plain = _per_layer(model_cfg, mesh, None, device)
        return {w: max(0.0, _per_layer(model_cfg, mesh, w, device) - plain) for w in WRAPPERS}
    finally:
        dist.destroy_process_group()


def _per_layer(
    model_cfg: LlamaModelConfig, mesh: DeviceMesh, wrapper: str | None, device: torch.device | None
) -> float:
    fewer, more = (
        _step_seconds(dataclasses.replace(model_cfg, n_layers=n), mesh, wrapper, device)
        for n in LAYERS
    )
    return (more - fewer) / (LAYERS[1] - LAYERS[0])


def _step_seconds(
    model_cfg: LlamaModelConfig, mesh: DeviceMesh, wrapper: str | None, device: torch.device | None
) -> float:
    model = build_model(model_cfg, SEQ, "meta")
    if wrapper in ("tp", "sp"):
        apply_tp(model, mesh, sequence_parallel=wrapper == "sp")
    elif wrapper == "fsdp":  # as rank/parallel/fsdp.apply_fsdp: each block a unit, then the root
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device or "cpu")
    model.init_weights(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (1, SEQ), device=device)
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    seconds = []
    for step in range(WARMUP + STEPS):
        sync()
        started = time.perf_counter()
        model(tokens).float().sum().backward()
        sync()
        if step >= WARMUP:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)
