"""The rules of the whole-run plan's figures (plan/run_time.py): a token budget, a price, a
failure rate and a storage rate are each a positive number, or null for their default."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail

# key -> (what it is, what to give instead)
FIGURES = {
    "plan.tokens": (
        "is the run's token budget",
        "a number of tokens > 0, e.g. 1e12, or null for train.steps x global batch x sequence",
    ),
    "plan.price_per_gpu_hour": (
        "is what one device costs an hour",
        "a price > 0, e.g. 2 (dollars a GPU-hour), or null for no cost",
    ),
    "plan.mtbf_hours": (
        "is each node's mean time between failures",
        "hours > 0, e.g. 6335 (the Llama 3 paper's), or null for that default",
    ),
    "hardware.storage_gbs": (
        "is the rate a node writes its checkpoints at",
        "GB/s > 0, e.g. 1.0, or null for what `meshrun-plan calibrate` measured here "
        "(else a published cluster's share)",
    ),
}


def check_run_plan(cfg: ExperimentConfig) -> None:
    values = {
        "plan.tokens": cfg.plan.tokens,
        "plan.price_per_gpu_hour": cfg.plan.price_per_gpu_hour,
        "plan.mtbf_hours": cfg.plan.mtbf_hours,
        "hardware.storage_gbs": cfg.hardware.storage_gbs,
    }
    for key, value in values.items():
        if value is not None and not value > 0:
            what, valid = FIGURES[key]
            fail(key, value, what, valid)
