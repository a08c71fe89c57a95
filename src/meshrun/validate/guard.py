"""What guards the run's steps (train.guard) and what corrupts one on purpose
(debug.corrupt_step) name numbers and steps the run has."""

from __future__ import annotations

from meshrun.core.choices import CORRUPT_MODES
from meshrun.core.config import DebugConfig, ExperimentConfig, corrupted_steps
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
    _check_corruption(debug, steps)
    if guard.spike:
        _check_spike(cfg)


def _check_corruption(debug: DebugConfig, steps: int) -> None:
    given = debug.corrupt_step if isinstance(debug.corrupt_step, list) else [debug.corrupt_step]
    modes = debug.corrupt_mode if isinstance(debug.corrupt_mode, list) else [debug.corrupt_mode]
    if debug.corrupt_step is not None and len(modes) not in (1, len(given)):
        fail(
            "debug.corrupt_mode",
            debug.corrupt_mode,
            f"names {len(modes)} modes for {len(given)} corrupted steps",
            "one mode for all of them, or one for each",
        )
    for mode in modes:
        choice("debug.corrupt_mode", str(mode), CORRUPT_MODES)
    for step in corrupted_steps(debug):
        if not isinstance(step, int) or not 0 <= step < steps:
            fail(
                "debug.corrupt_step",
                debug.corrupt_step,
                f"{step} is outside the run's {steps} steps",
                f"steps in 0..{steps - 1} (one, or a list), or null",
            )


def _check_spike(cfg: ExperimentConfig) -> None:
    guard = cfg.train.guard
    if not cfg.checkpoint.every_steps:
        fail(
            "train.guard.spike",
            True,
            "rolls the run back to its last checkpoint, and the run saves none",
            "checkpoint.every_steps=N as well (e.g. 10)",
        )
    if guard.spike_sigma <= 0:
        fail(
            "train.guard.spike_sigma",
            guard.spike_sigma,
            "is how many standard deviations above the window's mean loss a spike is",
            "a number > 0 (default 5)",
        )
    if guard.spike_ratio is not None and guard.spike_ratio <= 1:
        fail(
            "train.guard.spike_ratio",
            guard.spike_ratio,
            "is how many times the window's mean loss a spike exceeds",
            "a number > 1 (e.g. 2), or null to judge by spike_sigma",
        )
    if guard.spike_window < 8:
        fail(
            "train.guard.spike_window",
            guard.spike_window,
            "is the steps a loss is judged against (half of it before any is judged)",
            "an integer >= 8 (default 20)",
        )
    if guard.skip_batches < 0:
        fail(
            "train.guard.skip_batches",
            guard.skip_batches,
            "is how many batches past the spike's a rollback skips too",
            "an integer >= 0",
        )
    if guard.max_rollbacks < 1:
        fail(
            "train.guard.max_rollbacks",
            guard.max_rollbacks,
            "is how many rollbacks a run may take before a spike stops it",
            "an integer >= 1 (default 3)",
        )
