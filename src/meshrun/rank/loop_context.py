"""The training loop's context (rank/train/context.LoopContext) for this rank: its groups,
the run's hooks, and what debug and train.guard ask of it (inspection, injected faults,
guards)."""

from __future__ import annotations

import os

import torch

from meshrun.models import routers_of
from meshrun.rank.faults import fault_injector
from meshrun.rank.mesh import dp_group, pp_group
from meshrun.rank.metrics.busy import BusyClock
from meshrun.rank.metrics.compile_time import CompileClock
from meshrun.rank.metrics.host import HostLoad
from meshrun.rank.metrics.log import MetricsLog
from meshrun.rank.metrics.memory_snapshot import MemorySnapshots
from meshrun.rank.place import Rank, restarted
from meshrun.rank.profiling import StepProfiler
from meshrun.rank.progress import RankProgress
from meshrun.rank.setup import Setup
from meshrun.rank.train.context import (
    Guards,
    InjectedFaults,
    Inspection,
    LoopContext,
)
from meshrun.rank.train.guard import StepGuard, corruption
from meshrun.rank.train.pending import PendingSteps
from meshrun.rank.watchdog import step_collectives


def loop_context(
    at: Rank, setup: Setup, metrics: MetricsLog, progress: RankProgress | None
) -> LoopContext:
    cfg, start = at.cfg, setup.start_step
    return LoopContext(
        device=at.device,
        dp_group=dp_group(at.mesh),
        pp_group=pp_group(at.mesh, at.layout),
        autocast_dtype=setup.training.autocast_dtype,
        memory=setup.memory,
        on_log=metrics,
        pending=PendingSteps(at.device, start),
        progress=progress,
        watchdog=at.watchdog,
        step_collectives=step_collectives(at.layout.degrees()),
        start_step=start,
        checkpoints=setup.checkpoints,
        evaluate=setup.evaluate,
        loss_scale=setup.training.loss_scale,
        baseline_beside=setup.baseline_beside,
        routers=routers_of(cfg.model),
        replicas=setup.replicas,
        inspection=_inspection(at),
        faults=InjectedFaults(
            failure=fault_injector(cfg.debug, at.rank) if not restarted(at) else None,
            slow_step_s=cfg.debug.slow_step_s,
            corruption=corruption(cfg.debug),
            grad_error=cfg.debug.grad_error,
            reverse_micro_batches=cfg.debug.reverse_micro_batches,
        ),
        guards=Guards(
            step=StepGuard(
                setup.training.optimizer,
                cfg.train.guard.max_skipped,
                setup.checkpoints.last_complete if setup.checkpoints else lambda: None,
            ),
            spikes=setup.spikes,
            on_rollback=metrics.roll_back,
        ),
    )


def _inspection(at: Rank) -> Inspection:
    debug = at.cfg.debug
    return Inspection(
        profiler=StepProfiler(at.cfg.run_dir, at.rank, debug.profile_steps, at.device)
        if debug.profile_steps
        else None,
        snapshots=MemorySnapshots(at.cfg.run_dir, at.rank) if debug.memory_snapshot else None,
        busy=_busy_clock(at),
        # the host's other load is what the ranks' gathered CPU time leaves of it; torchft's
        # replicas gather nothing (worlds of their own), so theirs is not measured
        host_load=HostLoad(measure_host=int(os.environ.get("LOCAL_RANK", "0")) == 0)
        if at.replica is None
        else None,
        compiling=CompileClock() if at.cfg.train.compile else None,
    )


def _busy_clock(at: Rank) -> BusyClock | None:
    """CPU ranks of a multi-rank run (rank/metrics/busy.py); debug.slow_rank's slowed."""
    if at.layout.world_size == 1 or at.device.type != "cpu":
        return None
    debug = at.cfg.debug
    factor = debug.slow_factor if debug.slow_rank == at.rank else 1.0
    return BusyClock(torch.get_num_threads(), factor)
