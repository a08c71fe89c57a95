"""Predicted step time: compute from FLOPs, communication from bytes moved per layout, and the
pipeline bubble stretching whatever the pipeline does.

    compute   FLOPs per token (PaLM: 6N + 12*L*h*s, +1/3 of the forward-heavy part again
              under full checkpointing) x the rank's tokens x its share of the layers,
              over the device's peak x `plan.efficiency` (the MFU one expects of a good run;
              by default 0.4 of a GPU's datasheet peak, and on CPU 0.7 of the matmul rate
              measured with the layout's ranks all computing, plan/probe.py)
    DP        DDP all-reduce of the gradients once a step, 2(n-1)/n x grad bytes, one
              collective per bucket; FSDP all-gather in forward and backward and
              reduce-scatter every micro-batch, 3(n-1)/n x (unsharded) param bytes, three
              collectives per block and root
    TP        4 all-reduces a layer (2 forward, 2 backward) of each micro-batch's T x h
              activations
    PP        each micro-batch's activations sent forward and their gradients back
    step      (compute + TP + PP) / (1 - bubble) + DP; no overlap assumed

A model without formulas (model=custom) is costed the same way from what is counted instead
(ModelCost: torch's FLOP count, the parameters of each rank's traced module, the width of its
embedding; plan/traced.py).

A collective costs the hardware profile's `collective_latency_us` plus its bytes over the
link bandwidth (GB/s): intra-node unless the world spans nodes. On a CPU host the peak is
measured (plan/probe.py), since none is published.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshrun.core.choices import HALF_PRECISIONS
from meshrun.core.config import ExperimentConfig
from meshrun.core.hardware import device_for_rank
from meshrun.core.layout import Layout, n_microbatches, theoretical_bubble
from meshrun.plan.shapes import (
    Dims,
    StageShare,
    local_param_elements,
    micro_batching,
    stage_shares,
)
from meshrun.rank.metrics.flops import flops_per_token
from meshrun.rank.models import model_shape

GB = 1e9
# GPUs: the MFU of well-tuned large-model runs. CPU: of the probe's matmul rate, which the
# model's own matmuls come close to (single, DDP and pipeline runs of `small` on a 2-vCPU VM
# reached 0.6-0.8 of it, benchmarks/planner_accuracy.py).
DEFAULT_EFFICIENCY = {"cuda": 0.4, "cpu": 0.7}


@dataclass(frozen=True)
class ModelCost:
    """What the speed model needs of a model under a layout: training FLOPs per token of
    the whole model, the parameter elements of the rank holding most (TP-sharded, before
    FSDP's shards: what DP moves), and the width of the activations TP and PP move."""

    flops_per_token: float
    rank_elements: int
    width: int


def formula_cost(cfg: ExperimentConfig, layout: Layout) -> ModelCost:
    d = Dims.of(cfg.model)
    total = local_param_elements(d, StageShare(d.layers, True, True, 1), 1, 1)
    matmul = total if d.tied else total - d.vocab * d.h  # the embedding lookup is no matmul
    per_token = flops_per_token(model_shape(cfg.model), matmul, cfg.train.seq_len)
    shares = stage_shares(cfg.model, cfg.parallel, layout)
    return ModelCost(per_token, max(local_param_elements(d, s, layout.tp, 1) for s in shares),
                     d.h)  # fmt: skip


@dataclass(frozen=True)
class SpeedPrediction:
    compute_s: float
    comm_s: float
    bubble: float
    step_time_s: float
    tokens_per_s: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def device_flops(cfg: ExperimentConfig, rank: int) -> float | None:
    """Peak FLOP/s of the device `rank` runs on, for the run's precision."""
    precision = "tf32" if cfg.train.precision == "fp32" and cfg.hardware.device_type == "cuda" \
        else cfg.train.precision  # fmt: skip
    spec = device_for_rank(cfg.hardware.devices, rank % max(1, _devices_per_node(cfg)))
    if spec is None:
        return None
    peak = spec.peak_tflops.get(precision) or spec.peak_tflops.get(cfg.train.precision)
    return peak * 1e12 if peak else None


def _devices_per_node(cfg: ExperimentConfig) -> int:
    return cfg.launcher.nproc_per_node or sum(d.count for d in cfg.hardware.devices)


def predict_speed(cfg: ExperimentConfig, host_flops: float | None = None,
                  cost: ModelCost | None = None) -> SpeedPrediction | None:  # fmt: skip
    """None when a device's peak is unknown (and no host measurement stands in for it).
    `cost`: what was counted of a model without formulas (formula_cost's otherwise)."""
    efficiency = cfg.plan.efficiency or DEFAULT_EFFICIENCY[cfg.hardware.device_type]
    layout = Layout.of(cfg.parallel)
    t = cfg.train
    cost = cost or formula_cost(cfg, layout)
    n_layers = model_shape(cfg.model).n_layers
    per_token = cost.flops_per_token
    if cfg.parallel.activation_checkpointing == "full":
        per_token *= 4 / 3
    tokens_dp_rank = t.global_batch_size * t.seq_len / layout.dp_size
    shares = stage_shares(cfg.model, cfg.parallel, layout)
    width = 2 if t.precision in HALF_PRECISIONS else 4
    bw = (cfg.hardware.inter_node_bw_gbs if cfg.launcher.nnodes > 1 else None) or \
        cfg.hardware.intra_node_bw_gbs or 1.0  # fmt: skip
    latency = cfg.hardware.collective_latency_us * 1e-6
    passes, _ = micro_batching(cfg, layout)
    compute = 0.0
    for rank in range(layout.world_size):
        peak = host_flops if cfg.hardware.device_type == "cpu" else device_flops(cfg, rank)
        if not peak:
            return None
        share = shares[rank // (layout.world_size // layout.pp)]
        layer_share = (share.layers + (0.5 if share.last else 0)) / (n_layers + 0.5)
        flops = per_token * tokens_dp_rank * layer_share / layout.tp
        compute = max(compute, flops / (peak * efficiency))
    elements = cost.rank_elements
    layers = max(s.layers for s in shares)
    dp_bytes = dp_count = 0.0
    if layout.uses_fsdp:
        dp_bytes = 3 * _ring(layout.dp_size) * elements * width * passes
        dp_count = 3 * (layers + 1) * passes
    elif layout.dp_replicate > 1:
        dp_bytes = 2 * _ring(layout.dp_replicate) * elements * 4
        dp_count = math.ceil(elements * 4 / (cfg.parallel.ddp.bucket_cap_mb * 2**20))
    activation_bytes = tokens_dp_rank * cost.width * width
    tp_bytes = 4 * 2 * _ring(layout.tp) * activation_bytes * layers
    tp_count = 4 * layers * passes if layout.tp > 1 else 0
    pp_bytes = 2 * activation_bytes / layout.tp if layout.pp > 1 else 0.0
    pp_count = 2 * passes if layout.pp > 1 else 0
    bubble = 0.0
    if layout.pp > 1:
        p = cfg.parallel
        bubble = theoretical_bubble(layout.pp, n_microbatches(cfg), p.stages_per_rank)
    pipeline_comm = (tp_bytes + pp_bytes) / (bw * GB) + (tp_count + pp_count) * latency
    dp_comm = dp_bytes / (bw * GB) + dp_count * latency
    step = (compute + pipeline_comm) / (1 - bubble) + dp_comm
    comm = pipeline_comm + dp_comm
    return SpeedPrediction(compute, comm, bubble, step, t.global_batch_size * t.seq_len / step)
