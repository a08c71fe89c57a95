"""A step's batch on one data-parallel rank: its share of the global batch and the
micro-batches it runs them in (a pipeline's m, else gradient accumulation), from a config
alone: the rules, the planner, the record and the ranks count them alike."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout


def local_batch_size(cfg: ExperimentConfig) -> int:
    """The samples one data-parallel rank trains on a step: its share of the global batch
    (a data-parallel size not yet resolved, a -1 degree in it, counts as 1)."""
    return cfg.train.global_batch_size // max(1, Layout.of(cfg.parallel).dp_size)


def n_microbatches(cfg: ExperimentConfig) -> int:
    """Micro-batches of one step on a data-parallel rank: its share of the global batch over
    `train.micro_batch_size` (the one knob; a pipeline's m, else gradient accumulation)."""
    return max(1, local_batch_size(cfg) // cfg.train.micro_batch_size)
