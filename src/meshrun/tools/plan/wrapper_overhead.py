"""What a block's forward and backward cost the host beyond the plain block's under each
parallel wrapper: DTensor's dispatch under TP (sharding propagation, redistributions; more
of them with sequence parallelism), FSDP2's hooks around each unit. Measured on a mesh of
one rank at a tiny size, where the kernels cost next to nothing and no collective moves
data, as the difference a layer from the plain block (LAYERS[1] blocks less LAYERS[0]: the
embedding and head cancel). Every model steps once a round, in turn, and each keeps its
fastest step: differences of a few milliseconds, which a busy host (the other ranks, other
jobs) would swamp in a mean. The collectives themselves are the link's (plan/comm_time.py),
FSDP2's copies of real sizes the memory's (`fsdp_copies`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from meshrun.core.config import LlamaModelConfig
from meshrun.models import build_model
from meshrun.rank.parallel.tensor import apply_tp

WRAPPERS = ("tp", "sp", "fsdp")
LAYERS = (1, 5)
SEQ = 16
WARMUP, ROUNDS = 2, 12
# An MoE block is measured with at most this many experts: the wrappers' cost rides on the
# block's modules, and a loop over 128 experts, 8 models x 14 rounds, would take minutes.
MAX_EXPERTS = 4


def wrapper_overheads(model_cfg: LlamaModelConfig, device: torch.device | None) -> dict[str, float]:
    """Seconds a layer's forward and backward cost the host under each of WRAPPERS beyond
    the plain block (0 where the difference is within noise below it). Joins a process group
    of its own (one rank) for the mesh and leaves it."""
    model_cfg = _few_experts(model_cfg)
    device_type = device.type if device is not None else "cpu"
    if device is not None:
        torch.cuda.set_device(device)  # the mesh's device: this rank's, not the first GPU
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device_type, (1,))
        steps = {
            (wrapper, layers): _stepper(model_cfg, layers, mesh, wrapper, device)
            for wrapper in (None, *WRAPPERS)
            for layers in LAYERS
        }
        fastest = _fastest(steps, device)
    finally:
        dist.destroy_process_group()

    def per_layer(wrapper: str | None) -> float:
        fewer, more = (fastest[wrapper, layers] for layers in LAYERS)
        return (more - fewer) / (LAYERS[1] - LAYERS[0])

    plain = per_layer(None)
    return {w: max(0.0, per_layer(w) - plain) for w in WRAPPERS}


def _fastest(steps: dict, device: torch.device | None) -> dict:
    """Each stepper's fastest step over ROUNDS rounds, all of them stepping once a round."""
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    best = dict.fromkeys(steps, float("inf"))
    for round_ in range(WARMUP + ROUNDS):
        for key, step in steps.items():
            sync()
            started = time.perf_counter()
            step()
            sync()
            if round_ >= WARMUP:
                best[key] = min(best[key], time.perf_counter() - started)
    return best


def _stepper(
    model_cfg: LlamaModelConfig,
    layers: int,
    mesh: DeviceMesh,
    wrapper: str | None,
    device: torch.device | None,
) -> Callable[[], None]:
    """One forward and backward of a `layers`-block model under `wrapper`."""
    model = build_model(dataclasses.replace(model_cfg, n_layers=layers), SEQ, "meta")
    if wrapper in ("tp", "sp"):
        apply_tp(model, mesh, sequence_parallel=wrapper == "sp")
    elif wrapper == "fsdp":  # as rank/parallel/fsdp.apply_fsdp: each block a unit, then the root
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device=device or "cpu")
    model.init_weights(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (1, SEQ), device=device)
    return lambda: model(tokens).float().sum().backward()


def _few_experts(model_cfg: LlamaModelConfig) -> LlamaModelConfig:
    moe = model_cfg.moe
    if moe.experts <= MAX_EXPERTS:
        return model_cfg
    fewer = dataclasses.replace(moe, experts=MAX_EXPERTS, top_k=min(moe.top_k, 2))
    return dataclasses.replace(model_cfg, moe=fewer)
