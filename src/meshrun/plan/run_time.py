"""The whole run under a layout: its token budget (`plan.tokens`) at the predicted speed as
wall time, device-hours and their cost, and what checkpoints and failures add to it.

Failures (Young 1974, "A first order approximation to the optimum checkpoint interval";
Daly 2006): a job of N nodes fails every M = plan.mtbf_hours / N hours on average. A save
that holds training up δ seconds every τ seconds of training costs δ/τ of the time; a failure
loses the work since the last save that reached the disk, τ/2 on average plus what a save in
flight (its last save_s - δ seconds) had not yet written, and a restart R (launch, load): at
1/M failures a second, (τ/2 + save_s - δ + R)/M. The sum of the two τ terms is least at
τ = sqrt(2 δ M), Young's interval; a save waits for the one before it (rank/train/
checkpoint.py), so τ is at least save_s, and saves come between steps, so at least a step (a
save held for 0 s, an offloaded state's, would otherwise be planned every save_s, less than
a step of a large model on one device). The run's expected wall time is its time at the
predicted speed over 1 - the shares lost (first order: each share small).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshrun.core.baseline import n_devices
from meshrun.core.calibration import Calibration
from meshrun.core.config import ExperimentConfig
from meshrun.plan.checkpoint_cost import CheckpointCost, checkpoint_cost, storage_rates
from meshrun.plan.memory import MemoryPrediction

HOUR = 3600.0
# The Llama 3 paper (Dubey et al. 2024, sec. 3.3.4): 419 unexpected interruptions in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs, 8 a node: 2,048 nodes x 1,296 hours
# / 419, 6,335 hours between failures of one node.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_NODES = 16384 // 8
MTBF_NODE_HOURS = LLAMA3_NODES * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
MTBF_FROM = "Llama 3's 419 interruptions in 54 days on 2,048 nodes (Dubey et al. 2024)"


def budget_tokens(cfg: ExperimentConfig) -> float:
    """plan.tokens, or the run's own: train.steps x global batch x sequence."""
    return cfg.plan.tokens or cfg.train.steps * cfg.train.tokens_per_step


def young_daly_s(blocked_s: float, mtbf_s: float) -> float:
    """Young's optimal seconds of training between two saves: sqrt(2 x save cost x MTBF)."""
    return math.sqrt(2 * blocked_s * mtbf_s)


def save_interval_s(blocked_s: float, save_s: float, failures: Failures) -> float:
    """Young's interval for a save that holds training `blocked_s`, but no shorter than the
    save's `save_s`: the next waits for it."""
    return max(young_daly_s(blocked_s, failures.mtbf_s), save_s)


@dataclass(frozen=True)
class Failures:
    """How often the job fails (`mtbf_s`, the whole job's) and where that figure came from."""

    mtbf_node_hours: float
    nodes: int
    source: str

    @property
    def mtbf_s(self) -> float:
        return self.mtbf_node_hours * HOUR / self.nodes

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> Failures:
        given = cfg.plan.mtbf_hours
        source = "plan.mtbf_hours" if given is not None else MTBF_FROM
        return cls(given if given is not None else MTBF_NODE_HOURS, cfg.launcher.nnodes, source)


@dataclass(frozen=True)
class RunTime:
    """The run's budget at `tokens_per_s` on `devices`; each share is of the expected wall
    time. `interval_s`: seconds of training between saves, Young's (at least a save's length
    and a step, at most the run)."""

    tokens: float
    tokens_per_step: float
    tokens_per_s: float
    devices: int
    price_per_gpu_hour: float | None
    checkpoint: CheckpointCost
    failures: Failures

    @property
    def compute_s(self) -> float:
        return self.tokens / self.tokens_per_s

    @property
    def step_s(self) -> float:
        return self.tokens_per_step / self.tokens_per_s

    @property
    def interval_s(self) -> float:
        young = save_interval_s(self.checkpoint.blocked_s, self.checkpoint.save_s, self.failures)
        return min(max(young, self.step_s), self.compute_s)

    @property
    def save_share(self) -> float:
        return self.checkpoint.blocked_s / self.interval_s

    @property
    def lost_work_share(self) -> float:
        in_flight = self.checkpoint.save_s - self.checkpoint.blocked_s
        return (self.interval_s / 2 + in_flight) / self.failures.mtbf_s

    @property
    def restart_share(self) -> float:
        return self.checkpoint.restart_s / self.failures.mtbf_s

    @property
    def lost_share(self) -> float:
        return self.save_share + self.lost_work_share + self.restart_share

    @property
    def expected_s(self) -> float:
        """Wall time with saves, failures and restarts; infinite where they take it all."""
        left = 1 - self.lost_share
        return self.compute_s / left if left > 0 else math.inf

    @property
    def gpu_hours(self) -> float:
        return self.expected_s * self.devices / HOUR

    @property
    def cost(self) -> float | None:
        price = self.price_per_gpu_hour
        return None if price is None else self.gpu_hours * price

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "devices": self.devices,
            "checkpoint": self.checkpoint.as_dict(),
            "failures": {**asdict(self.failures), "mtbf_s": self.failures.mtbf_s},
            "interval_s": self.interval_s,
            "save_share": self.save_share,
            "lost_work_share": self.lost_work_share,
            "restart_share": self.restart_share,
            "expected_s": self.expected_s,
            "gpu_hours": self.gpu_hours,
            "cost": self.cost,
        }


def run_time(
    cfg: ExperimentConfig,
    tokens_per_s: float,
    memory: list[MemoryPrediction],
    calibration: Calibration | None,
) -> RunTime:
    """The run of `cfg` (a resolved layout) at `tokens_per_s`; `memory` its prediction per
    pipeline rank; `calibration` this host's, whose storage rates stand in for the cited."""
    cost = checkpoint_cost(cfg, memory, storage_rates(cfg, calibration))
    return RunTime(
        budget_tokens(cfg),
        cfg.train.tokens_per_step,
        tokens_per_s,
        n_devices(cfg),
        cfg.plan.price_per_gpu_hour,
        cost,
        Failures.of(cfg),
    )
