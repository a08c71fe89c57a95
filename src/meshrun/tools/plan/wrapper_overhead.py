"""What a block's forward and backward cost the host beyond the plain block's under each
parallel wrapper: DTensor's dispatch under TP (sharding propagation, redistributions, the
functional collectives' wrapping and waits; more of them with sequence parallelism), FSDP2's
hooks around each unit; context parallelism's (each CP method: the function mode that
catches the block's attention, the ring's steps and merges); and under each activation
checkpointing policy: the forward's ops
dispatched again (full), selective checkpointing's policy called for every op of the forward
and the recompute besides (selective, op: here 2.8 ms a block against the block's own 0.7,
where the planner counted only the recomputed elementwise kernels). Measured on a mesh of
the calibration's ranks, all stepping at once, at a tiny size where the kernels cost next to
nothing, as the difference a layer makes (LAYERS[1] blocks less LAYERS[0]: the embedding
and head cancel), less the plain block's and less what the layer's collectives take alone
(block_collectives.py): those are the link's (plan/comm_time.py), FSDP2's copies of real
sizes the memory's (`fsdp_copies`), the recomputed kernels the compute's. A mesh of one rank
would miss most of it: DTensor issues no collective there (measured on this host, gloo,
2 ranks: TP 6.4 ms a block beyond its collectives against 3.1 ms on one rank, SP 10.8 against
4.0). Every model steps once a round, the ranks in lockstep, and each keeps its fastest step:
differences of a few milliseconds, which a busy host (other jobs) would swamp in a mean."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from meshrun.core.config import LlamaModelConfig
from meshrun.models import build_model, model_shape
from meshrun.rank.control_collectives import control_barrier
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing
from meshrun.rank.parallel.context import apply_context_parallel
from meshrun.rank.parallel.context_attention import METHODS
from meshrun.rank.parallel.tensor import apply_tp
from meshrun.tools.plan.block_collectives import CALLS, collective_calls, collectives_in
from meshrun.validate.context import unsplit_heads

WRAPPERS = ("tp", "sp", "fsdp")
CHECKPOINTING = ("full", "selective", "op")  # each alone on the plain block
CONTEXT = tuple(METHODS)  # CP's ways to share attention, over every rank
LAYERS = (1, 5)
SEQ = 16
WARMUP, ROUNDS = 2, 12
# An MoE block is measured with at most this many experts: the wrappers' cost rides on the
# block's modules, and a loop over 128 experts, 8 models x 14 rounds, would take minutes.
MAX_EXPERTS = 4


def wrapper_overheads(
    model_cfg: LlamaModelConfig, device: torch.device | None, rounds: int = ROUNDS
) -> dict[str, float]:
    """Seconds a layer's forward and backward cost the host under each of WRAPPERS,
    CHECKPOINTING and the CONTEXT methods the block allows, beyond the plain block and its
    collectives alone (0 where the difference is within noise below it). Every rank of the
    default process group calls it at once: the mesh (and the CP group) spans them."""
    model_cfg = _few_experts(model_cfg)
    device_type = device.type if device is not None else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    measured = (*WRAPPERS, *CHECKPOINTING, *_context_methods(model_cfg))
    steps = {
        (wrapper, layers): _stepper(model_cfg, layers, mesh, wrapper, device)
        for wrapper in (None, *measured)
        for layers in LAYERS
    }
    fastest = _fastest(steps, device, rounds)

    def per_layer(wrapper: str | None) -> float:
        fewer, more = (fastest[wrapper, layers] for layers in LAYERS)
        return (more - fewer) / (LAYERS[1] - LAYERS[0])

    plain = per_layer(None)
    overheads = {}
    for wrapper in measured:
        alone = _collectives_alone(steps, wrapper, device, rounds)
        overheads[wrapper] = max(0.0, per_layer(wrapper) - plain - alone)
    return overheads


def _collectives_alone(
    steps: dict, wrapper: str, device: torch.device | None, rounds: int
) -> float:
    """Seconds the collectives a layer adds under `wrapper` take alone, each the fastest."""
    fewer, more = (collectives_in(steps[wrapper, layers]) for layers in LAYERS)
    added = more - fewer
    fastest = _fastest(collective_calls(added, device), device, rounds)
    alone = sum(count * fastest[collective] / CALLS for collective, count in added.items())
    return alone / (LAYERS[1] - LAYERS[0])


def _fastest(steps: dict, device: torch.device | None, rounds: int) -> dict:
    """Each stepper's fastest step over `rounds` rounds, all of them stepping once a round,
    the ranks starting each step together."""
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    best = dict.fromkeys(steps, float("inf"))
    for round_ in range(WARMUP + rounds):
        for key, step in steps.items():
            control_barrier()
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
    """One forward and backward of a `layers`-block model under `wrapper` (or checkpointing
    policy, or CP method: each rank holds SEQ tokens of a sequence all of them share)."""
    world = dist.get_world_size()
    seq = SEQ * world if wrapper in CONTEXT else SEQ
    model = build_model(dataclasses.replace(model_cfg, n_layers=layers), seq, "meta")
    if wrapper in ("tp", "sp"):
        apply_tp(model, mesh, sequence_parallel=wrapper == "sp")
    elif wrapper == "fsdp":  # as rank/parallel/fsdp.apply_fsdp: each block a unit, then the root
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif wrapper in CHECKPOINTING:
        apply_activation_checkpointing(model, wrapper)
    elif wrapper in CONTEXT:
        group = dist.group.WORLD
        apply_context_parallel(model, group, wrapper, seq, dist.get_rank(), world)
    model.to_empty(device=device or "cpu")
    model.init_weights(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (1, SEQ), device=device)
    return lambda: model(tokens).float().sum().backward()


def _context_methods(model_cfg: LlamaModelConfig) -> tuple[str, ...]:
    """The CP methods the block takes over every rank: alltoall only where the ranks split
    its heads and K/V heads (the rule a run is refused by otherwise)."""
    splits = unsplit_heads(model_shape(model_cfg), 1, dist.get_world_size()) is None
    return tuple(m for m in CONTEXT if m != "alltoall" or splits)


def _few_experts(model_cfg: LlamaModelConfig) -> LlamaModelConfig:
    moe = model_cfg.moe
    if moe.experts <= MAX_EXPERTS:
        return model_cfg
    fewer = dataclasses.replace(moe, experts=MAX_EXPERTS, top_k=min(moe.top_k, 2))
    return dataclasses.replace(model_cfg, moe=fewer)
