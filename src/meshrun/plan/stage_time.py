"""One micro-batch's compute on a pipeline stage's device, by kind of work (the step's
compute parts), and what the speed model needs of a model under a layout (ModelCost).

    compute     by matmul shapes on a GPU profile (plan/compute.py); by FLOPs (PaLM's
                6N + 12*L*h*s a token, flops.py) over a rate elsewhere: a model without
                formulas, a CPU (0.7 of the matmul rate measured with the layout's ranks all
                computing, plan/probe.py), or `plan.efficiency` given (the MFU one expects)
    recompute   full checkpointing runs each block's forward again in backward (its TP
                collectives too); selective keeps every matmul and attention output and
                recomputes the elementwise work (by FLOPs, which do not see it, attention's
                FLOPs stand in: Korthikanti et al. 2022's selective recomputes that core);
                op the same and every other matmul (the 2nd, 4th, ... of a block)
    optimizer   AdamW's step, memory-bound (plan/compute.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshrun.core.calibration import Calibration
from meshrun.core.choices import HALF_PRECISIONS, SAC_POLICIES
from meshrun.core.config import DeviceSpec, ExperimentConfig, ParallelConfig
from meshrun.core.flops import flops_per_token, peak_tflops
from meshrun.core.layout import Layout
from meshrun.core.precision import matmul_precision
from meshrun.models import model_shape
from meshrun.models.loss import loss_method
from meshrun.plan.collectives import GB
from meshrun.plan.compute import (
    ATTENTION_BACKWARD,
    MEMORY_EFFICIENCY,
    DeviceRates,
    alternate_matmul_share,
    block_times,
    head_times,
    kernel_rates,
)
from meshrun.plan.float8 import Float8Plan, block_float8_elements
from meshrun.plan.shapes import (
    Dims,
    StageShare,
    checkpointed_layers,
    inactive_matmul_params,
    local_param_elements,
    rank_tokens,
    stage_shares,
)

# Where compute is costed by FLOPs: the MFU of well-tuned GPU runs; on CPU the share of the
# probe's matmul rate the model's own matmuls reach (single, DDP and pipeline runs of
# `small` on a 2-vCPU VM reached 0.6-0.8 of it, benchmarks/planner_accuracy.py).
DEFAULT_EFFICIENCY = {"cuda": 0.4, "cpu": 0.7}
FP32 = 4
# The routed rows an ep rank's experts get over an even share, at most: the capacity factor
# GShard and Switch Transformer train with (1.25, Fedus et al. 2022, JMLR, sec. 2.1) taken
# as the load a balanced router stays under; the step waits for the busiest rank.
EP_LOAD_ALLOWANCE = 1.25
COMPUTE_KINDS = ("matmul", "attention", "elementwise", "head", "overhead")


@dataclass(frozen=True)
class ModelCost:
    """What the speed model needs of a model under a layout: training FLOPs per token of
    the whole model, the parameter elements of the rank holding most (TP-sharded, before
    FSDP's shards: what DP moves) and of those the routed experts' (FSDP2 moves them over
    the expert mesh under ep) and the float8 linears' (FSDP2 may gather them in float8), and
    the width of the activations TP and PP move."""

    flops_per_token: float
    rank_elements: int
    width: int
    expert_elements: int = 0
    float8_elements: int = 0  # of rank_elements, train.float8's linears' (plan/float8.py)


def formula_cost(cfg: ExperimentConfig, layout: Layout) -> ModelCost:
    d = Dims.of(cfg.model)
    total = local_param_elements(d, StageShare(d.layers, True, True, 1), 1, 1)
    matmul = total if d.tied else total - d.vocab * d.h  # the embedding lookup is no matmul
    matmul -= inactive_matmul_params(d)  # a token's FLOPs: its experts', not every expert's
    per_token = flops_per_token(model_shape(cfg.model), matmul, cfg.train.seq_len)
    shares = stage_shares(cfg.model, cfg.parallel, layout)
    held = Dims.of_layout(cfg.model, layout)
    rank_elements = max(local_param_elements(held, s, layout.tp, 1) for s in shares)
    layers = max(s.layers for s in shares)
    float8 = layers * block_float8_elements(held, layout.tp) if cfg.train.float8.enabled else 0
    return ModelCost(per_token, rank_elements, d.h, layers * held.expert_elements(), float8)


@dataclass
class StageTime:
    """One micro-batch on a pipeline stage's slowest device: compute by kind, TP exposed, CP
    in all (`cp_total`) and exposed, EP's all-to-alls; `attention_f` and `attention_b` one
    layer's attention forward and backward."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    attention_f: float = 0.0
    attention_b: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    cp_total: float = 0.0
    ep: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.recompute


def device_peak(cfg: ExperimentConfig, spec: DeviceSpec | None) -> float | None:
    """Peak FLOP/s of a device at the rate the run's matmuls reach (TF32 for fp32 matmuls on
    CUDA where train.tf32 allows it, as the record's MFU counts)."""
    peak = None if spec is None else peak_tflops(spec, matmul_precision(cfg))
    return peak * 1e12 if peak else None


def attention_span(seq: int, cp: int, method: str) -> int:
    """The causal sequence whose measured kernel rate a rank's attention runs at: all of it
    without CP and under alltoall (one call over the whole sequence, heads split); seq/cp
    under ring and allgather, whose chunk pairs (c = seq/2cp, a kernel call each,
    rank/parallel/context_attention.py) are all but two non-causal, full c x c tiles as a
    causal attention over 2c fills them."""
    return seq if cp == 1 or method == "alltoall" else seq // cp


def device_rates(cfg: ExperimentConfig, spec: DeviceSpec, cp: int) -> DeviceRates | None:
    """The shape model's view of a device, where its datasheet gives one (a GPU profile);
    its attention kernel's measured rates for 16-bit runs (FlashAttention has no fp32), at
    the sequence a rank's attention spans."""
    peak = device_peak(cfg, spec)
    if not (peak and spec.memory_bw_gbs and spec.sms) or cfg.hardware.device_type != "cuda":
        return None
    memory = spec.memory_bw_gbs * GB * MEMORY_EFFICIENCY
    forward = backward = None
    if spec.attention.seq and cfg.train.precision in HALF_PRECISIONS:
        span = attention_span(cfg.train.seq_len, cp, cfg.parallel.cp_method)
        forward, backward = kernel_rates(spec.attention, span)
    fp8 = spec.peak_tflops.get("fp8") if cfg.train.float8.enabled else None
    return DeviceRates(
        peak * spec.matmul_efficiency,
        memory,
        spec.sms,
        float8_matmul=fp8 * 1e12 * spec.fp8_matmul_efficiency if fp8 else None,
        attention=forward,
        attention_backward=backward,
    )


def calibrated_rates(calibration: Calibration, spec: DeviceSpec | None = None) -> DeviceRates:
    """A calibrated host's rates, as measured (no datasheet efficiencies), per rank; a GPU
    (`spec`) keeps its SMs for NCCL's contention. Every device kind of a mixed box gets the
    slowest rank's: one calibration a host."""
    return DeviceRates(
        matmul=calibration.matmul_flops,
        memory=calibration.memory_bw,
        sms=(spec.sms or 0) if spec else 0,
        attention=calibration.attention_flops,
        layer_overhead=calibration.ops_per_layer * calibration.op_seconds,
        tp_overhead=calibration.tp_layer_overhead,
        sp_overhead=calibration.sp_layer_overhead,
        fsdp_overhead=calibration.fsdp_layer_overhead,
        checkpoint_overhead=calibration.checkpoint_layer_overhead,
        context_overhead=calibration.context_layer_overhead,
        waves=False,
        dispatch_ahead=calibration.device_type == "cuda",
    )


def stage_by_shapes(
    cfg: ExperimentConfig, layout: Layout, share: StageShare, micro: int, rates: DeviceRates
) -> StageTime:
    d = Dims.of_layout(cfg.model, layout, EP_LOAD_ALLOWANCE)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    p, seq = cfg.parallel, cfg.train.seq_len
    float8 = Float8Plan.of(cfg, layout)
    block = block_times(
        d, rates, micro, seq, layout.tp, p.sequence_parallel, width, layout.cp, float8
    )
    forward, backward = share.layers * block.forward, share.layers * block.backward
    if share.last:
        sharded = loss_method(cfg)[0] == "vocab_parallel"
        tokens = rank_tokens(cfg, layout, micro)
        head_f, head_b = head_times(d, rates, tokens, layout.tp, width, sharded)
        forward, backward = forward + head_f, backward + head_b
    checkpointed = checkpointed_layers(p, share)
    recompute = block.recompute(p.activation_checkpointing) * checkpointed
    parts = {kind: share.layers * seconds for kind, seconds in block.by_kind().items()}
    if share.last:
        parts["head"] = head_f + head_b
    overhead = share.layers * (
        rates.layer_overhead + _wrapper_overhead(layout, p, rates)
    ) + checkpointed * rates.checkpoint_overhead.get(p.activation_checkpointing, 0.0)
    if rates.dispatch_ahead:  # the host's dispatch hides behind the blocks' kernels
        kernels = share.layers * (block.forward + block.backward) + recompute
        overhead = max(0.0, overhead - kernels)
    if overhead:
        parts["overhead"] = overhead
    attention = (block.attention_f, block.attention_b)
    return StageTime(forward, backward + overhead, recompute, *attention, parts=parts)


def _wrapper_overhead(layout: Layout, p: ParallelConfig, rates: DeviceRates) -> float:
    """What a block's dispatch costs more under the layout's wrappers, as measured."""
    overhead = 0.0
    if layout.tp > 1:
        overhead += rates.sp_overhead if p.sequence_parallel else rates.tp_overhead
    if layout.uses_fsdp:
        overhead += rates.fsdp_overhead
    if layout.cp > 1:
        overhead += rates.context_overhead.get(p.cp_method, 0.0)
    return overhead


def stage_by_flops(
    cfg: ExperimentConfig,
    layout: Layout,
    share: StageShare,
    micro: int,
    cost: ModelCost,
    rate: float,
) -> StageTime:
    """Forward a third of a token's FLOPs, backward two; the head counts as half a layer."""
    shape = model_shape(cfg.model)
    layer_share = (share.layers + (0.5 if share.last else 0)) / (shape.n_layers + 0.5)
    tokens = rank_tokens(cfg, layout, micro)
    forward = cost.flops_per_token * tokens * layer_share / layout.tp / 3 / rate
    attention = 0.0  # 4*h*s a token; a module without formulas may not say its width
    if shape.dim:
        attention = 4 * shape.dim * cfg.train.seq_len * tokens / layout.tp / rate
    recompute = forward * recomputed_share(cfg, share)
    ckpt = cfg.parallel.activation_checkpointing
    if ckpt in SAC_POLICIES:  # FLOPs do not see the elementwise work: attention's stand in
        recompute = attention * checkpointed_layers(cfg.parallel, share)
    if ckpt == "op" and shape.dim and share.layers:
        layers = checkpointed_layers(cfg.parallel, share) / share.layers
        # a module without formulas (model=custom) does not say its matmuls' sizes: every
        # other one of them is half of them
        alternate = alternate_matmul_share(Dims.of(cfg.model)) if shape.n_heads else 0.5
        recompute += (forward - attention) * layers * alternate
    return StageTime(
        forward,
        2 * forward,
        recompute,
        attention,
        ATTENTION_BACKWARD * attention,
        parts={"matmul": 3 * forward},
    )


def recomputed_share(cfg: ExperimentConfig, share: StageShare) -> float:
    """The share of a stage's blocks whose forward full checkpointing runs again (its
    collectives too): all of them, or every n-th (parallel.checkpoint_every)."""
    if cfg.parallel.activation_checkpointing != "full" or not share.layers:
        return 0.0
    return checkpointed_layers(cfg.parallel, share) / share.layers
