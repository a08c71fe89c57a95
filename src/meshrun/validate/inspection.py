"""What looks inside a run's steps (debug.profile_steps, memory_snapshot, slow_rank,
metrics.straggler_threshold) names steps, ranks and devices the run has."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.validate.launcher import check_rank_of_run


def check_inspection(cfg: ExperimentConfig, world: int) -> None:
    debug, steps = cfg.debug, cfg.train.steps
    profiled = list(debug.profile_steps)
    if profiled and (len(profiled) != 2 or not 0 <= profiled[0] <= profiled[1] < steps):
        fail(
            "debug.profile_steps",
            profiled,
            f"is [first, last] of the steps to trace, within the run's {steps} steps",
            f"e.g. [{min(3, steps - 1)},{min(4, steps - 1)}] (0..{steps - 1}), or []",
        )
    if debug.memory_snapshot and cfg.hardware.device_type != "cuda":
        fail(
            "debug.memory_snapshot",
            True,
            f"records CUDA's allocator, and hardware={cfg.hardware.name} runs on "
            f"{cfg.hardware.device_type}",
            "false here; true on a CUDA hardware profile",
        )
    check_rank_of_run("debug.slow_rank", debug.slow_rank, world)
    if debug.slow_rank is not None and world == 1:
        fail("debug.slow_rank", debug.slow_rank, "a single rank waits for nobody", "null")
    if debug.slow_rank is not None and cfg.hardware.device_type != "cpu":
        fail(
            "debug.slow_rank",
            debug.slow_rank,
            "slows a rank's host, and names the slow rank by CPU busy time: CPU ranks only "
            f"(hardware={cfg.hardware.name} runs on {cfg.hardware.device_type})",
            "null here; a CPU hardware profile to see a straggler",
        )
    if not -1 < debug.grad_error < 1:
        fail(
            "debug.grad_error",
            debug.grad_error,
            "scales the last parameter's gradient by 1 + grad_error (a planted error)",
            "a number between -1 and 1 (0.01 for 1%), 0 for none",
        )
    if debug.slow_factor < 1:
        fail(
            "debug.slow_factor",
            debug.slow_factor,
            "is how many times as long the slow rank computes",
            "a number >= 1 (e.g. 1.5)",
        )
    if cfg.metrics.straggler_threshold <= 1:
        fail(
            "metrics.straggler_threshold",
            cfg.metrics.straggler_threshold,
            "is the slowest rank's busy time over the others' median that flags it",
            "a number > 1 (e.g. 1.15)",
        )
