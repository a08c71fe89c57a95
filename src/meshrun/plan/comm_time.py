"""Seconds of each parallelism's communication for one micro-batch on a pipeline stage
(TP, CP, EP, PP) or for a step (DP), what of them compute leaves exposed, and what the
hidden ones and FSDP2's copies cost compute beside them.

    TP          Megatron's f/g operators on the block (Shoeybi et al. 2019): 2 all-reduces
                of the T x h activations forward, 2 backward; with sequence parallelism an
                all-gather and a reduce-scatter for each (the same bytes, twice the
                collectives); the embedding's all-reduce, the head's input all-reduce in
                backward and its logits all-gathered (rank/parallel/tensor.py; under
                train.loss=vocab_parallel three all-reduces of T floats instead); under
                etp the experts' partial outputs all-reduced forward, their input's
                gradient backward (k x h a token), transformers' fused experts' gate|up
                products traded forward and their gradients backward (k x 2fe/etp, an
                all-to-all costed as an all-gather of as much). On the critical path:
                DTensor TP does not overlap them (collectives.py)
    CPU host    every core computes for a rank (ranks x threads = cores), and gloo's copies
                and reductions run on those cores: its DP and CP traffic hides behind no
                compute (exposed in full)
    CP          each rank computes its seq/cp tokens (plan/compute.py), and per layer shares
                attention's K/V (rank/parallel/context_attention.py): ring passes its K/V
                block cp-1 times forward, each send posted before the block that computes
                beside it (hidden behind attention but for what exceeds it), and K/V with
                their gradients (fp32) backward; allgather gathers K/V forward and
                reduce-scatters their gradients backward; K/V as SDPA gets them (heads
                repeated where no fused kernel takes GQA, fp32 where the pairs' kernel
                computes in fp32: plan/memory.py); alltoall (Ulysses) moves q, k, v and the output
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
                (GPipe, 1F1B; interleaved with v; Narayanan et al. 2021, SC21). A tied
                embedding's gradient (V x h, the rank's TP and FSDP shard, fp32) all-reduced
                between the first and last stage once a step, after the last backward:
                exposed (Megatron's embedding group; rank/parallel/tied.py)
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

train.float8 (plan/float8.py): FSDP2's float8 all-gather moves its weights at one byte (and
copies them out so), one all-reduce of their amaxes a step; tensorwise TP's all-gathers under
SP move float8, each cast of a sharded activation all-reduces its amax.

Collective costs: plan/collectives.py (bandwidth, latency, which links a group crosses).
"""

from __future__ import annotations

import math

from meshrun.core.choices import HALF_PRECISIONS, SAC_POLICIES
from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.models import model_kind, model_shape
from meshrun.models.loss import loss_method
from meshrun.plan.collectives import Fabric, overlapped
from meshrun.plan.compute import DeviceRates
from meshrun.plan.float8 import TP_AMAX_REDUCTIONS, Float8Plan
from meshrun.plan.memory import attention_kept
from meshrun.plan.placement import GroupSpan, expert_spans, group_span
from meshrun.plan.shapes import Dims, StageShare, checkpointed_layers, rank_tokens
from meshrun.plan.stage_time import (
    EP_LOAD_ALLOWANCE,
    FP32,
    ModelCost,
    StageTime,
    recomputed_share,
)

NCCL_CHANNELS = 16  # SMs a busy NCCL collective occupies beside compute (contention above)


