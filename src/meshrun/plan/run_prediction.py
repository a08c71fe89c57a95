"""The plan's prediction for a run's own layout (core/config.RunPrediction): made once, by the
resolution, with the speed of the candidate the memory check judged, and carried by the
run's config to its record, which reads it. A config derived for another layout (the
baseline's, a split the ranks chose) carries none and is predicted where it is recorded."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig, RunPrediction, resolved_of
from meshrun.plan import predict
from meshrun.plan.candidate import host_calibration, host_flops
from meshrun.plan.checkpoint_cost import CheckpointCost, checkpoint_cost, storage_rates
from meshrun.plan.speed import SpeedPrediction


def predict_checkpoint(cfg: ExperimentConfig) -> CheckpointCost:
    """The plan's checkpoint of the run's layout, at this host's storage rates."""
    rates = storage_rates(cfg, host_calibration(cfg))
    return checkpoint_cost(cfg, predict.stage_memory(cfg), rates)


def predict_run(cfg: ExperimentConfig, speed: SpeedPrediction | None) -> RunPrediction:
    """Each rank's memory, the trace a run records, and `speed` (the speed model's step on
    this host's calibration where plan.calibration finds one), and for a run that saves, its
    checkpoint."""
    calibration = host_calibration(cfg)
    traced = predict.traced(cfg)
    saves = predict_checkpoint(cfg) if cfg.checkpoint.every_steps else None
    return RunPrediction(
        memory=[m.as_dict() for m in predict.memory(cfg)],
        traced=[m.as_dict() for m in traced] if traced else None,
        step_time_s=speed.step_time_s if speed else None,
        tokens_per_s=speed.tokens_per_s if speed else None,
        step_parts=speed.step_parts() if speed else None,
        calibrated_at=calibration.created_at if calibration else None,
        checkpoint_bytes_per_rank=saves.bytes_per_rank if saves else None,
        checkpoint_blocked_s=saves.blocked_s if saves else None,
        checkpoint_save_s=saves.save_s if saves else None,
    )


def prediction_of(cfg: ExperimentConfig) -> RunPrediction:
    """The prediction `cfg` carries from its resolution, else one made now."""
    carried = resolved_of(cfg).prediction
    if carried is not None:
        return carried
    return predict_run(cfg, predict.speed(cfg, host_flops(cfg), host_calibration(cfg)))
