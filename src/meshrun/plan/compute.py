"""How long one device computes a transformer block's forward and backward for one
micro-batch, from the shapes of its matmuls and the device's datasheet, not from one MFU.

    matmul      2*M*N*K FLOPs at the device's peak x `matmul_efficiency` (the best large
                matmul measured: 0.86 of an A100's 312 bf16 TFLOP/s, 0.80 of an H100's 989;
                Bekman's MAMF table, ml-engineering), x the last wave's fill: cuBLAS tiles
                the output in 128 x 128 blocks, one per SM at a time, so 160 tiles on 108 SMs
                take two full waves (wave quantization, NVIDIA's "Matrix Multiplication
                Background" guide); and no faster than reading A, B and writing C from DRAM
                (roofline). Each linear runs three: forward (T x out x in), input gradient
                (T x in x out) and weight gradient (out x in x T), T the micro-batch's tokens;
                tensor parallelism divides out (column-parallel) or in (row-parallel) by tp.
                train.float8's linears at the fp8 peak, their casts memory-bound
                (plan/float8.py).
    attention   the causal kernel (FlashAttention through SDPA) skips the masked half of
                QK^T and AV; its backward does 2.5x the forward's matmuls (it recomputes the
                scores). At the rates its authors measured where the profile has them
                (`attention`: forward and backward by sequence length, interpolated in
                log2 of the sequence a rank's attention spans (seq/cp under ring and
                allgather, all of it under alltoall: stage_time.attention_span); on
                Hopper torch's FlashAttention-2 reaches 0.34 of the peak at 8k, 0.19 at
                512: short sequences leave more of the causal tiles half empty); else ~0.7 of the
                large-matmul rate (FlashAttention-2 reaches 50-73% of A100's peak, Dao 2023).
    elementwise memory-bound work at 0.8 of the DRAM bandwidth (what STREAM-like kernels
                reach), bytes per token a layer in forward: the two RMSNorms and residual
                adds on the fp32 residual stream, 4 bytes x 12h (replicated under TP, / tp
                with sequence parallelism), RoPE on q and k, 4(h + hk)/tp x width/2, and the
                MLP's activation, mlp x f/tp x width; backward moves twice that.
    context     a CP rank's linears and elementwise work run on its seq/cp tokens, and its
                attention is a 1/cp share of the causal work: rank r holds chunks r and
                2cp-1-r of the sequence, so every rank's queries see as many keys
                (rank/parallel/context_shards.py).

Megatron's fused kernels move fewer bytes than meshrun's unfused fp32 residual stream; these
are meshrun's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from meshrun.core.config import AttentionKernel
from meshrun.plan.float8 import Float8Plan, float8_flags
from meshrun.plan.shapes import Dims

TILE = 128  # cuBLAS's usual output tile edge for 16-bit GEMMs on A100/H100
ATTENTION_RATE = 0.7  # of the large-matmul rate: FlashAttention-2 (Dao 2023)
ATTENTION_BACKWARD = 2.5  # the backward's matmuls over the forward's (5 against 2)
MEMORY_EFFICIENCY = 0.8  # of the datasheet DRAM bandwidth, for streaming kernels
RESIDUAL_BYTES = 4 * 12  # fp32 residual stream: 2 x (RMSNorm 7 + residual add 5) x h floats
ADAMW_BYTES = 28  # a parameter's step: read weight, grad, m, v; write weight, m, v (fp32)


@dataclass(frozen=True)
class DeviceRates:
    """A device kind for the run's precision: FLOP/s of a large matmul, DRAM bytes/s, SMs
    (0: no wave quantization, a CPU); measured (a profile's `attention`, a calibrated host,
    core/calibration.py): `attention` FLOP/s of the causal kernel (`attention_backward` its
    backward's where apart), `layer_overhead` seconds a block's forward and backward spend
    dispatching their ops however small the tensors, and what it costs more under TP's
    DTensors (`tp_overhead`; with SP `sp_overhead`), FSDP2's hooks (`fsdp_overhead`) and a
    checkpointed block under each policy (`checkpoint_overhead`), a CP block under each
    method (`context_overhead`).
    `waves`: the matmul rate is the best
    large matmul's, each shape's last wave of tiles costed on top (a calibrated rate was
    measured at the run's shapes, their waves in it). `dispatch_ahead`: the host issues
    kernels ahead of a GPU, so a block waits for its dispatch only where that outlasts the
    block's kernels (a CPU computes where it dispatches: the two add)."""

    matmul: float
    memory: float
    sms: int
    float8_matmul: float | None = None  # a large float8 matmul's FLOP/s (train.float8)
    attention: float | None = None
    attention_backward: float | None = None
    layer_overhead: float = 0.0  # a block's eager ops' dispatch, forward and backward
    tp_overhead: float = 0.0
    sp_overhead: float = 0.0
    fsdp_overhead: float = 0.0
    checkpoint_overhead: dict[str, float] = field(default_factory=dict, hash=False)
    context_overhead: dict[str, float] = field(default_factory=dict, hash=False)
    waves: bool = True
    dispatch_ahead: bool = False

    def gemm(self, m: int, n: int, k: int, width: int, float8: bool = False) -> float:
        """Seconds of an (m x k) @ (k x n) matmul of `width`-byte elements (`float8`: its
        operands one byte, at the float8 rate)."""
        fill = 1.0
        if self.sms and self.waves:
            tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
            fill = tiles / (math.ceil(tiles / self.sms) * self.sms)
        rate = self.float8_matmul if float8 and self.float8_matmul else self.matmul
        operands = 1 if float8 else width
        compute = 2 * m * n * k / (rate * fill)
        return max(compute, (operands * (m * k + k * n) + width * m * n) / self.memory)

    def linear(
        self, tokens: int, out: int, inp: int, width: int, float8: Float8Plan | None = None
    ) -> tuple[float, float]:
        """(forward, backward) seconds of a linear layer: y = x W^T, dx, dW; `float8`: its
        GEMMs in float8 and its casts (plan/float8.py)."""
        on = float8 is not None
        forward = self.gemm(tokens, out, inp, width, on)
        backward = self.gemm(tokens, inp, out, width, on) + self.gemm(out, inp, tokens, width, on)
        if on:
            cast_f, cast_b = float8.cast_bytes(tokens, out, inp, width)
            forward, backward = forward + cast_f / self.memory, backward + cast_b / self.memory
        return forward, backward


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one micro-batch through one block, by kind of work."""

    matmul_f: float
    matmul_b: float
    attention_f: float
    attention_b: float
    elementwise_f: float
    alternate_f: float = 0.0  # the forward of its 2nd, 4th, ... matmuls (ckpt=op's recompute)

    def recompute(self, ckpt: str) -> float:
        """What checkpointing runs again in backward: the whole forward (full), the
        elementwise work (selective keeps every matmul and attention output), and every
        other matmul as well (op)."""
        return {
            "full": self.forward,
            "selective": self.elementwise_f,
            "op": self.elementwise_f + self.alternate_f,
        }.get(ckpt, 0.0)

    @property
    def forward(self) -> float:
        return self.matmul_f + self.attention_f + self.elementwise_f

    @property
    def backward(self) -> float:
        return self.matmul_b + self.attention_b + 2 * self.elementwise_f

    def by_kind(self) -> dict[str, float]:
        """Forward and backward together."""
        return {
            "matmul": self.matmul_f + self.matmul_b,
            "attention": self.attention_f + self.attention_b,
            "elementwise": 3 * self.elementwise_f,
        }


@functools.lru_cache(maxsize=4096)  # the planner asks again for every stage and layout
def block_times(
    d: Dims,
    rates: DeviceRates,
    micro_batch: int,
    seq: int,
    tp: int,
    sp: bool,
    width: int,
    cp: int = 1,
    float8: Float8Plan | None = None,
) -> PassTimes:
    """One transformer block (meshrun's: q, k, v, o; w1, (w3,) w2) under TP degree `tp` and
    CP degree `cp`; `float8`: train.float8's linears (plan/float8.py)."""
    tokens = micro_batch * seq // cp
    forward = backward = alternate = 0.0
    flags = float8_flags(d) if float8 else None
    for index, (rows, out, inp) in enumerate(block_linears(d, tokens, tp)):
        f, b = rates.linear(rows, out, inp, width, float8 if flags and flags[index] else None)
        forward, backward = forward + f, backward + b
        alternate += f if index % 2 else 0.0
    causal_flops = 2 * micro_batch * seq * seq * d.hq / tp / cp  # half of 4*b*s^2*h: the mask
    forward_rate = rates.attention or rates.matmul * ATTENTION_RATE
    attention = causal_flops / forward_rate
    attention_b = ATTENTION_BACKWARD * causal_flops / (rates.attention_backward or forward_rate)
    mlp = d.mlp * d.f / tp
    if d.experts:
        mlp = 3 * (d.routed * d.fe / d.etp + d.fs) + 2 * d.routed * d.h
    per_token = RESIDUAL_BYTES * d.h / (tp if sp else 1) + (2 * (d.hq + d.hk) / tp + mlp) * width
    elementwise = tokens * per_token / rates.memory
    return PassTimes(forward, backward, attention, attention_b, elementwise, alternate)


def kernel_rates(kernel: AttentionKernel, seq: int) -> tuple[float, float]:
    """(forward, backward) FLOP/s of the attention kernel over a sequence of `seq`: the
    measured rates interpolated in log2(seq), the ends held beyond them."""
    points = [math.log2(s) for s in kernel.seq]
    x = min(max(math.log2(seq), points[0]), points[-1])
    upper = next(i for i, p in enumerate(points) if p >= x)
    lower = max(upper - 1, 0)
    share = (x - points[lower]) / (points[upper] - points[lower]) if upper != lower else 0.0

    def at(rates: list[float]) -> float:
        return (rates[lower] + share * (rates[upper] - rates[lower])) * 1e12

    return at(kernel.forward_tflops), at(kernel.backward_tflops)


def alternate_matmul_share(d: Dims) -> float:
    """The share of a block's matmul FLOPs in its 2nd, 4th, ... matmuls: what ckpt=op
    recomputes (k, o and up of a dense block)."""
    flops = [rows * out * inp for rows, out, inp in block_linears(d, 1, 1)]
    return sum(flops[1::2]) / sum(flops)


def block_linears(d: Dims, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(rows, out, in) of a block's matmuls in the order its forward runs them."""
    column = [(d.hq, d.h), (d.hk, d.h), (d.hk, d.h)]
    attention = [(tokens, out // tp, inp) for out, inp in column] + [(tokens, d.h, d.hq // tp)]
    return attention + _mlp_linears(d, tokens, tp)


def _mlp_linears(d: Dims, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(rows, out, in) of a block's feed-forward matmuls: w1 (w3) w2 split by TP; an MoE's
    router, each expert over its share of the k x tokens assignments (an even load; under
    ep the rank's experts take the rows of the whole ep group, the busiest rank's allowance
    more) and the shared experts over every token, all whole on each TP rank (models/moe.py).
    Each expert's matmuls costed as their own, as the loop runs them; the grouped GEMM
    (models/expert_compute.py) spreads every expert's tiles over one set of waves: at
    mixtral-8x7b's shapes on an H100 (1024 rows an expert) its waves are 0.99 full to their
    0.97; for tiny experts the gap grows, where a block's fixed costs dominate anyway."""
    if not d.experts:
        return [(tokens, d.f // tp, d.h)] * (d.mlp - 1) + [(tokens, d.h, d.f // tp)]
    held = d.experts // d.ep
    rows = math.ceil(tokens * d.routed / held)
    fe = d.fe // d.etp  # etp: each TP rank its share of every expert's hidden width
    expert = [(rows, fe, d.h)] * 2 + [(rows, d.h, fe)]
    shared = [(tokens, d.fs, d.h)] * 2 + [(tokens, d.h, d.fs)] if d.fs else []
    return [(tokens, d.experts, d.h), *expert * held, *shared]


@functools.lru_cache(maxsize=4096)
def head_times(
    d: Dims, rates: DeviceRates, tokens: int, tp: int, width: int, sharded_loss: bool = False
) -> tuple[float, float]:
    """(forward, backward) of the output layer and the loss: the vocabulary-parallel head
    and the fp32 log-softmax over the gathered logits (read, write; backward twice), over
    this rank's V/tp of them where `sharded_loss` (train.loss=vocab_parallel)."""
    forward, backward = rates.linear(tokens, d.vocab // tp, d.h, width)
    loss = tokens * d.vocab // (tp if sharded_loss else 1) * 4 * 2 / rates.memory
    return forward + loss, backward + 2 * loss


def optimizer_time(elements: int, rates: DeviceRates) -> float:
    """AdamW's step over the parameters a rank holds: memory-bound."""
    return elements * ADAMW_BYTES / rates.memory
