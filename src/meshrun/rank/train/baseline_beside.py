"""The baseline beside the run: the run's single-device baseline, trained by rank 0 between
the run's timed steps (core/config.Resolved.baseline_beside, where the driver found that both fit).

A speedup is only as good as its baseline: measured at another time, or on a host that was
busier then, it says more about the host than about the layout. So rank 0 also trains the
run's single-device baseline (core/baseline.baseline_config: the whole model, one data-parallel
rank's batch under weak scaling) on its own device, one step after each of the run's timed
steps: run, baseline, run, baseline. Every rank waits at a barrier before and after each
baseline step, so that both are timed alone, under the same conditions, and the run's step
clock restarts after it. The baseline is built once the run's memory is measured, so that none
of its tensors count as the run's; its first steps are untimed like the run's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from meshrun.core.baseline import baseline_config
from meshrun.core.config import RunConfig
from meshrun.core.layout import Layout
from meshrun.core.run_files.metrics import StepRow
from meshrun.models import model_shape
from meshrun.rank.control_collectives import control_barrier
from meshrun.rank.device import synchronize
from meshrun.rank.metrics.memory import MemoryMeter
from meshrun.rank.train.build import Training, build_training
from meshrun.rank.train.context import LoopContext
from meshrun.rank.train.data import LocalBatches, build_streams
from meshrun.rank.train.loop import train_step
from meshrun.rank.train.pending import PendingSteps


class BaselineBeside:
    """Every rank holds one (for the barriers); rank 0 builds and trains the baseline."""

    def __init__(self, cfg: RunConfig, device: torch.device, rank: int) -> None:
        self.cfg = baseline_config(cfg)
        self.device = device
        self.trains = rank == 0
        self.steps: list[StepRow] = []  # rank 0: each timed step's loss and seconds
        self._next = 0
        self._training: Training | None = None
        self._batches: LocalBatches | None = None
        self._ctx: LoopContext | None = None

    def untimed_steps(self) -> None:
        """Rank 0 builds the baseline and runs its untimed steps; the others wait."""
        if self.trains:
            self._build()
            for _ in range(self.cfg.train.untimed_steps):
                self._step()
        _barrier()

    def step(self) -> None:
        """One timed baseline step on rank 0, between two of the run's."""
        _barrier()
        if self.trains:
            synchronize(self.device)
            started = time.perf_counter()
            loss = self._step()
            synchronize(self.device)
            seconds = time.perf_counter() - started
            self.steps.append(StepRow(self._next - 1, loss.item(), step_time_s=seconds))
        _barrier()

    def _build(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self._training = build_training(cfg, Layout(), self.device, None)
        vocab_size = model_shape(cfg.model).vocab_size
        data, _ = build_streams(cfg.data, cfg.resolved.data_cache, vocab_size, t.seed, t.seq_len)
        self._batches = LocalBatches(data, t.global_batch_size, t.seq_len, 0, 1, self.device)
        self._ctx = LoopContext(
            device=self.device,
            dp_group=None,
            pp_group=None,
            autocast_dtype=self._training.autocast_dtype,
            memory=MemoryMeter([self.device]),  # never started: the baseline measures no memory
            on_log=lambda records: None,
            pending=PendingSteps(self.device, 0),
            loss_scale=self._training.loss_scale,
        )

    def _step(self) -> torch.Tensor:
        training = self._training
        loss, _, _ = train_step(
            training.model,
            training.optimizer,
            training.schedule,
            self._batches,
            self._next,
            self.cfg.train,
            self._ctx,
        )
        self._next += 1
        return loss


def _barrier() -> None:
    if dist.is_initialized():
        control_barrier()
