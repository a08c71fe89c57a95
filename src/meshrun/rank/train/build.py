"""What a rank trains, built from a config: the model in its parallel form, AdamW, the LR
schedule, fp16's loss scale and the dtype the steps compute in. The run's ranks build theirs,
and rank 0 the single-device baseline it trains beside them (train/baseline_beside.py), the
same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrun.core.batch import n_microbatches
from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.models import build_model
from meshrun.models.loss import loss_kernel, loss_method
from meshrun.rank.parallel.compose import parallelize
from meshrun.rank.parallel.parallel_model import ParallelModel
from meshrun.rank.train.loss_scale import LossScale
from meshrun.rank.train.optim import build_lr_schedule, build_optimizer

# What a step computes in: bf16 and fp16 autocast fp32 weights (FSDP2 casts its own).
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Training:
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    loss_scale: LossScale | None  # fp16 only
    autocast_dtype: torch.dtype | None  # None: fp32, or FSDP2 casts the parameters itself


def build_training(cfg: ExperimentConfig, layout: Layout, device: torch.device, mesh) -> Training:
    tc = cfg.train
    dtype = COMPUTE_DTYPES[tc.precision]
    model = parallelize(
        build_model(cfg.model, tc.seq_len, "meta", vocab_multiple=layout.tp),
        mesh,
        layout,
        cfg.parallel,
        device,
        tc.seed,
        dtype,
        n_microbatches(cfg),
        cfg.model.pretrained,
        tc.compile,
        tc.seq_len,
        tc.float8,
        loss_method(cfg)[0],
        loss_kernel(cfg)[0],
    )
    optimizer = build_optimizer(model, tc, regroup=cfg.debug.regroup_states)
    half = dtype != torch.float32
    return Training(
        model=model,
        optimizer=optimizer,
        schedule=build_lr_schedule(optimizer, tc),
        loss_scale=LossScale(tc.loss_scale) if tc.precision == "fp16" else None,
        autocast_dtype=dtype if half and not model.casts_params else None,
    )
