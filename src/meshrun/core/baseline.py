"""The single-device baseline a run is compared with, and the key that identifies such a
measurement in the store (the planner's predicted speedups use the same baseline)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from meshrun.core.config import (
    CheckpointConfig,
    EvalConfig,
    ExperimentConfig,
    ParallelConfig,
    unpredicted,
)
from meshrun.core.layout import Layout
from meshrun.core.precision import matmul_precision


def n_devices(cfg: ExperimentConfig) -> int:
    if cfg.parallel.data_parallel == "dataparallel":
        return cfg.parallel.dataparallel_devices
    return Layout.of(cfg.parallel).world_size


def baseline_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """The single-device baseline a run is compared with.

    Weak scaling keeps what one device does per step (micro-batch and accumulation steps), so
    the baseline's global batch is the run's per-data-parallel-rank batch; strong scaling keeps
    the global batch. Either way the model, sequence length, precision, steps and the CPU
    threads of one rank stay the same. It does not evaluate: only its speed is wanted.
    """
    global_batch = cfg.train.global_batch_size
    if cfg.metrics.scaling == "weak":
        layout = Layout.of(cfg.parallel)
        global_batch //= layout.dp_size * max(1, n_devices(cfg) // layout.world_size)
    return dataclasses.replace(
        unpredicted(cfg),  # the run's prediction is not the baseline's
        parallel=ParallelConfig(name="single"),
        launcher=dataclasses.replace(cfg.launcher, nnodes=1, nproc_per_node=1),
        train=dataclasses.replace(
            cfg.train, global_batch_size=global_batch, progress_bar=False, eval=EvalConfig()
        ),
        checkpoint=CheckpointConfig(),  # measured afresh, never saved or resumed
        run_dir=f"{cfg.run_dir}/baseline",
        name=f"{cfg.name}-baseline",
    )


def baseline_key(cfg: ExperimentConfig) -> str:
    """Identity of a single-device measurement: everything that changes its throughput."""
    t = cfg.train
    ident = {
        "model": dataclasses.asdict(cfg.model),
        "hardware": cfg.hardware.name,
        "backend": cfg.backend.name,
        "threads": cfg.launcher.threads_per_rank,
        "data": cfg.data.name,
        "train": [
            t.steps,
            t.untimed_steps,
            t.global_batch_size,
            t.micro_batch_size,
            t.seq_len,
            t.precision,
            # appended only when on, so that the keys of uncompiled runs stay as they were
            *(["compile"] if t.compile else []),
            # fp32 on CUDA with TF32 matmuls (train.tf32): before it, none ran so
            *(["tf32"] if matmul_precision(cfg) == "tf32" else []),
            *([f"float8-{t.float8.recipe}"] if t.float8.enabled else []),
        ],
    }
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def is_own_baseline(cfg: ExperimentConfig) -> bool:
    """A single-device run is the baseline of itself."""
    return n_devices(cfg) == 1 and baseline_key(cfg) == baseline_key(baseline_config(cfg))
