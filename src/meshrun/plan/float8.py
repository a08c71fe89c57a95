"""What train.float8 changes in a plan (rank/parallel/float8.py runs it): which of a block's
linears run float8 matmuls, what their casts cost, and what moves and is held in float8.

    matmuls   a float8 linear's three GEMMs at the device's fp8 peak x `fp8_matmul_efficiency`
              (operands one byte, the output the run's width; compute.py's wave and roofline
              model otherwise): the linears models/float8.py converts, by their dims (both
              multiples of 16; `train.float8.skip` is not seen here), never an MoE's router
              or routed experts (they stay in the run's precision: driver/float8.py)
    casts     each operand's amax and scaled cast, memory-bound: with train.compile, torchao's
              fused kernels, bytes an element (w the high-precision width; torchao/testing/
              training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s): tensorwise
              input 2w+2 (amax read; read, both layouts written), weight 3w+2, output
              gradient 2w+2; rowwise 3w+2, 4w+2, 3w+2 (a transposed copy before each
              column cast); rowwise_with_gw_hp w+1, 2w+2, w+1. Eager, torchao's casts run
              op by op (float8_scaling_utils.py: abs, max, the fp32 multiply, the saturating
              clamp, the cast), 4w+17 bytes an element and cast, +2 for the column-major copy
              _scaled_mm takes, each operand cast again in backward (twice a step; once for
              rowwise_with_gw_hp's input and gradient): ~4x the compiled bytes. Under FSDP2's
              float8 all-gather a weight is cast on its shard before the gather (3w+2 over the
              shard degree) and transposed once gathered (2)
    FSDP2     float8 all-gather: those weights gathered at one byte (their gradients still
              reduce-scattered in fp32), their scales one all-reduce of the amaxes a step
    TP        tensorwise: SP's all-gathers of a block's inputs and of its output gradients
              move float8 (its reduce-scatters stay in high precision), and each cast of a
              sharded tensor all-reduces its amax (a scalar): with SP the attention's and
              the MLP's inputs forward, the column- and row-wise outputs' gradients backward
              (9 a block), without SP the column-wise outputs' gradients (5)
    memory    a float8 linear keeps no autocast copy of its weight (it casts the input only);
              under float8 all-gather a gathered block holds its float8 weights at one byte;
              one linear's float8 operands (both layouts) are transient at its backward,
              eager with two fp32 copies of its largest operand (the cast's scaled tensor
              and its clamp)
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.models.float8 import DIM_MULTIPLE
from meshrun.plan.shapes import Dims

# The amax all-reduces a block's float8 TP casts issue, forward and backward (module docstring).
TP_AMAX_REDUCTIONS = {True: 9, False: 5}  # with SP, without
# Bytes an element of an operand's casts, by recipe, as (fixed, per high-precision byte) for
# input, weight and output gradient: compiled (torchao's roofline), eager casts a step.
COMPILED_CASTS = {
    "tensorwise": ((2, 2), (2, 3), (2, 2)),
    "rowwise": ((2, 3), (2, 4), (2, 3)),
    "rowwise_with_gw_hp": ((1, 1), (2, 2), (1, 1)),
}
EAGER_CAST = (17 + 2, 4)  # one cast and its column-major copy
# Eager, a cast of the largest operand holds two fp32 copies of it at its peak (the scaled
# tensor and its saturating clamp, float8_utils.to_fp8_saturated): 8 bytes an element.
EAGER_FP32_COPIES = 8
EAGER_CASTS_A_STEP = {
    "tensorwise": (2, 2, 2),
    "rowwise": (2, 2, 2),
    "rowwise_with_gw_hp": (1, 2, 1),
}


@dataclass(frozen=True)
class Float8Plan:
    """A layout's float8: the recipe, whether torch.compile fuses its casts, whether FSDP2
    all-gathers float8 weights (over `shard` ranks) and whether TP moves float8."""

    recipe: str
    compiled: bool
    all_gather: bool
    tp_float8: bool
    shard: int

    @classmethod
    def of(cls, cfg: ExperimentConfig, layout: Layout) -> Float8Plan | None:
        f8 = cfg.train.float8
        if not f8.enabled:
            return None
        return cls(
            str(f8.recipe),
            cfg.train.compile,
            layout.uses_fsdp and f8.gathers_float8,
            f8.recipe == "tensorwise" and layout.tp > 1,
            layout.shard_size if layout.uses_fsdp else 1,
        )

    def cast_bytes(self, rows: int, out: int, inp: int, width: int) -> tuple[float, float]:
        """(forward, backward) bytes of one float8 linear's casts for `rows` tokens: the
        input's and weight's in forward, the output gradient's in backward."""
        if self.compiled:
            per = [fixed + width * per_byte for fixed, per_byte in COMPILED_CASTS[self.recipe]]
        else:
            fixed, per_byte = EAGER_CAST
            casts = EAGER_CASTS_A_STEP[self.recipe]
            per = [n * (fixed + width * per_byte) for n in casts]
        weight = per[1] / self.shard + 2 if self.all_gather else per[1]
        return rows * inp * per[0] + out * inp * weight, rows * out * per[2]


