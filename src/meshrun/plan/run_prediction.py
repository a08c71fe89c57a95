"""The plan's prediction for a run's own layout (core/config.Prediction): made once, by the
resolution, with the speed of the candidate the memory check judged, and carried by the
run's config to its record, which reads it. A config derived for another layout (the
baseline's, a split the ranks chose) carries none and is predicted where it is recorded."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig, Prediction, resolved_of
from meshrun.plan import predict
from meshrun.plan.candidate import host_calibration, host_flops
from meshrun.plan.speed import SpeedPrediction


def predict_run(cfg: ExperimentConfig, speed: SpeedPrediction | None) -> Prediction:
    """Each rank's memory, the trace a run records, and `speed` (the speed model's step on
    this host's calibration where plan.calibration finds one)."""
    calibration = host_calibration(cfg)
    traced = predict.traced(cfg)
    return Prediction(
        memory=[m.as_dict() for m in predict.memory(cfg)],
        traced=[m.as_dict() for m in traced] if traced else None,
        step_time_s=speed.step_time_s if speed else None,
        tokens_per_s=speed.tokens_per_s if speed else None,
        step_parts=speed.step_parts() if speed else None,
        calibrated_at=calibration.created_at if calibration else None,
    )


def prediction_of(cfg: ExperimentConfig) -> Prediction:
    """The prediction `cfg` carries from its resolution, else one made now."""
    carried = resolved_of(cfg).prediction
    if carried is not None:
        return carried
    return predict_run(cfg, predict.speed(cfg, host_flops(cfg), host_calibration(cfg)))
