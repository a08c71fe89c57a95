"""What rank 0 hands the driver once the ranks are done: the figures only the ranks know
(each rank's memory, the bubble, the split `pp_layers=auto` chose, the baseline's
steps, ...). One typed value, pickled back by every launcher (torch elastic's return values,
submitit's result file, rank 0 itself under torchrun), so a field the driver reads is a
field the rank wrote: a misspelt one fails at type-check and test time, not as a silent None.
Per-step figures travel apart, in metrics.jsonl (rank/metrics/log.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshrun.core.run_files.metrics import StepRow


@dataclass(frozen=True)
class StageSplit:
    """The split `parallel.pp_layers=auto` chose and each stage's cost under it: seconds of
    one micro-batch's forward and backward on the stage's slowest rank, as probed."""

    counts: list[int]
    stage_costs_s: list[float]
    block_s: float  # one block on the slowest rank: the finest step a split can take


@dataclass(frozen=True)
class CheckpointSave:
    """One checkpoint rank 0 saved: the training time it blocked, and to its last byte."""

    step: int
    blocked_s: float
    total_s: float | None


@dataclass(frozen=True)
class AutoCheckpoint:
    """checkpoint.every_steps=auto's choice (rank/train/auto_interval.py): the steps between
    saves, from the plan's seconds between them at the step time the ranks measured (the
    median of their first timed steps)."""

    every_steps: int
    step_time_s: float
    interval_s: float

    def describe(self, why: str) -> str:
        """What it chose and why; `why`: the plan's reason for the interval."""
        steps = "steps" if self.every_steps > 1 else "step"
        return (
            f"every {self.every_steps} {steps}: {self.interval_s:.3g} s between saves ({why}) at "
            f"{self.step_time_s:.3g} s a step (the median of the first timed steps)"
        )


@dataclass(frozen=True)
class ReplicaFailure:
    """A torchft replica group that ended before the run (parallel.fault_tolerance): which,
    the rank whose failure ended it, its start that ended (0: the first), how, and when
    (seconds from the launch)."""

    replica: int
    rank: int
    attempt: int
    error: str
    at_s: float


@dataclass(frozen=True)
class Rollback:
    """A loss spike train.guard rolled the run back from: the step and its loss against the
    window's mean and deviation, the checkpoint's step it went back to, and the batches it
    skipped (first and last index, both included)."""

    step: int
    loss: float
    mean: float
    std: float
    restored_step: int
    skipped_batches: tuple[int, int]


@dataclass(frozen=True)
class RankReport:
    # each rank's peak, with its breakdown where measured; parallel=dataparallel's one
    # process: each of its devices', in device order (its model state on the first)
    memory_per_rank: list[dict[str, int]]
    fingerprint: dict[str, Any]  # where rank 0 ran (core/hardware.host_fingerprint)
    resumed_from_step: int | None = None  # the checkpoint the ranks restored
    requeues: int = 0  # SLURM requeued the job, which resumed from its checkpoint
    slurm_job_id: str | None = None  # launcher=slurm's job
    host_per_rank: list[str] | None = None  # the node each rank ran on
    pipeline_bubble_per_rank: list[float] | None = None
    pp_split: StageSplit | None = None  # parallel.pp_layers=auto
    pretrained_read_bytes_per_rank: list[int] | None = None  # model.pretrained
    # the timed steps (step, loss, time) of the baseline beside the run, trained by rank 0
    baseline_steps: list[StepRow] | None = None
    host_other_cpu_share: float | None = None  # None where a rank could not measure it
    compile_s: float | None = None  # train.compile: the slowest rank's
    checkpoint_saves: list[CheckpointSave] | None = None
    auto_checkpoint: AutoCheckpoint | None = None  # checkpoint.every_steps=auto's choice
    busy_per_rank: list[float] | None = None  # seconds a timed step, median (CPU ranks)
    rollbacks: list[Rollback] | None = None  # train.guard.spike's
    replica_failures: list[ReplicaFailure] | None = None  # torchft's, from the driver