def takes(out: int, inp: int) -> bool:
    """models/float8.py's dims rule: both multiples of 16."""
    return out % DIM_MULTIPLE == 0 and inp % DIM_MULTIPLE == 0


def float8_flags(d: Dims) -> list[bool]:
    """Which of compute.block_linears' matmuls (in its order) run in float8: q, k, v, o and
    a dense MLP's (or an MoE's shared experts') by their whole dims; an MoE's router and
    routed experts never."""
    attention = [takes(d.hq, d.h), takes(d.hk, d.h), takes(d.hk, d.h), takes(d.h, d.hq)]
    if not d.experts:
        return [*attention, *[takes(d.f, d.h)] * (d.mlp - 1), takes(d.h, d.f)]
    routed = [False] * (1 + 3 * (d.experts // d.ep))
    shared = [takes(d.fs, d.h)] * 2 + [takes(d.h, d.fs)] if d.fs else []
    return [*attention, *routed, *shared]


def _float8_shapes(d: Dims, tp: int) -> list[tuple[int, int]]:
    """(out, in) of each of a block's float8 linears as a TP rank holds it: q, k, v and the
    gate and up column-wise (out split), o and down row-wise (in split); an MoE's shared
    experts whole (models/moe.py: not split by TP)."""
    column = [(d.hq, d.h), (d.hk, d.h), (d.hk, d.h)]
    row = [(d.h, d.hq)]
    whole = []
    if not d.experts:
        column += [(d.f, d.h)] * (d.mlp - 1)
        row += [(d.h, d.f)]
    elif d.fs:
        whole = [(d.fs, d.h)] * 2 + [(d.h, d.fs)]
    return [
        *((o // tp, i) for o, i in column if takes(o, i)),
        *((o, i // tp) for o, i in row if takes(o, i)),
        *((o, i) for o, i in whole if takes(o, i)),
    ]


def block_float8_elements(d: Dims, tp: int) -> int:
    """A block's float8 weights one rank holds under TP (before FSDP2's shards)."""
    return sum(o * i for o, i in _float8_shapes(d, tp))


def largest_linear(d: Dims, tp: int) -> tuple[int, int]:
    """(out, in) of a block's largest float8 linear as a TP rank holds it ((0, 0): none)."""
    return max(_float8_shapes(d, tp), key=lambda s: s[0] * s[1], default=(0, 0))


def memory_change(
    cfg: ExperimentConfig, layout: Layout, d: Dims, layers: int, tokens: int
) -> float:
    """Bytes train.float8 adds to a rank's activations (negative: takes from them) on a
    stage of `layers` blocks, `tokens` a micro-batch: no autocast copies of its weights (a
    16-bit run without FSDP2 keeps one of every weight, plan/memory.py); gathered float8
    weights at one byte under the float8 all-gather (two blocks at the peak, the whole
    stage under PP, which keeps it gathered); one linear's float8 operands, both layouts,
    at its backward, and without compile the two fp32 copies its eager cast holds (small's
    bf16 float8 runs on a CPU, peaks predicted 1.3% below measured (single) and 1.2% above
    (fsdp); under tensorwise TP the float8 inputs its linears keep, at one byte, are not
    counted: 5.7% above on tp2)."""
    float8 = Float8Plan.of(cfg, layout)
    if float8 is None:
        return 0.0
    half = cfg.train.precision in ("bf16", "fp16")
    width = 2 if half else 4
    block = block_float8_elements(d, layout.tp)
    change = 0.0
    if layout.uses_fsdp and float8.all_gather:
        gathered = layers * block if layout.pp > 1 else 2 * block
        change -= gathered * (width - 1)
    elif not layout.uses_fsdp and half:
        change -= layers * block * 2
    out, inp = largest_linear(d, layout.tp)
    fp32_copies = 0 if float8.compiled else EAGER_FP32_COPIES * tokens * max(out, inp)
    return change + 2 * (tokens * (out + inp) + out * inp) + fp32_copies
