"""The run against its single-device baseline: the speedup, its spread over the rounds where
the two alternated, the scaling efficiency; and what flags a run's figures as untrustworthy
(an efficiency above 1 + the noise, a busy host, a CPU peak traced before the optimizer's
state existed)."""

from __future__ import annotations

import math
from typing import Any

from meshrun.core.baseline import n_devices
from meshrun.core.config import ExperimentConfig
from meshrun.core.rank_report import RankReport
from meshrun.core.record import RunRecord
from meshrun.core.step_stats import percentile

# Other processes' share of the host's CPU above which a run's figures are flagged.
BUSY_HOST_SHARE = 0.10


def speedup_fields(
    cfg: ExperimentConfig,
    step_times: list[float],
    tokens_per_s: float | None,
    baseline: RunRecord | None,
    mode: str | None,
    cv: float | None,
) -> dict[str, Any]:
    """The speedup over the single-device baseline, its spread over the rounds where the two
    alternated (fresh: the i-th step of each, paired), and the scaling efficiency, flagged
    where it is above 1 by more than the measurement's noise: the spread's half-width
    relative to the speedup, or without rounds the step times' combined variation."""
    devices = n_devices(cfg)
    base_tps = baseline.speed.tokens_per_s if baseline else None
    fields: dict[str, Any] = {
        "baseline_tokens_per_s": base_tps,
        "baseline_run_id": baseline.run_id if baseline else None,
    }
    if not (tokens_per_s and base_tps):
        return {**fields, "speedup": None, "scaling_efficiency": None, "flags": []}
    speedup = tokens_per_s / base_tps
    base_times = baseline.speed.step_times
    rounds = list(zip(step_times, base_times, strict=False)) if mode == "fresh" else []
    ratios = [base_t / run_t * _tokens_ratio(cfg, baseline) for run_t, base_t in rounds]
    fields.update(
        speedup=speedup,
        speedup_rounds=len(ratios) or None,
        speedup_p10=percentile(ratios, 10) if ratios else None,
        speedup_p90=percentile(ratios, 90) if ratios else None,
    )
    if len(ratios) >= 3:
        noise = (fields["speedup_p90"] - fields["speedup_p10"]) / 2 / speedup
    else:
        noise = math.hypot(cv or 0.0, baseline.speed.step_time_cv or 0.0)
    efficiency = speedup / devices
    fields["speedup_noise"] = noise
    flags = []
    if efficiency > 1 + noise:
        flags.append(
            f"scaling efficiency {efficiency:.2f} is above 1 + its noise "
            f"({noise:.2f}): {devices} devices cannot do more than {devices} times "
            "the work of one, so the run and its baseline were not measured alike; "
            "not a result"
        )
    return {**fields, "scaling_efficiency": efficiency, "flags": flags}


def _tokens_ratio(cfg: ExperimentConfig, baseline: RunRecord) -> float:
    """Tokens of one of the run's steps over one of the baseline's."""
    return cfg.train.global_batch_size / (baseline.global_batch_size or 1)


def host_flags(share: float | None) -> list[str]:
    if share is None or share <= BUSY_HOST_SHARE:
        return []
    return [
        f"other processes kept {share:.0%} of the host's CPU busy while the run was "
        "timed: its figures are those of a shared host"
    ]


def memory_flags(cfg: ExperimentConfig, report: RankReport | None) -> list[str]:
    """A CPU rank's peak is traced over the untimed steps (rank/metrics/memory.py): one
    untimed step is step 0 alone, which runs before the optimizer's state exists."""
    if report is None or cfg.hardware.device_type != "cpu" or cfg.train.untimed_steps > 1:
        return []
    return [
        "peak memory traced over step 0 alone (train.untimed_steps=1 on CPU), before the "
        "optimizer's state exists: short of a whole step's by that state; "
        "train.untimed_steps=2 measures one"
    ]
