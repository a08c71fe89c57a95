"""train.loss names a loss the layout can run (models/loss.py says which and why not)."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.models.loss import chunked_refused, vocab_parallel_refused

REFUSALS = {"chunked": chunked_refused, "vocab_parallel": vocab_parallel_refused}


def check_loss(cfg: ExperimentConfig) -> None:
    refused = REFUSALS.get(str(cfg.train.loss))
    why = refused(cfg) if refused is not None else None
    if why is not None:
        fail(
            "train.loss",
            str(cfg.train.loss),
            why,
            "auto (it picks what the layout can run) or full",
        )
