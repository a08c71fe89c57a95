"""The summary's rows of the plan kept honest (driver/run_plan.py): the run's whole budget
at the speed it measured against the plan's time for its layout, and its checkpoints (how
often it saved, `auto`'s choice and why; what a save cost against the plan's prediction)."""

from __future__ import annotations

from meshrun.core.record import RunRecord
from meshrun.core.record_parts import Checkpoints
from meshrun.driver.trial_ranking import calibration_said

MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0


def duration(seconds: float) -> str:
    """In the unit a reader budgets in: seconds, minutes, hours or days (meshrun-plan's too)."""
    for unit, size, limit in (("s", 1, 90), ("min", MINUTE, 90 * MINUTE), ("h", HOUR, 2 * DAY)):
        if seconds < limit:
            return f"{seconds / size:.3g} {unit}"
    return "never" if seconds == float("inf") else f"{seconds / DAY:,.3g} days"


def budget_rows(record: RunRecord) -> list[tuple[str, str]]:
    """The run's budget at its measured speed and at the predicted one, saying what the
    prediction rests on (this host's calibration or the profile's rates)."""
    r = record.prediction
    if r.measured_budget_s is None or r.tokens_budget is None:
        return []
    said = f"{r.tokens_budget:.3g} tokens: {duration(r.measured_budget_s)} at the measured speed"
    if r.predicted_budget_s:
        ratio = r.measured_budget_s / r.predicted_budget_s
        on = calibration_said([r.predicted_calibrated_at], record.model, record.world_size or 1)
        said += f", {duration(r.predicted_budget_s)} predicted ({ratio:.2f}x; {on})"
    return [("full budget", said)]


def checkpoint_rows(r: Checkpoints) -> list[tuple[str, str]]:
    if r.checkpoint_every_steps is None and r.checkpoint_interval is None:
        return []
    every = r.checkpoint_interval or f"every {r.checkpoint_every_steps} steps"
    rows = [("checkpoint interval", every)]
    if r.checkpoint_blocked_s is not None and r.predicted_checkpoint_blocked_s is not None:
        rows.append(
            (
                "  a save: held training, to disk",
                f"{r.checkpoint_blocked_s:.3g} s, {r.checkpoint_save_s:.3g} s (predicted "
                f"{r.predicted_checkpoint_blocked_s:.3g} s, {r.predicted_checkpoint_save_s:.3g} s)",
            )
        )
    return rows
