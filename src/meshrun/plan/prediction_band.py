"""How sure a predicted run time is: the range of measured over predicted time that the speed
model has shown, as a band around each row's time. On a host whose calibration has runs
behind it, those runs' own spread (tools/plan/run_table.py reads them from the store, the
trials among them); elsewhere the spread docs/planner.md and docs/architecture.md record for
the model as it stands."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """Measured over predicted time: the run takes `low` to `high` times its prediction."""

    low: float
    high: float
    source: str

    def around(self, seconds: float) -> tuple[float, float]:
        return seconds * self.low, seconds * self.high

    def describe(self) -> str:
        return f"measured/predicted {self.low:.2f}-{self.high:.2f} ({self.source})"


# GPUs: predicted against published runs (`python -m benchmarks.speed_vs_published`,
# docs/architecture.md): predicted over published speed, which is the published time over
# the predicted, 0.89 (LLaMA's 65B) to 1.22 (OPT's 175B, counting its recomputation).
PUBLISHED = Band(0.89, 1.22, "the speed model against 11 published GPU runs, docs/architecture.md")
# CPU ranks (`python -m benchmarks.planner_accuracy --only speed`, docs/planner.md): 13 layouts
# of model=small on a 2-vCPU host shared with other work, twice on 2026-12-06; each layout's
# measured step time over the prediction, the lowest and the highest of both runs.
CPU_FROM = "13 layouts of model=small on a shared 2-vCPU host, docs/planner.md"
CPU_UNCALIBRATED = Band(0.41, 3.2, CPU_FROM)
CPU_CALIBRATED = Band(0.50, 3.3, f"calibrated: {CPU_FROM}")
MIN_RUNS = 2  # of a calibration, for their own spread to stand for it


def documented_band(device_type: str, calibrated: bool) -> Band:
    if device_type == "cuda":
        return PUBLISHED
    return CPU_CALIBRATED if calibrated else CPU_UNCALIBRATED


def measured_band(ratios: list[float], calibrated_at: str) -> Band | None:
    """The spread of measured over predicted step times of the runs predicted with the
    calibration of `calibrated_at`; None under MIN_RUNS of them."""
    if len(ratios) < MIN_RUNS:
        return None
    source = f"{len(ratios)} runs on this host's calibration of {calibrated_at}"
    return Band(min(ratios), max(ratios), source)
