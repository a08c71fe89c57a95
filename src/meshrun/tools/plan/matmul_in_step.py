"""The rate a CPU step's matmuls reach inside the step (`meshrun-plan calibrate`, on a CPU):
one block of the run's widths trained for a few steps under torch.profiler, its matmuls'
counted FLOPs over their self time. The norms, attention and activations between them evict
what a loop of one shape keeps in cache (model=small, 2 threads: 207 against 300 GFLOP/s
alone, and 0.70 of the measured step time predicted from the latter)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from meshrun.core.config import LlamaModelConfig
from meshrun.models import build_model
from meshrun.plan.shapes import Dims
from meshrun.rank.quiet_profiler import quiet_stderr

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
IN_STEP_MAX_BYTES = 2 * 2**30  # a block's fp32 weights and gradients, each rank
STEPS = 3  # after a warm-up


def in_step_block(d: Dims) -> LlamaModelConfig | None:
    """One dense LLaMA block of the run's widths (any model kind: its matmuls' shapes), a
    small vocabulary; None where its weights and gradients would pass IN_STEP_MAX_BYTES a
    rank (the matmuls alone then stand for it)."""
    ffn = d.f or d.fe
    params = d.h * (2 * d.hq + 2 * d.hk) + 3 * d.h * ffn
    if params * 4 * 2 > IN_STEP_MAX_BYTES:
        return None
    heads = d.a
    head_dim = d.hq // heads
    return LlamaModelConfig(
        name="in-step",
        dim=d.h,
        n_layers=1,
        n_heads=heads,
        n_kv_heads=max(1, d.hk // head_dim),
        head_dim=head_dim,
        ffn_dim=ffn,
        vocab_size=128,
    )


def matmul_in_a_step(block: LlamaModelConfig, attention: tuple[int, int, int, int]) -> float:
    """FLOPs a second of the matmuls in a block's forward and backward as a step runs them
    (torch.profiler's counted FLOPs over their self time, after a warm-up step)."""
    batch, _, seq, _ = attention
    model = build_model(block, seq, torch.device("cpu"))
    model.init_weights(0)
    tokens = torch.randint(0, block.vocab_size, (batch, seq))

    def step() -> None:
        model(tokens).float().sum().backward()

    step()
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(STEPS):
            step()
    ops = [e for e in prof.key_averages() if e.key in MATMUL_OPS]
    return sum(e.flops for e in ops) / (sum(e.self_cpu_time_total for e in ops) * 1e-6)
