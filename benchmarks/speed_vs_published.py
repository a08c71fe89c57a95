"""The speed model (plan/speed.py) against published large-scale training throughput: each
paper's model shape, layout, batch and cluster as meshrun runs it, predicted tokens/s per GPU
turned into the paper's own metric (Megatron's TFLOP/s counting the recomputed forward,
MFU, tokens/s per GPU). A sanity check, not a fit: no constant of the model was tuned to
these rows. Where a paper leaves the layout unsaid the row says what was assumed.

    .venv/bin/python -m benchmarks.speed_vs_published     # seconds, no GPU needed
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from meshrun.core.config import ExperimentConfig
from meshrun.plan.speed import predict_speed
from tests.helpers import compose_config

MEGATRON_VOCAB = 51200


def swiglu_ffn(h: int) -> int:
    """The SwiGLU width with a GPT MLP's parameters (3*h*f = 8*h^2), a multiple of 256."""
    return round(8 * h / 3 / 256) * 256


@dataclass(frozen=True)
class Published:
    source: str
    what: str
    model: tuple[str, ...]  # overrides giving the shape
    hardware: tuple[str, ...]
    nodes: int
    layout: dict
    batch: int
    micro_batch: int
    seq: int
    ckpt: str
    sp: bool
    metric: str  # "megatron_tflops" (recompute counted), "mfu", "tokens_per_gpu"
    published: float
    peak_tflops: float = 312.0


def gpt(h: int, layers: int, heads: int, vocab: int = MEGATRON_VOCAB) -> tuple[str, ...]:
    return (
        "model=gpt3-175b",
        f"model.dim={h}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.vocab_size={vocab}",
        f"model.ffn_dim={swiglu_ffn(h)}",
    )


def layout(tp: int, pp: int, dp: int, shard: bool = False, v: int = 1) -> dict:
    degrees = dict(tp=tp, pp=pp, dp_replicate=1 if shard else dp, dp_shard=dp if shard else 1)
    if v > 1:
        degrees.update(schedule="interleaved_1f1b", stages_per_rank=v)
    return degrees


A100 = ("hardware=a100-80g",)
SC21 = "Narayanan et al. 2021 (SC21), Table 1"
ROWS = [
    Published(
        SC21,
        "39.1B, 512 A100",
        gpt(8192, 48, 64),
        A100,
        64,
        layout(8, 2, 32),
        1536,
        1,
        2048,
        "full",
        False,
        "megatron_tflops",
        138,
    ),
    Published(
        SC21,
        "145.6B, 1536 A100",
        gpt(12288, 80, 96),
        A100,
        192,
        layout(8, 8, 24),
        2304,
        1,
        2048,
        "full",
        False,
        "megatron_tflops",
        148,
    ),
    Published(
        SC21,
        "310.1B, 1920 A100",
        gpt(16384, 96, 128),
        A100,
        240,
        layout(8, 16, 15),
        2160,
        1,
        2048,
        "full",
        False,
        "megatron_tflops",
        155,
    ),
    Published(
        SC21,
        "529.6B, 2520 A100",
        gpt(20480, 105, 128),
        A100,
        315,
        layout(8, 35, 9),
        2520,
        1,
        2048,
        "full",
        False,
        "megatron_tflops",
        163,
    ),
    Published(
        "Narayanan et al. 2021, sec. 5.1",
        "GPT-3 175B, 1024 A100 (tp8 pp16 assumed)",
        gpt(12288, 96, 96),
        A100,
        128,
        layout(8, 16, 8),
        1536,
        1,
        2048,
        "full",
        False,
        "megatron_tflops",
        140,
    ),
    Published(
        "Korthikanti et al. 2022 (Megatron-LM README)",
        "175B SP+selective, 64 A100",
        gpt(12288, 96, 96),
        A100,
        8,
        layout(8, 8, 1),
        64,
        1,
        2048,
        "selective",
        True,
        "mfu",
        0.514,
    ),
    Published(
        "Korthikanti et al. 2022 (Megatron-LM README)",
        "530B SP+selective, 280 A100",
        gpt(20480, 105, 128),
        A100,
        35,
        layout(8, 35, 1),
        280,
        1,
        2048,
        "selective",
        True,
        "mfu",
        0.560,
    ),
    Published(
        "Scao et al. 2022 (BLOOM)",
        "176B, 384 A100, 4 x 100 Gb/s a node",
        gpt(14336, 70, 112, 250880),
        (*A100, "hardware.network.nics=4", "hardware.network.nic_gbps=100"),
        48,
        layout(4, 12, 8),
        2048,
        2,
        2048,
        "full",
        False,
        "megatron_tflops",
        150,
    ),
    Published(
        "Zhang et al. 2022 (OPT)",
        "175B, 992 A100, FSDP + tp8",
        gpt(12288, 96, 96),
        A100,
        124,
        layout(8, 1, 124, shard=True),
        992,
        8,
        2048,
        "full",
        False,
        "megatron_tflops",
        147,
    ),
    Published(
        "Touvron et al. 2023 (LLaMA)",
        "65B, 2048 A100 (tp8 pp4 SP assumed)",
        (
            "model=llama-13b",
            "model.dim=8192",
            "model.n_layers=80",
            "model.n_heads=64",
            "model.ffn_dim=22016",
        ),
        A100,
        256,
        layout(8, 4, 64),
        2048,
        1,
        2048,
        "selective",
        True,
        "tokens_per_gpu",
        380,
    ),
    Published(
        "Dubey et al. 2024 (Llama 3), Table 4",
        "405B, 8192 H100",
        (
            "model=llama-13b",
            "model.dim=16384",
            "model.n_layers=126",
            "model.n_heads=128",
            "model.n_kv_heads=8",
            "model.ffn_dim=53248",
            "model.vocab_size=128256",
            "model.rope_theta=500000",
        ),
        ("hardware=h100-80g",),
        1024,
        layout(8, 16, 64, v=2),
        2048,
        1,
        8192,
        "none",
        True,
        "mfu",
        0.43,
        989.4,
    ),
]


