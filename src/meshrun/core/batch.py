"""A step's batch on one data-parallel rank: its share of the global batch and the
micro-batches it runs them in (a pipeline's m, else gradient accumulation), from a config
alone: the rules, the planner, the record and the ranks count them alike. The global batch a
user leaves null is derived from the layout here too."""

from __future__ import annotations

import math

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout

# The default experiment's global batch where every rank's share divides it (1 to 4 ranks
# at micro-batch 2): with more ranks it grows to the next multiple they divide.
DEFAULT_GLOBAL_BATCH = 8


def derived_global_batch(micro_batch_size: int, dp: int) -> int:
    """DEFAULT_GLOBAL_BATCH rounded up to a multiple of micro_batch_size x dp: every
    data-parallel rank runs whole micro-batches (dp 3 at micro 2: 12; dp 8: 16)."""
    unit = micro_batch_size * dp
    return math.ceil(DEFAULT_GLOBAL_BATCH / unit) * unit


def global_batch_size(cfg: ExperimentConfig) -> int:
    """train.global_batch_size, or where null the one resolution derives for the layout (a
    data-parallel size not yet resolved, a -1 degree in it, counts as 1)."""
    given = cfg.train.global_batch_size
    dp = max(1, Layout.of(cfg.parallel).dp_size)
    return derived_global_batch(cfg.train.micro_batch_size, dp) if given is None else given


def local_batch_size(cfg: ExperimentConfig) -> int:
    """The samples one data-parallel rank trains on a step: its share of the global batch
    (a data-parallel size not yet resolved, a -1 degree in it, counts as 1)."""
    return global_batch_size(cfg) // max(1, Layout.of(cfg.parallel).dp_size)


def n_microbatches(cfg: ExperimentConfig) -> int:
    """Micro-batches of one step on a data-parallel rank: its share of the global batch over
    `train.micro_batch_size` (the one knob; a pipeline's m, else gradient accumulation)."""
    return max(1, local_batch_size(cfg) // cfg.train.micro_batch_size)