def tp_time(
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
    float8 = Float8Plan.of(cfg, layout)
    tp_float8 = float8 is not None and float8.tp_float8
    sp = cfg.parallel.sequence_parallel
    if sp:  # an all-gather and a reduce-scatter for each; float8's gathers one byte
        gathered = tokens * cost.width if tp_float8 else activation
        one = fabric.all_gather(span, gathered) + fabric.reduce_scatter(span, activation)
    else:
        one = fabric.all_reduce(span, activation)
    amax = TP_AMAX_REDUCTIONS[sp] * fabric.all_reduce(span, FP32) if tp_float8 else 0.0
    forward_ops = 2 + 2 * recomputed_share(cfg, share)
    if cfg.parallel.activation_checkpointing in SAC_POLICIES and share.layers:
        # SAC's recompute stops after the last tensor backward needs (the down projection's
        # input): the attention's all-reduce again, or with SP its input's all-gather, its
        # reduce-scatter and the MLP input's all-gather (3 of the forward's 4)
        again = 1.5 if cfg.parallel.sequence_parallel else 1.0
        forward_ops += again * checkpointed_layers(cfg.parallel, share) / share.layers
    seconds = share.layers * ((forward_ops + 2) * one + amax)
    if layout.etp > 1:
        seconds += share.layers * (forward_ops / 2 + 1) * _etp_one(cfg, layout, fabric, tokens)
    residual = tokens * cost.width * FP32
    if share.first:  # the vocabulary-parallel embedding's output
        seconds += fabric.all_reduce(span, residual)
    if share.last:  # the head's input gradient, and its logits gathered (vocab_parallel:
        # the log-softmax's max and sum all-reduced instead, and the target's logit)
        vocab = model_shape(cfg.model).vocab_size
        seconds += fabric.all_reduce(span, activation)
        if loss_method(cfg)[0] == "vocab_parallel":
            seconds += 3 * fabric.all_reduce(span, tokens * FP32)
        else:
            seconds += fabric.all_gather(span, tokens * vocab * (2 if half else FP32))
    return seconds


def cp_time(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    share: StageShare,
    micro: int,
    stage: StageTime,
    cost: ModelCost,
) -> tuple[float, float]:
    """(seconds of one micro-batch's CP traffic on a stage, what of it compute leaves
    exposed): per layer, the method's forward and backward (and the forward's again where
    full checkpointing recomputes it)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    h, hk, kv_width = attention_widths(cfg, layout, cost)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    tokens = rank_tokens(cfg, layout, micro)
    kv = 2 * tokens * hk // layout.tp * kv_width  # this rank's K and V of one layer
    grads = kv // kv_width * FP32  # their gradients, summed in fp32
    span = group_span(layout, "cp", fabric.devices_per_node)
    method = cfg.parallel.cp_method
    forwards = 1 + recomputed_share(cfg, share)
    if method == "ring":
        # cp blocks of attention a layer, the next block's transfer beside each but the last
        step, block = fabric.send(span.crosses_nodes, kv), stage.attention_f / cp
        back = step + fabric.send(span.crosses_nodes, grads)  # K/V and their gradients
        exposed = forwards * (cp - 1) * max(0.0, step - block)
        exposed += (cp - 1) * max(0.0, back - stage.attention_b / cp)
        total = (cp - 1) * (forwards * step + back)
    elif method == "allgather":
        gather = fabric.all_gather(span, cp * kv)
        total = exposed = forwards * gather + fabric.all_gather(span, cp * grads)
    else:  # alltoall: q, k, v in and the output back, each way
        one = fabric.all_gather(span, 2 * tokens * (h + hk) // layout.tp * width)
        total = exposed = (forwards + 1) * one
    return share.layers * total, share.layers * exposed


def _etp_one(cfg: ExperimentConfig, layout: Layout, fabric: Fabric, tokens: int) -> float:
    """Seconds of one layer's etp collectives one way: the experts' partial outputs
    all-reduced (their input's gradient backward), and transformers' fused gate|up products
    traded (models/hf_experts.py)."""
    span = group_span(layout, "tp", fabric.devices_per_node)
    d = Dims.of_layout(cfg.model, layout, EP_LOAD_ALLOWANCE)
    rows = tokens * d.routed * (2 if cfg.train.precision in HALF_PRECISIONS else FP32)
    one = fabric.all_reduce(span, rows * d.h)
    if model_shape(cfg.model).fused_gate_up:
        one += fabric.all_gather(span, rows * 2 * d.fe / d.etp)
    return one


def attention_widths(cfg: ExperimentConfig, layout: Layout, cost: ModelCost) -> tuple[int, ...]:
    """(query width, K/V width, bytes a K/V element) a layer moves: the formulas' where the
    model has them, K/V as SDPA gets them (repeated heads, fp32 where CP's kernel computes
    in fp32: memory.attention_kept); a model without (model=custom) taken as multi-head, its
    K/V as wide as the activations it moves (GQA's fewer K/V heads would move less: an upper
    bound)."""
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    shape = model_shape(cfg.model)
    if not (shape.dim and shape.n_heads):
        return cost.width, cost.width, width
    d = Dims.of(cfg.model)
    kept = attention_kept(cfg, layout, d)
    return d.hq, kept.kv, FP32 if kept.fp32_copies else width


def ep_time(
    cfg: ExperimentConfig, layout: Layout, fabric: Fabric, share: StageShare, micro: int
) -> float:
    """Seconds of one micro-batch's expert all-to-alls on a stage (module docstring)."""
    if layout.ep == 1:
        return 0.0
    d = Dims.of_layout(cfg.model, layout, EP_LOAD_ALLOWANCE)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    rows = rank_tokens(cfg, layout, micro) * d.routed * d.h * width
    span, _ = expert_spans(layout, fabric.devices_per_node)
    forwards = 1 + recomputed_share(cfg, share)
    return share.layers * 2 * (forwards + 1) * fabric.all_gather(span, rows)


def pp_time(
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


def tied_time(cfg: ExperimentConfig, layout: Layout, fabric: Fabric) -> float:
    """Seconds of a step's tied-embedding gradient sum between the pipeline's ends (a custom
    module's own ties are refused under a pipeline: none)."""
    if (
        layout.pp == 1
        or model_kind(cfg.model).own_ties(cfg.model)
        or not model_shape(cfg.model).tied
    ):
        return 0.0
    d = Dims.of_layout(cfg.model, layout)
    ends_cross = group_span(layout, "pp", fabric.devices_per_node).crosses_nodes
    pair = GroupSpan(1, 2) if ends_cross else GroupSpan(2, 1)
    shards = layout.tp * (layout.shard_size if layout.uses_fsdp else 1)
    return fabric.all_reduce(pair, d.vocab * d.h / shards * FP32)


def dp_time(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    cost: ModelCost,
    stage: StageTime,
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
    float8 = _float8_gathered(cfg, layout, cost)
    gather = reduce = 0.0
    for index, (shard, held) in enumerate(groups):
        light = float8 if index == 0 else 0  # float8 weights: one byte, none among experts
        gather += fabric.all_gather(shard, (held - light) * param_width + light)
        reduce += fabric.reduce_scatter(shard, held * FP32)
    # across replicas once a step, in the last micro-batch's backward (gradient_sync)
    replicas = fabric.all_reduce(replicate, elements * FP32 / layout.dp_shard)
    if float8:  # their scales: one all-reduce of the amaxes after the optimizer step
        replicas += fabric.all_reduce(groups[0][0], FP32)
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


def fsdp_copies(
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
    float8 = _float8_gathered(cfg, layout, cost)  # copied out at one byte
    copied = gathers * 2 * (width * (cost.rank_elements - float8) + float8)
    return (copied + reduces * (width + FP32) * cost.rank_elements) / rates.memory


def _float8_gathered(cfg: ExperimentConfig, layout: Layout, cost: ModelCost) -> int:
    """The elements FSDP2 gathers in float8 (train.float8's all-gather), else none."""
    float8 = Float8Plan.of(cfg, layout)
    return cost.float8_elements if float8 is not None and float8.all_gather else 0


def sm_contention(dp: tuple[float, float], rates: DeviceRates | None) -> float:
    """Seconds the data-parallel collectives hidden behind compute cost it in SMs (none
    where compute is costed by FLOPs, which knows no SMs)."""
    dp_total, dp_exposed = dp
    if not (rates and rates.sms):
        return 0.0
    return (dp_total - dp_exposed) * min(1.0, NCCL_CHANNELS / rates.sms)
