"""Predicted step time of a layout: each pipeline stage's compute and exposed communication
for one micro-batch, the pipeline's schedule around them, the data-parallel sync where the
implementations overlap it with compute, and the optimizer step. O(pipeline stages x device
kinds): nothing loops over ranks, so 8,192-rank plans cost what 8-rank ones do.

    compute     by matmul shapes on a GPU profile (plan/compute.py); by FLOPs (PaLM's
                6N + 12*L*h*s a token, flops.py) over a rate elsewhere: a model without
                formulas, a CPU (0.7 of the matmul rate measured with the layout's ranks all
                computing, plan/probe.py), or `plan.efficiency` given (the MFU one expects)
    recompute   full checkpointing runs each block's forward again in backward (its TP
                collectives too); selective keeps every matmul and attention output and
                recomputes the elementwise work (by FLOPs, which do not see it, attention's
                FLOPs stand in: Korthikanti et al. 2022's selective recomputes that core);
                op the same and every other matmul (the 2nd, 4th, ... of a block)
    TP          Megatron's f/g operators on the block (Shoeybi et al. 2019): 2 all-reduces
                of the T x h activations forward, 2 backward; with sequence parallelism an
                all-gather and a reduce-scatter for each (the same bytes, twice the
                collectives); the embedding's all-reduce, the head's input all-reduce in
                backward and its logits all-gathered (rank/parallel/tensor.py); under
                etp the experts' partial outputs all-reduced forward, their input's
                gradient backward (k x h a token). On the critical path: DTensor TP does
                not overlap them (collectives.py)
    CPU host    every core computes for a rank (ranks x threads = cores), and gloo's copies
                and reductions run on those cores: its DP and CP traffic hides behind no
                compute (exposed in full)
    CP          each rank computes its seq/cp tokens (plan/compute.py), and per layer shares
                attention's K/V (rank/parallel/context_attention.py): ring passes its K/V
                block cp-1 times forward, each send posted before the block that computes
                beside it (hidden behind attention but for what exceeds it), and K/V with
                their gradients backward; allgather gathers K/V forward and reduce-scatters
                their gradients backward; alltoall (Ulysses) moves q, k, v and the output
                by all-to-all each way (costed as an all-gather of those bytes). allgather's
                and alltoall's collectives wait for the compute and it for them: exposed.
                Full checkpointing runs the forward's traffic again.
    EP          each MoE layer sends every token's k copies to its experts' ranks and the
                outputs back (models/moe.py's dispatch): two all-to-alls forward, two
                backward (again forward under full checkpointing), of the busiest rank's
                rows (Dims.routed: k x the load allowance), costed as nccl-tests costs an
                all-to-all (busbw = algbw x (n-1)/n, as an all-gather) on the links the ep
                group crosses (ep peers are tp apart). Compute waits for them: exposed.
                The busiest rank's experts compute its allowance of rows too.
    PP          a micro-batch's fp32 residual stream (T x h, / tp under SP) received forward
                and its gradient backward, v times with v stages a rank: torch's schedules
                post each receive just before the compute that needs it, so transfers are
                exposed; the step is m micro-batches stretched by the bubble (p-1)/(v*m+p-1)
                (GPipe, 1F1B; interleaved with v; Narayanan et al. 2021, SC21)
    DP          DDP: fp32 gradients all-reduced once a step in `bucket_cap_mb` buckets as
                backward produces them, only what outlasts the last micro-batch's backward
                exposed (+ the last bucket); FSDP2: each block's parameters all-gathered in
                forward (prefetched one block ahead, overlapped) and again in backward, fp32
                gradients reduce-scattered (all-reduced across HSDP replicas) as each
                block's backward ends, every micro-batch but the all-reduce, which waits
                for the last (rank/parallel's gradient_sync; under ep, a rank's experts over
                the expert_shard group, what ep leaves of dp_shard x cp); under a pipeline
                once a step (parameters stay gathered across micro-batches; the gradients'
                sync comes after the last backward, whole: torch's REDUCE_GRAD action)
    FSDP copies FSDP2 copies on the compute stream, which waits for them: each all-gather's
                output split into the unsharded parameters (read and write, the parameter
                dtype: split_with_sizes_copy in foreach_all_gather_copy_out), each
                reduce-scatter's input packed from the unsharded gradients cast to fp32
                (chunk_cat in foreach_reduce_scatter_copy_in; torch/distributed/fsdp/
                _fully_shard/_fsdp_collectives.py), memory-bound; as often as the gathers
                and reduce-scatters run (every micro-batch, once a step under PP)
    contention  a collective hidden behind compute still costs it SMs: NCCL runs each
                channel as one thread block on an SM of its own, and an inter-node ring
                opens about two channels a NIC (16 on an 8-NIC node), so compute that
                overlaps it runs on SMs - 16 (~15% slower on an A100's 108 SMs); the hidden
                seconds x 16 / SMs are added (NCCL's channel model, src/graph/connect.cc;
                the SM cost of overlap is why Megatron's TP overlap and NCCL's
                user-buffer registration exist)
    optimizer   AdamW's step, memory-bound (plan/compute.py)

Collective costs: plan/collectives.py (bandwidth, latency, which links a group crosses).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from meshrun.core.batch import n_microbatches
from meshrun.core.calibration import Calibration
from meshrun.core.choices import HALF_PRECISIONS, SAC_POLICIES
from meshrun.core.config import DeviceSpec, ExperimentConfig
from meshrun.core.flops import flops_per_token
from meshrun.core.layout import Layout
from meshrun.core.stages import theoretical_bubble
from meshrun.models import model_shape
from meshrun.plan.collectives import GB, Fabric, overlapped
from meshrun.plan.compute import (
    ATTENTION_BACKWARD,
    MEMORY_EFFICIENCY,
    DeviceRates,
    alternate_matmul_share,
    block_times,
    head_times,
    kernel_rates,
    optimizer_time,
)
from meshrun.plan.placement import expert_spans, group_span, stage_devices
from meshrun.plan.shapes import (
    Dims,
    StageShare,
    checkpointed_layers,
    inactive_matmul_params,
    local_param_elements,
    micro_batching,
    rank_tokens,
    stage_shares,
)

# Where compute is costed by FLOPs: the MFU of well-tuned GPU runs; on CPU the share of the
# probe's matmul rate the model's own matmuls reach (single, DDP and pipeline runs of
# `small` on a 2-vCPU VM reached 0.6-0.8 of it, benchmarks/planner_accuracy.py).
DEFAULT_EFFICIENCY = {"cuda": 0.4, "cpu": 0.7}
FP32 = 4
NCCL_CHANNELS = 16  # SMs a busy NCCL collective occupies beside compute (contention above)
# The routed rows an ep rank's experts get over an even share, at most: the capacity factor
# GShard and Switch Transformer train with (1.25, Fedus et al. 2022, JMLR, sec. 2.1) taken
# as the load a balanced router stays under; the step waits for the busiest rank.
EP_LOAD_ALLOWANCE = 1.25


@dataclass(frozen=True)
class ModelCost:
    """What the speed model needs of a model under a layout: training FLOPs per token of
    the whole model, the parameter elements of the rank holding most (TP-sharded, before
    FSDP's shards: what DP moves) and of those the routed experts' (FSDP2 moves them over
    the expert mesh under ep), and the width of the activations TP and PP move."""

    flops_per_token: float
    rank_elements: int
    width: int
    expert_elements: int = 0


def formula_cost(cfg: ExperimentConfig, layout: Layout) -> ModelCost:
    d = Dims.of(cfg.model)
    total = local_param_elements(d, StageShare(d.layers, True, True, 1), 1, 1)
    matmul = total if d.tied else total - d.vocab * d.h  # the embedding lookup is no matmul
    matmul -= inactive_matmul_params(d)  # a token's FLOPs: its experts', not every expert's
    per_token = flops_per_token(model_shape(cfg.model), matmul, cfg.train.seq_len)
    shares = stage_shares(cfg.model, cfg.parallel, layout)
    held = Dims.of_layout(cfg.model, layout)
    rank_elements = max(local_param_elements(held, s, layout.tp, 1) for s in shares)
    experts = max(s.layers for s in shares) * held.expert_elements()
    return ModelCost(per_token, rank_elements, d.h, experts)


@dataclass(frozen=True)
class SpeedPrediction:
    """Seconds a step: `compute_s` on the slowest stage (recomputation and the optimizer
    included), `comm_s` all its collectives and transfers take, `exposed_comm_s` what of
    them compute does not hide; `bubble` the pipeline's idle fraction; `breakdown` seconds by
    kind; `model_tflops_per_device` the model FLOPs (PaLM's, no recomputation) a device
    achieves, which over its peak is the MFU."""

    compute_s: float
    comm_s: float
    bubble: float
    step_time_s: float
    tokens_per_s: float
    exposed_comm_s: float = 0.0
    model_tflops_per_device: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)

    def step_parts(self) -> dict[str, float]:
        """The step's seconds by what the slowest stage's clock waits for, which add up to
        `step_time_s`: compute by kind, recompute, the exposed share of each parallelism's
        communication, the bubble, the optimizer."""
        b = self.breakdown
        parts = {kind: b[kind] for kind in COMPUTE_KINDS if kind in b}
        parts |= {"recompute": b["recompute"], "tp": b["tp"], "cp": b["cp_exposed"]}
        parts |= {"ep": b["ep"], "pp": b["pp"], "dp": b["dp_exposed"]}
        parts |= {"contention": b["contention"], "bubble": b["bubble"]}
        return parts | {"optimizer": b["optimizer"], "fsdp_copies": b["fsdp_copies"]}

    def as_dict(self) -> dict:
        return {**asdict(self), "step_parts": self.step_parts()}


def _peak(cfg: ExperimentConfig, spec: DeviceSpec | None) -> float | None:
    """Peak FLOP/s of a device for the run's precision (TF32 for fp32 matmuls on CUDA)."""
    if spec is None:
        return None
    precision = cfg.train.precision
    if precision == "fp32" and cfg.hardware.device_type == "cuda":
        precision = "tf32"
    peak = spec.peak_tflops.get(precision) or spec.peak_tflops.get(cfg.train.precision)
    return peak * 1e12 if peak else None


COMPUTE_KINDS = ("matmul", "attention", "elementwise", "head", "overhead")
STEP_PARTS = ("optimizer", "fsdp_copies")  # a stage's parts once a step, not a micro-batch


@dataclass
class _Stage:
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


def _rates(cfg: ExperimentConfig, spec: DeviceSpec, cp: int) -> DeviceRates | None:
    """The shape model's view of a device, where its datasheet gives one (a GPU profile);
    its attention kernel's measured rates for 16-bit runs (FlashAttention has no fp32), at
    the sequence a rank's attention spans."""
    peak = _peak(cfg, spec)
    if not (peak and spec.memory_bw_gbs and spec.sms) or cfg.hardware.device_type != "cuda":
        return None
    memory = spec.memory_bw_gbs * GB * MEMORY_EFFICIENCY
    forward = backward = None
    if spec.attention.seq and cfg.train.precision in HALF_PRECISIONS:
        forward, backward = kernel_rates(spec.attention, cfg.train.seq_len // cp)
    return DeviceRates(peak * spec.matmul_efficiency, memory, spec.sms, forward, backward)


def _by_shapes(
    cfg: ExperimentConfig, layout: Layout, share: StageShare, micro: int, rates: DeviceRates
) -> _Stage:
    d = Dims.of_layout(cfg.model, layout, EP_LOAD_ALLOWANCE)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    p, seq = cfg.parallel, cfg.train.seq_len
    block = block_times(d, rates, micro, seq, layout.tp, p.sequence_parallel, width, layout.cp)
    forward, backward = share.layers * block.forward, share.layers * block.backward
    if share.last:
        head_f, head_b = head_times(d, rates, rank_tokens(cfg, layout, micro), layout.tp, width)
        forward, backward = forward + head_f, backward + head_b
    recompute = block.recompute(p.activation_checkpointing) * checkpointed_layers(p, share)
    parts = {kind: share.layers * seconds for kind, seconds in block.by_kind().items()}
    if share.last:
        parts["head"] = head_f + head_b
    overhead = share.layers * rates.layer_overhead
    if overhead:
        parts["overhead"] = overhead
    attention = (block.attention_f, block.attention_b)
    return _Stage(forward, backward + overhead, recompute, *attention, parts=parts)


def _by_flops(
    cfg: ExperimentConfig,
    layout: Layout,
    share: StageShare,
    micro: int,
    cost: ModelCost,
    rate: float,
) -> _Stage:
    """Forward a third of a token's FLOPs, backward two; the head counts as half a layer."""
    shape = model_shape(cfg.model)
    layer_share = (share.layers + (0.5 if share.last else 0)) / (shape.n_layers + 0.5)
    tokens = rank_tokens(cfg, layout, micro)
    forward = cost.flops_per_token * tokens * layer_share / layout.tp / 3 / rate
    attention = 0.0  # 4*h*s a token; a module without formulas may not say its width
    if shape.dim:
        attention = 4 * shape.dim * cfg.train.seq_len * tokens / layout.tp / rate
    recompute = forward * _recomputed_share(cfg, share)
    ckpt = cfg.parallel.activation_checkpointing
    if ckpt in SAC_POLICIES:  # FLOPs do not see the elementwise work: attention's stand in
        recompute = attention * checkpointed_layers(cfg.parallel, share)
    if ckpt == "op" and shape.dim and share.layers:
        layers = checkpointed_layers(cfg.parallel, share) / share.layers
        recompute += (forward - attention) * layers * alternate_matmul_share(Dims.of(cfg.model))
    return _Stage(
        forward,
        2 * forward,
        recompute,
        attention,
        ATTENTION_BACKWARD * attention,
        parts={"matmul": 3 * forward},
    )


def _tp_comm(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    share: StageShare,
    micro: int,
    cost: ModelCost,
) -> float:
    """Seconds of one micro-batch's TP collectives on a stage (recomputed ones included)."""
    if layout.tp == 1:
        return 0.0
    span = group_span(layout, "tp", fabric.devices_per_node)
    half = cfg.train.precision in HALF_PRECISIONS
    tokens = rank_tokens(cfg, layout, micro)
    activation = tokens * cost.width * (2 if half else FP32)
    if cfg.parallel.sequence_parallel:  # an all-gather and a reduce-scatter for each
        one = 2 * fabric.all_gather(span, activation)
    else:
        one = fabric.all_reduce(span, activation)
    forward_ops = 2 + 2 * _recomputed_share(cfg, share)
    if cfg.parallel.activation_checkpointing in SAC_POLICIES and share.layers:
        # SAC's recompute stops after the last tensor backward needs (the down projection's
        # input): the attention's all-reduce again, or with SP its input's all-gather, its
        # reduce-scatter and the MLP input's all-gather (3 of the forward's 4)
        again = 1.5 if cfg.parallel.sequence_parallel else 1.0
        forward_ops += again * checkpointed_layers(cfg.parallel, share) / share.layers
    seconds = share.layers * (forward_ops + 2) * one
    if layout.etp > 1:  # the experts' partial outputs all-reduced, their input's gradient too
        d = Dims.of_layout(cfg.model, layout, EP_LOAD_ALLOWANCE)
        routed = fabric.all_reduce(span, tokens * d.routed * d.h * (2 if half else FP32))
        seconds += share.layers * (forward_ops / 2 + 1) * routed
    residual = tokens * cost.width * FP32
    if share.first:  # the vocabulary-parallel embedding's output
        seconds += fabric.all_reduce(span, residual)
    if share.last:  # the head's input gradient, and its logits gathered
        vocab = model_shape(cfg.model).vocab_size
        seconds += fabric.all_reduce(span, activation)
        seconds += fabric.all_gather(span, tokens * vocab * (2 if half else FP32))
    return seconds


def _cp_comm(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    share: StageShare,
    micro: int,
    stage: _Stage,
    cost: ModelCost,
) -> tuple[float, float]:
    """(seconds of one micro-batch's CP traffic on a stage, what of it compute leaves
    exposed): per layer, the method's forward and backward (and the forward's again where
    full checkpointing recomputes it)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    h, hk = _attention_widths(cfg, cost)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    tokens = rank_tokens(cfg, layout, micro)
    kv = 2 * tokens * hk // layout.tp * width  # this rank's K and V of one layer
    span = group_span(layout, "cp", fabric.devices_per_node)
    method = cfg.parallel.cp_method
    forwards = 1 + _recomputed_share(cfg, share)
    if method == "ring":
        # cp blocks of attention a layer, the next block's transfer beside each but the last
        step, block = fabric.send(span.crosses_nodes, kv), stage.attention_f / cp
        exposed = forwards * (cp - 1) * max(0.0, step - block)
        exposed += (cp - 1) * max(0.0, 2 * step - stage.attention_b / cp)
        total = (forwards + 2) * (cp - 1) * step  # backward: K/V and their gradients
    else:
        if method == "allgather":
            one = fabric.all_gather(span, cp * kv)
        else:  # alltoall: q, k, v in and the output back, each way
            one = fabric.all_gather(span, 2 * tokens * (h + hk) // layout.tp * width)
        total = exposed = (forwards + 1) * one
    return share.layers * total, share.layers * exposed


def _ep_comm(
    cfg: ExperimentConfig, layout: Layout, fabric: Fabric, share: StageShare, micro: int
) -> float:
    """Seconds of one micro-batch's expert all-to-alls on a stage (module docstring)."""
    if layout.ep == 1:
        return 0.0
    d = Dims.of_layout(cfg.model, layout, EP_LOAD_ALLOWANCE)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    rows = rank_tokens(cfg, layout, micro) * d.routed * d.h * width
    span, _ = expert_spans(layout, fabric.devices_per_node)
    forwards = 1 + _recomputed_share(cfg, share)
    return share.layers * 2 * (forwards + 1) * fabric.all_gather(span, rows)


def _recomputed_share(cfg: ExperimentConfig, share: StageShare) -> float:
    """The share of a stage's blocks whose forward full checkpointing runs again (its
    collectives too): all of them, or every n-th (parallel.checkpoint_every)."""
    if cfg.parallel.activation_checkpointing != "full" or not share.layers:
        return 0.0
    return checkpointed_layers(cfg.parallel, share) / share.layers


def _attention_widths(cfg: ExperimentConfig, cost: ModelCost) -> tuple[int, int]:
    """(query, K/V) width of a layer: the formulas' where the model has them; a model
    without (model=custom) taken as multi-head, its K/V as wide as the activations it moves
    (GQA's fewer K/V heads would move less: an upper bound)."""
    shape = model_shape(cfg.model)
    if not (shape.dim and shape.n_heads):
        return cost.width, cost.width
    d = Dims.of(cfg.model)
    return d.hq, d.hk


def _pp_comm(
    cfg: ExperimentConfig, layout: Layout, fabric: Fabric, micro: int, cost: ModelCost
) -> float:
    """Seconds of one micro-batch's stage-to-stage transfers on a rank (receive forward,
    send backward: 2 a stage it holds)."""
    if layout.pp == 1:
        return 0.0
    nbytes = rank_tokens(cfg, layout, micro) * cost.width * FP32
    if cfg.parallel.sequence_parallel:
        nbytes /= layout.tp
    crosses = group_span(layout, "pp", fabric.devices_per_node).crosses_nodes
    return 2 * cfg.parallel.stages_per_rank * fabric.send(crosses, nbytes)


def _dp_comm(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    cost: ModelCost,
    stage: _Stage,
    m: int,
    n_units: int,
) -> tuple[float, float]:
    """(seconds of a step's data-parallel collectives, what of them compute leaves exposed)."""
    p = cfg.parallel
    elements = cost.rank_elements
    per_node = fabric.devices_per_node
    if not layout.uses_fsdp:
        if layout.dp_replicate == 1:
            return 0.0, 0.0
        grads = elements * FP32
        span = group_span(layout, "dp_replicate", per_node)
        buckets = max(1, math.ceil(grads / (p.ddp.bucket_cap_mb * 2**20)))
        total = fabric.all_reduce(span, grads)
        return total, overlapped(total, stage.backward + stage.recompute, buckets)
    param_width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    replicate = group_span(layout, "dp_replicate", per_node)
    dense = elements - cost.expert_elements if layout.ep > 1 else elements
    groups = [(group_span(layout, "dp_shard", per_node), dense)]
    if layout.ep > 1:
        groups.append((expert_spans(layout, per_node)[1], cost.expert_elements))
    gather = reduce = 0.0
    for shard, held in groups:
        gather += fabric.all_gather(shard, held * param_width)
        reduce += fabric.all_gather(shard, held * FP32)  # reduce-scatter: the same cost
    # across replicas once a step, in the last micro-batch's backward (gradient_sync)
    replicas = fabric.all_reduce(replicate, elements * FP32 / layout.dp_shard)
    backward = stage.backward + stage.recompute
    if layout.pp > 1:  # gathered once a step, synced after the last backward
        # torch's schedule runs FSDP2's post-backward for every unit at once after the
        # stage's last backward (the REDUCE_GRAD action): no compute is left to hide it
        total = gather + reduce + replicas
        return total, overlapped(gather, stage.forward, n_units) + reduce + replicas
    backward_gather = gather if p.fsdp.reshard_after_forward else 0.0
    total = m * (gather + backward_gather + reduce) + replicas
    forward = overlapped(gather, stage.forward, n_units)
    exposed = (m - 1) * (forward + overlapped(backward_gather + reduce, backward, n_units))
    exposed += forward + overlapped(backward_gather + reduce + replicas, backward, n_units)
    return total, exposed


def _fsdp_copies(
    cfg: ExperimentConfig, layout: Layout, cost: ModelCost, m: int, rates: DeviceRates | None
) -> float:
    """Seconds a step of FSDP2's copies of the unsharded parameters and gradients (module
    docstring); none where compute is costed by FLOPs, which knows no memory bandwidth."""
    if not (layout.uses_fsdp and rates):
        return 0.0
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    gathers = reduces = 1  # under PP: gathered once a step, reduced after the last backward
    if layout.pp == 1:
        gathers = m * (2 if cfg.parallel.fsdp.reshard_after_forward else 1)
        reduces = m
    per_element = gathers * 2 * width + reduces * (width + FP32)
    return cost.rank_elements * per_element / rates.memory


def predict_speed(
    cfg: ExperimentConfig,
    host_flops: float | None = None,
    cost: ModelCost | None = None,
    calibration: Calibration | None = None,
) -> SpeedPrediction | None:
    """None when a device's peak is unknown (and no host measurement stands in for it).
    `cost`: what was counted of a model without formulas (formula_cost's otherwise).
    `calibration`: this host's measured rates and links (a CPU host's: by shapes then)."""
    layout = Layout.of(cfg.parallel)
    by_shapes = cost is None and cfg.plan.efficiency is None
    cost = cost or formula_cost(cfg, layout)
    fabric = Fabric.of(cfg, calibration)
    m, micro = micro_batching(cfg, layout)
    shares = stage_shares(cfg.model, cfg.parallel, layout)
    host: float | DeviceRates | None = host_flops
    if calibration is not None and by_shapes:
        host = calibrated_rates(calibration)
    slowest = _slowest_stage(cfg, layout, fabric, shares, micro, cost, host, by_shapes)
    if slowest is None:
        return None
    stage, rates = slowest
    pp = _pp_comm(cfg, layout, fabric, micro, cost)
    n_units = max(s.layers for s in shares) + 1  # FSDP2 units: the blocks and the root
    dp = _dp_comm(cfg, layout, fabric, cost, stage, m, n_units)
    if cfg.hardware.device_type == "cpu":  # gloo copies and reduces on the computing cores
        dp, stage.cp = (dp[0], dp[0]), stage.cp_total
    stage.parts["fsdp_copies"] = _fsdp_copies(cfg, layout, cost, m, rates)
    return _prediction(cfg, layout, cost, m, stage, pp, dp, _contention(dp, rates))


def _slowest_stage(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    shares: list[StageShare],
    micro: int,
    cost: ModelCost,
    host: float | DeviceRates | None,
    by_shapes: bool,
) -> tuple[_Stage, DeviceRates | None] | None:
    """The stage and device kind every other waits for, with the shape model's rates where it
    was costed by them; None where a device's peak is unknown. Stages x device kinds, never
    ranks."""
    slowest: tuple[_Stage, DeviceRates | None] | None = None
    for pp_rank, share in enumerate(shares):
        specs = (
            stage_devices(cfg, layout, pp_rank) if cfg.hardware.device_type == "cuda" else [None]
        )
        if not specs:
            return None
        for spec in specs:
            timed = _stage_on(cfg, layout, fabric, share, micro, cost, spec, host, by_shapes)
            if timed is None:
                return None
            if slowest is None or _clock(timed[0]) > _clock(slowest[0]):
                slowest = timed
    return slowest


def _stage_on(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    share: StageShare,
    micro: int,
    cost: ModelCost,
    spec: DeviceSpec | None,
    host: float | DeviceRates | None,
    by_shapes: bool,
) -> tuple[_Stage, DeviceRates | None] | None:
    """One micro-batch of the stage on one kind of device (None: the host's CPU, `host` its
    measured rates or matmul FLOP/s): by matmul shapes where a datasheet or a calibration
    gives the rates, else by FLOPs at the expected share of the peak; None where that peak
    is unknown."""
    rates = _rates(cfg, spec, layout.cp) if by_shapes and spec else None
    if spec is None and isinstance(host, DeviceRates):
        rates = host
    if rates:
        stage = _by_shapes(cfg, layout, share, micro, rates)
    else:
        peak = host if spec is None else _peak(cfg, spec)
        if not peak:
            return None
        efficiency = cfg.plan.efficiency or DEFAULT_EFFICIENCY[cfg.hardware.device_type]
        stage = _by_flops(cfg, layout, share, micro, cost, peak * efficiency)
    stage.tp = _tp_comm(cfg, layout, fabric, share, micro, cost)
    stage.cp_total, stage.cp = _cp_comm(cfg, layout, fabric, share, micro, stage, cost)
    stage.ep = _ep_comm(cfg, layout, fabric, share, micro)
    if rates:
        stage.parts["optimizer"] = optimizer_time(cost.rank_elements // layout.dp_shard, rates)
    return stage, rates


def calibrated_rates(calibration: Calibration) -> DeviceRates:
    """A calibrated host's rates, as measured (no datasheet efficiencies), per rank."""
    return DeviceRates(
        matmul=calibration.matmul_flops,
        memory=calibration.memory_bw,
        sms=0,
        attention=calibration.attention_flops,
        layer_overhead=calibration.ops_per_layer * calibration.op_seconds,
    )


def _contention(dp: tuple[float, float], rates: DeviceRates | None) -> float:
    """Seconds the data-parallel collectives hidden behind compute cost it in SMs (none
    where compute is costed by FLOPs, which knows no SMs)."""
    dp_total, dp_exposed = dp
    if not (rates and rates.sms):
        return 0.0
    return (dp_total - dp_exposed) * min(1.0, NCCL_CHANNELS / rates.sms)


def _prediction(
    cfg: ExperimentConfig,
    layout: Layout,
    cost: ModelCost,
    m: int,
    stage: _Stage,
    pp: float,
    dp: tuple[float, float],
    contention: float,
) -> SpeedPrediction:
    """The step: m micro-batches of the slowest stage stretched by the schedule's bubble,
    then what of the data-parallel sync is exposed, its SM contention and the optimizer."""
    dp_total, dp_exposed = dp
    bubble = 0.0
    if layout.pp > 1:
        bubble = theoretical_bubble(layout.pp, n_microbatches(cfg), cfg.parallel.stages_per_rank)
    optimizer = stage.parts.get("optimizer", 0.0)
    copies = stage.parts.get("fsdp_copies", 0.0)
    pipeline = m * (stage.compute + stage.tp + stage.cp + stage.ep + pp)
    step = pipeline / (1 - bubble) + dp_exposed + contention + optimizer + copies
    tokens_per_s = cfg.train.tokens_per_step / step
    breakdown = {
        **{k: m * v for k, v in stage.parts.items() if k not in STEP_PARTS},
        "recompute": m * stage.recompute,
        "optimizer": optimizer,
        "fsdp_copies": copies,
        "tp": m * stage.tp,
        "cp": m * stage.cp_total,
        "cp_exposed": m * stage.cp,
        "ep": m * stage.ep,
        "pp": m * pp,
        "dp": dp_total,
        "dp_exposed": dp_exposed,
        "contention": contention,
        "bubble": pipeline / (1 - bubble) - pipeline,
    }
    return SpeedPrediction(
        compute_s=m * stage.compute + optimizer + copies,
        comm_s=m * (stage.tp + stage.cp_total + stage.ep + pp) + dp_total,
        bubble=bubble,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        exposed_comm_s=m * (stage.tp + stage.cp + stage.ep + pp) + dp_exposed + contention,
        model_tflops_per_device=tokens_per_s * cost.flops_per_token / layout.world_size / 1e12,
        breakdown=breakdown,
    )


def _clock(stage: _Stage) -> float:
    return stage.compute + stage.tp + stage.cp + stage.ep + stage.parts.get("optimizer", 0.0)
