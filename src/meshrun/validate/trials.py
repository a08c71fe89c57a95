"""Rules of plan.trials: measured trials of the planner's first layouts (driver/trials.py),
which start several launches of this host's ranks one after another before the run."""

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
    if cfg.launcher.name != "local" or attached_rank() is not None:
        how = (
            "under torchrun" if attached_rank() is not None else f"on launcher={cfg.launcher.name}"
        )
        fail(
            "plan.trials",
            plan.trials,
            f"launches this host's ranks once per trial, which it cannot do {how}",
            "launcher=local; elsewhere run `meshrun-plan` and a sweep over its first rows",
        )
    if cfg.checkpoint.resume is not None:
        fail(
            "plan.trials",
            plan.trials,
            "chooses the layout of a new run, and checkpoint.resume continues one",
            "plan.trials=0 with the layout the trials chose (its results.json's overrides)",
        )
