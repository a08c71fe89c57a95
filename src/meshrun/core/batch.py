"""A step's batch on one data-parallel rank: how many micro-batches it runs (a pipeline's m,
else gradient accumulation), from a config alone."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig


def n_microbatches(cfg: ExperimentConfig) -> int:
    """Micro-batches of one step on a data-parallel rank: its share of the global batch over
    `train.micro_batch_size` (the one knob; a pipeline's m, else gradient accumulation)."""
    p = cfg.parallel
    local = cfg.train.global_batch_size // max(1, p.dp_replicate * p.dp_shard)
    return max(1, local // cfg.train.micro_batch_size)
