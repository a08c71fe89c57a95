"""The plan of a run (RunPlan): everything the resolution derived from the experiment's
settings, once, before the launch (driver/resolve.py). And what the plan says of a run's
whole budget and its checkpoints (plan/run_time.py): checkpoint.every_steps=auto's interval,
decided before the launch (the ranks turn it into steps at the step time they measure:
rank/train/auto_interval.py); after the run, how long its whole budget takes at the speed it
measured against the plan's prediction for its layout, and what its checkpoints were
predicted to cost."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from meshrun.core.checkpoints import AUTO
from meshrun.core.config import (
    ExperimentConfig,
    RunConfig,
    RunPrediction,
    resolved_of,
    settings_of,
    with_resolved,
)
from meshrun.core.layout import Layout
from meshrun.core.naming import layout_name
from meshrun.core.rank_report import AutoCheckpoint
from meshrun.plan.run_prediction import prediction_of
from meshrun.plan.run_time import Failures, budget_tokens, save_interval_s, young_daly_s


@dataclass(frozen=True)
class RunPlan:
    """One run's plan: `settings` the experiment as composed, untouched (its `auto`s, -1
    degree and nulls as the user left them); `config` what the ranks get, every degree
    filled, with `config.resolved` what no user sets (the data cache, what was read from a
    pretrained directory, the prediction, the baseline beside the run); `baseline` how the
    baseline is to be had (driver/baseline.baseline_plan)."""

    settings: ExperimentConfig
    config: RunConfig
    baseline: str

    @property
    def prediction(self) -> RunPrediction | None:
        return self.config.resolved.prediction

    @property
    def ranks(self) -> int:
        return self.config.launcher.nproc_per_node * self.config.launcher.nnodes

    def as_dict(self) -> dict[str, Any]:
        """What `meshrun-plan show=resolved` prints: the decisions, then the settings the
        resolution filled (key: [as given, as resolved])."""
        c, r = self.config, self.config.resolved
        return {
            "name": c.name,
            "hardware": c.hardware.name,
            "device_type": c.hardware.device_type,
            "backend": c.backend.name,
            "ranks": self.ranks,
            "nodes": c.launcher.nnodes,
            "ranks_per_node": c.launcher.nproc_per_node,
            "threads_per_rank": c.launcher.threads_per_rank,
            "layout": layout_name(c),
            "degrees": Layout.of(c.parallel).degrees(),
            "global_batch_size": c.train.global_batch_size,
            "batch_derived": r.batch_derived,
            "micro_batch_size": c.train.micro_batch_size,
            "precision": str(c.train.precision),
            "precision_auto": r.precision_auto,
            "baseline": self.baseline,
            "data_cache": r.data_cache,
            "model_read_from": r.model_read_from,
            "checkpoint_interval_s": r.checkpoint_interval_s,
            "prediction": dataclasses.asdict(self.prediction) if self.prediction else None,
            "filled": filled(plain(self.settings), plain(c)),
        }


def plain(cfg: ExperimentConfig) -> dict[str, Any]:
    """The settings of `cfg` as plain values (enums by name), without what was resolved."""
    return OmegaConf.to_container(OmegaConf.structured(settings_of(cfg)), enum_to_str=True)


def filled(given: dict[str, Any], resolved: dict[str, Any], prefix: str = "") -> dict[str, list]:
    """The dotted keys whose value the resolution changed: [as given, as resolved]."""
    changed: dict[str, list] = {}
    for key, value in resolved.items():
        before = given.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            changed |= filled(before, value, f"{prefix}{key}.")
        elif value != before:
            changed[f"{prefix}{key}"] = [before, value]
    return changed


def with_checkpoint_interval(cfg: RunConfig, prediction: RunPrediction) -> RunConfig:
    """checkpoint.every_steps=auto: the seconds between two saves and why, for the ranks,
    from the checkpoint the run's prediction holds."""
    if cfg.checkpoint.every_steps != AUTO:
        return cfg
    cost, failures = prediction, Failures.of(cfg)
    interval = save_interval_s(cost.checkpoint_blocked_s, cost.checkpoint_save_s, failures)
    why = (
        f"Young/Daly, sqrt(2 x {cost.checkpoint_blocked_s:.3g} s a save holds training x "
        f"{failures.mtbf_s:,.4g} s between the job's failures: {failures.nodes} node(s) at "
        f"{failures.mtbf_node_hours:.4g} h, {failures.source})"
    )
    if interval > young_daly_s(cost.checkpoint_blocked_s, failures.mtbf_s):
        why += f", no shorter than a save's {cost.checkpoint_save_s:.3g} s"
    return with_resolved(cfg, checkpoint_interval_s=interval, checkpoint_interval_why=why)


def checkpoint_plan_fields(cfg: ExperimentConfig, chosen: AutoCheckpoint | None) -> dict[str, Any]:
    """The steps between saves (auto's choice, and why) and the checkpoint the plan
    predicted, for a run that saves."""
    every = cfg.checkpoint.every_steps
    if not every:
        return {}
    cost = prediction_of(cfg)
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
        "predicted_checkpoint_bytes_per_rank": cost.checkpoint_bytes_per_rank,
        "predicted_checkpoint_blocked_s": cost.checkpoint_blocked_s,
        "predicted_checkpoint_save_s": cost.checkpoint_save_s,
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
