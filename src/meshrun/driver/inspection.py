"""What a run saw inside its steps, into its record: the profiled steps' traces summarised
per rank (debug.profile_steps), the slowest rank against the median, the steps the guard
skipped and the spikes it rolled the run back from (rank/train/guard.py), the torchft replicas
that failed and the steps trained without them."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.core.rank_report import RankReport
from meshrun.core.run_files.metrics import StepRow
from meshrun.core.run_files.profiles import summarize_run
from meshrun.core.step_stats import slowest


def timed_step_times(steps: list[StepRow]) -> list[float]:
    """The timed steps' times, the profiled ones and the one after left out (tracing slows
    them; rank/profiling.py)."""
    return [
        r.step_time_s
        for r in steps
        if r.step_time_s is not None and not (r.profiled or r.after_profile)
    ]


def profile_fields(cfg: ExperimentConfig, steps: list[StepRow]) -> dict[str, Any]:
    profiled = cfg.debug.profile_steps
    if not profiled:
        return {}
    traced = [r.step_time_s for r in steps if r.profiled and r.step_time_s]
    others = timed_step_times(steps)
    overhead = None
    if traced and others:
        overhead = statistics.median(traced) / statistics.median(others) - 1
    world = Layout.of(cfg.parallel).world_size
    return {
        "profiled_steps": list(profiled),
        "profile_overhead": overhead,
        "profile": [p.as_dict() for p in summarize_run(cfg.run_dir, world)] or None,
    }


# Timed steps below which a slowdown is reported but no rank is called a straggler: one or two
# steps' CPU times are one sample of the ranks' noise (a plain ddp run of 1 timed step read
# rank 1 at 1.18x, over the 1.15 threshold).
MIN_JUDGED_STEPS = 3


def straggler_fields(
    cfg: ExperimentConfig, report: RankReport | None, timed_steps: int
) -> dict[str, Any]:
    """The rank with the most busy time a step (its median over the timed steps) against the
    median of the others; named a straggler above metrics.straggler_threshold, over
    MIN_JUDGED_STEPS timed steps or more."""
    busy = report.busy_per_rank if report else None
    if not busy or len(busy) < 2:
        return {}
    rank, others = slowest(busy)
    slowdown = busy[rank] / others
    threshold = cfg.metrics.straggler_threshold
    straggler = None
    if slowdown > threshold and timed_steps >= MIN_JUDGED_STEPS:
        straggler = (
            f"rank {rank} is busy {slowdown:.2f}x as long a step as the median of the other "
            f"ranks (metrics.straggler_threshold={threshold:g}): the others wait for it"
        )
    return {
        "busy_per_rank": busy,
        "slowest_rank": rank,
        "slowest_rank_slowdown": slowdown,
        "straggler": straggler,
    }


def skipped_fields(steps: list[StepRow]) -> dict[str, Any]:
    """The steps whose global gradient norm was not finite: every rank skipped them (fp16's
    overflows among them)."""
    norms = [(r.step, r.grad_norm) for r in steps]
    skipped = [step for step, norm in norms if norm is not None and not math.isfinite(norm)]
    return {"skipped_steps": skipped or None, "steps_skipped": len(skipped)}


def replica_fields(
    cfg: ExperimentConfig, report: RankReport | None, steps: list[StepRow]
) -> dict[str, Any]:
    """torchft's story of the run: the replicas that failed, the steps the others trained
    without them ([step, replicas] each), the steps trained again."""
    if cfg.parallel.fault_tolerance == "none":
        return {}
    failures = report.replica_failures if report else None
    replicas = cfg.parallel.dp_replicate
    fewer = [
        [r.step, r.replicas] for r in steps if r.replicas is not None and r.replicas < replicas
    ]
    return {
        "replica_failures": [dataclasses.asdict(f) for f in failures or []],
        "replica_failure_count": len(failures or []),
        "steps_with_fewer_replicas": len(fewer),
        "fewer_replica_steps": fewer,
        "retried_steps": [r.step for r in steps if r.retried],
    }


def rollback_fields(report: RankReport | None) -> dict[str, Any]:
    rollbacks = report.rollbacks if report else None
    if not rollbacks:
        return {}
    return {
        "rollbacks": [dataclasses.asdict(r) for r in rollbacks],
        "rollback_count": len(rollbacks),
    }
