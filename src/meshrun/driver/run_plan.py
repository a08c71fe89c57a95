"""What the plan says of a run's whole budget and its checkpoints (plan/run_time.py), for a
run: checkpoint.every_steps=auto's interval, decided before the launch (the ranks turn it
into steps at the step time they measure: rank/train/auto_interval.py); after the run, how
long its whole budget takes at the speed it measured against the plan's prediction for its
layout, and what its checkpoints were predicted to cost."""

from __future__ import annotations

from typing import Any

from meshrun.core.checkpoints import AUTO
from meshrun.core.config import ExperimentConfig, RunConfig, resolved_of, with_resolved
from meshrun.core.rank_report import AutoCheckpoint
from meshrun.plan import predict
from meshrun.plan.candidate import host_calibration
from meshrun.plan.checkpoint_cost import CheckpointCost, checkpoint_cost, storage_rates
from meshrun.plan.run_time import Failures, budget_tokens, save_interval_s, young_daly_s


def predicted_checkpoint(cfg: ExperimentConfig) -> CheckpointCost:
    """The plan's checkpoint of the run's layout, at this host's storage rates."""
    rates = storage_rates(cfg, host_calibration(cfg))
    return checkpoint_cost(cfg, predict.stage_memory(cfg), rates)


def with_checkpoint_interval(cfg: RunConfig) -> RunConfig:
    """checkpoint.every_steps=auto: the seconds between two saves and why, for the ranks."""
    if cfg.checkpoint.every_steps != AUTO:
        return cfg
    cost, failures = predicted_checkpoint(cfg), Failures.of(cfg)
    interval = save_interval_s(cost, failures)
    why = (
        f"Young/Daly, sqrt(2 x {cost.blocked_s:.3g} s a save holds training x "
        f"{failures.mtbf_s:,.4g} s between the job's failures: {failures.nodes} node(s) at "
        f"{failures.mtbf_node_hours:.4g} h, {failures.source})"
    )
    if interval > young_daly_s(cost.blocked_s, failures.mtbf_s):
        why += f", no shorter than a save's {cost.save_s:.3g} s"
    return with_resolved(cfg, checkpoint_interval_s=interval, checkpoint_interval_why=why)


def checkpoint_plan_fields(cfg: ExperimentConfig, chosen: AutoCheckpoint | None) -> dict[str, Any]:
    """The steps between saves (auto's choice, and why) and the checkpoint the plan
    predicted, for a run that saves."""
    every = cfg.checkpoint.every_steps
    if not every:
        return {}
    cost = predicted_checkpoint(cfg)
    interval = None
    if chosen is not None:
        every, interval = (
            chosen.every_steps,
            chosen.describe(resolved_of(cfg).checkpoint_interval_why or ""),
        )
    elif every == AUTO:  # no log step came after enough timed steps
        every, interval = None, "auto: not chosen (too few timed steps); saved at the end only"
    return {
        "checkpoint_every_steps": every,
        "checkpoint_interval": interval,
        "predicted_checkpoint_bytes_per_rank": cost.bytes_per_rank,
        "predicted_checkpoint_blocked_s": cost.blocked_s,
        "predicted_checkpoint_save_s": cost.save_s,
    }


def budget_fields(
    cfg: ExperimentConfig, tokens_per_s: float | None, predicted_tokens_per_s: float | None
) -> dict[str, Any]:
    """The run's whole budget (plan.tokens, else its own steps) at the speed it measured and
    at the speed the plan predicted for its layout."""
    tokens = budget_tokens(cfg)
    return {
        "tokens_budget": tokens,
        "measured_budget_s": tokens / tokens_per_s if tokens_per_s else None,
        "predicted_budget_s": tokens / predicted_tokens_per_s if predicted_tokens_per_s else None,
    }
