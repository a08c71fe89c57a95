"""A run as the driver holds it between its ranks and its record: who it is and how it ended
(RunMeta), rank 0's steps from metrics.jsonl and its RankReport. driver/results.assemble
turns one into a RunRecord; a failed run is the same value with its error and the steps
its ranks finished."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from meshrun.core.rank_report import RankReport
from meshrun.driver.trial_ranking import Trial

# `trials`: plan.trials_only's verdict, recorded without a run of its own (driver/trials.py)
Role = Literal["run", "baseline", "trial", "trials"]
Status = Literal["completed", "failed", "interrupted"]
# How the single-device baseline was had: trained beside the run (`fresh`), reused from the
# store (`stored`), measured by a launch of its own after the run (`after`), or none needed
# (`own`: a single-device run is its own baseline).
BaselineMode = Literal["fresh", "stored", "after", "own"]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class RunMeta:
    """A run's identity (kept by a resume from its checkpoints) and how the attempt ended."""

    run_id: str = field(default_factory=new_run_id)
    created_at: str = field(default_factory=utc_now)
    role: Role = "run"
    given_overrides: list[str] = field(default_factory=list)  # what `run again` repeats
    resumed_from_step: int | None = None
    resumed_from_checkpoint: str | None = None  # the checkpoint it was resumed from
    parent_run_id: str | None = None  # a new run from another run's checkpoint: that run
    status: Status = "completed"
    error: str | None = None
    failed_rank: int | None = None
    traceback: str | None = None  # the failing rank's, where it raised
    duration_s: float | None = None
    baseline_mode: BaselineMode | None = None
    baseline_age_s: float | None = None  # `stored`: how old the reused baseline is
    export_path: str | None = None  # checkpoint.export: the final model, whole
    trial_of: str | None = None  # a trial (plan.trials): the run it chose the layout for
    trials: list[Trial] | None = None  # the run that trials chose: each of them


@dataclass
class Measured:
    """What one launch measured; `report` is None where rank 0 returned none (a failure)."""

    meta: RunMeta
    steps: list[dict[str, Any]]
    report: RankReport | None = None

    @property
    def ok(self) -> bool:
        return self.meta.status == "completed"
