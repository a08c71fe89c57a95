"""What guards the run's steps (train.guard) and what corrupts one on purpose
(debug.corrupt_step) name numbers and steps the run has."""

from __future__ import annotations

from meshrun.core.choices import CORRUPT_MODES
from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import choice, fail


def check_guard(cfg: ExperimentConfig) -> None:
    guard, debug, steps = cfg.train.guard, cfg.debug, cfg.train.steps
    if guard.max_skipped < 1:
        fail(
            "train.guard.max_skipped",
            guard.max_skipped,
            "is how many non-finite steps in a row stop the run",
            "an integer >= 1 (default 10)",
        )
    if debug.corrupt_step is not None and not 0 <= debug.corrupt_step < steps:
        fail(
            "debug.corrupt_step",
            debug.corrupt_step,
            f"outside the run's {steps} steps",
            f"0..{steps - 1}, or null",
        )
    choice("debug.corrupt_mode", debug.corrupt_mode, CORRUPT_MODES)
