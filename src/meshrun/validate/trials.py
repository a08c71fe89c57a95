"""Rules of plan.trials: measured trials of the planner's first layouts (driver/trials.py),
which launch the ranks (here, or as SLURM jobs) once a trial, one after another, before the
run."""

from __future__ import annotations

from meshrun.core.attached import attached_rank
from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail, positive


def check_trials(cfg: ExperimentConfig) -> None:
    plan = cfg.plan
    if plan.trials < 0:
        fail("plan.trials", plan.trials, "is how many layouts to try", "0 (none) or more")
    positive("plan.trial_steps", plan.trial_steps)
    if plan.trials_only and not plan.trials:
        fail(
            "plan.trials_only",
            True,
            "stops after the trials, and plan.trials is 0",
            "plan.trials=K (K >= 1) with it, or plan.trials_only=false",
        )
    if not plan.trials:
        return
    if cfg.parallel.name != "auto":
        fail(
            "plan.trials",
            plan.trials,
            f"tries the planner's first layouts, and parallel={cfg.parallel.name} fixes one",
            "parallel=auto with it, or plan.trials=0",
        )
    if attached_rank() is not None:
        fail(
            "plan.trials",
            plan.trials,
            "launches the ranks once per trial, which it cannot do under torchrun",
            "launcher=local or launcher=slurm; under torchrun a sweep over `meshrun-plan`'s "
            "first rows",
        )
    if not cfg.launcher.waits_for_ranks():
        fail(
            "launcher.wait",
            False,
            "returns once a job is submitted, and plan.trials waits for each trial's job to "
            "choose the layout",
            "launcher.wait=true with plan.trials",
        )
    if cfg.checkpoint.resume is not None:
        fail(
            "plan.trials",
            plan.trials,
            "chooses the layout of a new run, and checkpoint.resume continues one",
            "plan.trials=0 with the layout the trials chose (its results.json's overrides)",
        )