def cluster_config(*overrides: str, nodes: int, per_node: int = 8, **parallel) -> ExperimentConfig:
    """`meshrun <overrides>` on `nodes` nodes of `per_node` GPUs under the `parallel` degrees
    and options, resolved as far as the speed model needs (no host checks: no GPU here)."""
    cfg = compose_config("train.precision=bf16", *overrides)
    given = {"dp_replicate": 1, **parallel}
    launcher = dataclasses.replace(cfg.launcher, nnodes=nodes, nproc_per_node=per_node)
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, name="auto", **given), launcher=launcher
    )


def config(row: Published) -> ExperimentConfig:
    return cluster_config(
        *row.model,
        *row.hardware,
        f"train.seq_len={row.seq}",
        f"train.global_batch_size={row.batch}",
        f"train.micro_batch_size={row.micro_batch}",
        nodes=row.nodes,
        sequence_parallel=row.sp,
        activation_checkpointing=row.ckpt,
        **row.layout,
    )


def megatron_flops_per_token(cfg: ExperimentConfig) -> float:
    """Narayanan et al. 2021, eq. 3 over B*s: 96*l*h^2*(1 + s/6h + V/16lh), the recomputed
    forward counted."""
    m, s = cfg.model, cfg.train.seq_len
    h, layers = m.dim, m.n_layers
    return 96 * layers * h * h * (1 + s / (6 * h) + m.vocab_size / (16 * layers * h))


def predicted(row: Published) -> tuple[float, float]:
    """(the paper's metric as predicted, tokens/s per GPU)."""
    cfg = config(row)
    speed = predict_speed(cfg)
    per_gpu = speed.tokens_per_s / (row.nodes * 8)
    if row.metric == "megatron_tflops":
        return per_gpu * megatron_flops_per_token(cfg) / 1e12, per_gpu
    if row.metric == "mfu":
        return speed.model_tflops_per_device / row.peak_tflops, per_gpu
    return per_gpu, per_gpu


def main() -> None:
    table = Table(title="speed model vs published throughput (no constant tuned to these)")
    for column in ("source", "run", "metric", "published", "predicted", "pred/pub", "tokens/s/GPU"):
        table.add_column(column)
    for row in ROWS:
        value, per_gpu = predicted(row)
        fmt = "{:.1%}" if row.metric == "mfu" else "{:.0f}"
        ratio = f"{value / row.published:.2f}"
        table.add_row(
            row.source,
            row.what,
            row.metric,
            fmt.format(row.published),
            fmt.format(value),
            ratio,
            f"{per_gpu:.0f}",
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
