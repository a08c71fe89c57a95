"""What the training loop runs with (LoopContext: the rank's groups, meters and hooks, each
None where the run does not use it; what inspects the steps, the faults injected and the
guards, grouped) and what it keeps (LoopState); apart from
the loop, so that what happens at a log step (train/log_step.py) and the baseline beside the run
(train/baseline_beside.py) take the same context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from meshrun.core.run_files.metrics import StepRow
from meshrun.models import moe
from meshrun.rank.metrics.busy import BusyClock
from meshrun.rank.metrics.compile_time import CompileClock
from meshrun.rank.metrics.host import HostLoad
from meshrun.rank.metrics.memory import MemoryMeter
from meshrun.rank.metrics.memory_snapshot import MemorySnapshots
from meshrun.rank.profiling import StepProfiler
from meshrun.rank.progress import RankProgress
from meshrun.rank.train.checkpoint import Checkpointer
from meshrun.rank.train.evaluate import Evaluator
from meshrun.rank.train.guard import SpikeGuard, StepGuard
from meshrun.rank.train.loss_scale import LossScale
from meshrun.rank.train.pending import PendingSteps
from meshrun.rank.train.replicas import Replicas
from meshrun.rank.watchdog import Watchdog

LogFn = Callable[[list[StepRow]], None]


class BaselineSteps(Protocol):
    """What the loop asks of the baseline beside the run (train/baseline_beside.py): work every
    rank joins between the run's timed steps, outside their clock."""

    def untimed_steps(self) -> None: ...

    def step(self) -> None: ...


@dataclass
class LoopState:
    """What the loop has measured so far; survives (in part) a crash mid-run."""

    pipeline_busy_per_step: list[float] | None = None  # seconds, per timed step
    pipeline_span_per_step: list[float] | None = None
    host_load: dict[str, object] | None = None  # this rank's share of metrics/host.py's


@dataclass
class Inspection:
    """What looks inside the steps, each None where the run does not: debug.profile_steps'
    traces, debug.memory_snapshot's (CUDA), the busy clock that names the slow rank (CPU
    ranks of a multi-rank run), the host's other load over the timed steps, train.compile's
    clock (stopped at the first timed step)."""

    profiler: StepProfiler | None = None
    snapshots: MemorySnapshots | None = None
    busy: BusyClock | None = None
    host_load: HostLoad | None = None
    compiling: CompileClock | None = None


@dataclass
class InjectedFaults:
    """debug's faults, made on purpose for tests and demonstrations: a rank's failure at a
    step (debug.fail_rank), a sleep after each step (slow_step_s), a batch's loss made
    non-finite or a spike (debug.corrupt_step: the factor by batch), a gradient off by a
    factor (debug.grad_error), a step's micro-batches summed last to first."""

    failure: Callable[[int], None] | None = None
    slow_step_s: float = 0.0
    corruption: Callable[[int], float] | None = None
    grad_error: float = 0.0
    reverse_micro_batches: bool = False


@dataclass
class Guards:
    """What keeps bad steps out of the weights: non-finite steps skipped, a streak stopping
    the run (`step`); a loss spike rolling the run back (train.guard.spike), metrics.jsonl
    told of it (`on_rollback`: step, rollback number)."""

    step: StepGuard | None = None
    spikes: SpikeGuard | None = None
    on_rollback: Callable[[int, int], None] | None = None


@dataclass
class LoopContext:
    device: torch.device
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    autocast_dtype: torch.dtype | None
    memory: MemoryMeter
    on_log: LogFn
    pending: PendingSteps  # the worker's, which it salvages if the loop raises
    progress: RankProgress | None = None
    watchdog: Watchdog | None = None
    step_collectives: str = "forward/backward"
    start_step: int = 0  # > 0: resumed from a checkpoint of that many steps
    checkpoints: Checkpointer | None = None
    loss_scale: LossScale | None = None  # fp16
    evaluate: Evaluator | None = None  # train.eval on
    baseline_beside: BaselineSteps | None = (
        None  # the baseline beside the run, trained between the run's steps
    )
    routers: moe.Routers | None = None  # an MoE model's: their statistics, their biases
    replicas: Replicas | None = None  # parallel.fault_tolerance=torchft
    inspection: Inspection = field(default_factory=Inspection)
    faults: InjectedFaults = field(default_factory=InjectedFaults)
    guards: Guards = field(default_factory=Guards)
