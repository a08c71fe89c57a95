"""One rank of an experiment, top to bottom: process group and mesh, model, parallel form,
training, measurements. Takes the driver's resolved config (core/config.RunConfig) as a
plain dict (no Hydra, no `auto` left in it but `parallel.pp_layers=auto`, which only the
ranks can time) and returns rank 0's RankReport (with the split that auto chose)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshrun.core.config import RunConfig, from_dict
from meshrun.core.hardware import host_fingerprint
from meshrun.core.layout import Layout, cp_rank, dp_rank
from meshrun.core.rank_report import CheckpointSave, RankReport, Rollback, StageSplit
from meshrun.core.replica_place import ReplicaPlace
from meshrun.core.run_files.failures import (
    Stopped,
    forget_failure,
    note_finished,
    note_process,
    record_failure,
    record_unflushed,
)
from meshrun.core.run_files.metrics import METRICS_FILE, replica_metrics
from meshrun.core.stages import PP_AUTO, with_layers
from meshrun.models import model_shape
from meshrun.models.moe import Routers
from meshrun.rank import flight_recorder
from meshrun.rank.device import autocast
from meshrun.rank.faults import fault_injector
from meshrun.rank.library_warnings import show_once
from meshrun.rank.mesh import build_mesh, dp_group, init_distributed, pp_group, select_device
from meshrun.rank.metrics.bubble import bubble_per_rank
from meshrun.rank.metrics.busy import BusyClock
from meshrun.rank.metrics.compile_time import CompileClock
from meshrun.rank.metrics.host import HostLoad, other_cpu_share
from meshrun.rank.metrics.log import MetricsLog
from meshrun.rank.metrics.memory import MemoryMeter, ModelState
from meshrun.rank.metrics.memory_snapshot import MemorySnapshots
from meshrun.rank.parallel.balance import balance_stages
from meshrun.rank.profiling import StepProfiler
from meshrun.rank.progress import RankProgress, rank_progress
from meshrun.rank.train.build import COMPUTE_DTYPES, Training, build_training
from meshrun.rank.train.checkpoint import Checkpointer
from meshrun.rank.train.context import (
    Guards,
    InjectedFaults,
    Inspection,
    LoopContext,
    LoopState,
)
from meshrun.rank.train.data import HeldoutBatches, LocalBatches, Source, build_streams
from meshrun.rank.train.evaluate import Evaluator
from meshrun.rank.train.guard import SpikeGuard, StepGuard, corruption
from meshrun.rank.train.loop import train_loop
from meshrun.rank.train.pending import PendingSteps
from meshrun.rank.train.replicas import Replicas, healing
from meshrun.rank.train.twin import Twin
from meshrun.rank.watchdog import Watchdog, inside, step_collectives


def _freeze_libraries() -> None:
    """Leaves what the process holds before its first run (the imported libraries' objects,
    millions of them with torch) out of garbage collection: the memory meter's collection
    before the measured step then walks only the runs' own objects (a full one took 0.25
    CPU-s per rank). Once per process: a later run's garbage (a process that runs several,
    as torchrun's rank 0 with its baseline) stays collectable."""
    if gc.get_freeze_count() == 0:
        gc.freeze()


def run_rank(cfg_dict: dict[str, Any]) -> RankReport | None:
    _freeze_libraries()
    cfg = from_dict(cfg_dict)
    place = ReplicaPlace.from_env()
    layout, rank = _place(cfg, place)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    for key, value in cfg.backend.env.items():
        os.environ.setdefault(key, value)
    if cfg.launcher.threads_per_rank:
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    device = select_device(cfg.hardware.device_type, local_rank)
    forget_failure(cfg.run_dir, rank)  # an earlier attempt's, in a job SLURM requeued
    show_once(cfg.run_dir, rank)
    note_process(cfg.run_dir, rank)
    mesh = watchdog = None
    if layout.world_size > 1:
        watchdog = Watchdog(cfg.run_dir, rank, layout.world_size, cfg.backend.timeout_s)
        flight_recorder.enable(cfg.backend.name, cfg.run_dir)
        init_distributed(cfg.backend.name, cfg.backend.timeout_s)
        mesh = build_mesh(layout, device.type)
    try:
        report = _train(Rank(cfg, layout, rank, device, mesh, watchdog, place))
        note_finished(cfg.run_dir, rank)
        return report
    except Exception as err:
        record_failure(cfg.run_dir, rank, err)
        # (not in a torchft replica group: its dumps would be named by the run's ranks, not
        # its world's, and the group is started again, not diagnosed)
        if watchdog is not None and not isinstance(err, Stopped) and place is None:
            flight_recorder.dump_all(cfg.run_dir, rank, layout.world_size)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        # The run's process groups live in reference cycles: freed here, their gloo threads
        # stop while the interpreter still runs, not during its exit or the next run.
        gc.collect()


def _place(cfg: RunConfig, replica: ReplicaPlace | None) -> tuple[Layout, int]:
    """This process's world (a torchft replica group's: the run's layout without
    dp_replicate) and its rank in the run, which names its files and records (a replica
    group's world rank is RANK)."""
    layout = Layout.of(cfg.parallel)
    rank = int(os.environ.get("RANK", "0"))
    if replica is None:
        return layout, rank
    group = dataclasses.replace(layout, dp_replicate=1)
    return group, replica.id * group.world_size + rank


@dataclass(frozen=True)
class Rank:
    """This process's place in the run, as every step of it needs it."""

    cfg: RunConfig
    layout: Layout
    rank: int
    device: torch.device
    mesh: DeviceMesh | None
    watchdog: Watchdog | None
    replica: ReplicaPlace | None = None  # parallel.fault_tolerance=torchft

    @property
    def world_rank(self) -> int:
        """The rank in its process group's world: a torchft replica group's own."""
        return self.rank % self.layout.world_size

    def data_share(self) -> tuple[int, int]:
        """Which share of each global batch this rank trains on, of how many."""
        share = dp_rank(self.layout, self.world_rank), self.layout.dp_size
        if self.replica is None:
            return share
        return self.replica.id * share[1] + share[0], self.replica.replicas * share[1]


@dataclass
class Setup:
    """What a rank builds before its first step."""

    training: Training
    memory: MemoryMeter
    batches: LocalBatches
    checkpoints: Checkpointer | None
    resumed_from_step: int | None  # the checkpoint restored
    evaluate: Evaluator | None
    twin: Twin | None
    spikes: SpikeGuard | None
    replicas: Replicas | None
    start_step: int  # the resumed step, or the one a torchft replica joined its peers at


@dataclass(frozen=True)
class RankFigures:
    """What each rank measured of itself, gathered to rank 0 for the report."""

    memory: dict[str, int]
    pipeline_busy: list[float] | None
    pipeline_span: list[float] | None
    pretrained_read: int
    host_load: dict[str, object] | None
    compile_s: float | None
    busy_s: float | None  # the median timed step's (rank/metrics/busy.py)
    rollbacks: list[Rollback]  # train.guard.spike's, the same on every rank
    host: str  # the node it ran on


def _train(at: Rank) -> RankReport | None:
    """Set up, train, report (rank 0 returns the report, the others None)."""
    cfg, split = _split_pipeline(at)
    at = dataclasses.replace(at, cfg=cfg)
    setup = _set_up(at)
    state, ctx = _loop(at, setup)
    figures = _own_figures(setup, state, ctx)
    return _report(at, setup, _gathered(at, figures), split)


def _split_pipeline(at: Rank) -> tuple[RunConfig, StageSplit | None]:
    """parallel.pp_layers=auto: the split the ranks' probes chose, written into the config
    every later step builds from; the config as it is otherwise."""
    if at.cfg.parallel.pp_layers != PP_AUTO:
        return at.cfg, None
    dtype = COMPUTE_DTYPES[at.cfg.train.precision]
    with inside(at.watchdog, 0, "pipeline stage probe (all_gather)", one_collective=False):
        split = balance_stages(at.cfg, at.layout, at.world_rank, at.device, dtype)
    return with_layers(at.cfg, split.counts), split


def _set_up(at: Rank) -> Setup:
    cfg, tc = at.cfg, at.cfg.train
    memory = MemoryMeter(at.device)
    memory.start()  # before the model exists: its parameters are the breakdown's first part
    training = build_training(cfg, at.layout, at.device, at.mesh)
    checkpoints, start = _restore(at, training)
    vocab_size = model_shape(cfg.model).vocab_size
    train_data, heldout = build_streams(
        cfg.data, cfg.resolved.data_cache, vocab_size, tc.seed, tc.seq_len
    )
    batches = LocalBatches(
        train_data,
        tc.global_batch_size,
        tc.seq_len,
        *at.data_share(),
        at.device,
        start_step=start or 0,
        cp=(cp_rank(at.layout, at.world_rank), at.layout.cp),
        offset=checkpoints.restored_offset if checkpoints else 0,
    )
    spikes = SpikeGuard(tc.guard) if tc.guard.spike else None
    replicas = _join_replicas(at, training, batches, spikes) if at.replica else None
    joined = replicas.start(start or 0) if replicas else start or 0
    if joined != (start or 0):  # a restarted replica, given a live peer's state
        batches.seek(joined)
    return Setup(
        training,
        memory,
        batches,
        checkpoints,
        start,
        _evaluator(at, training, heldout, replicas),
        Twin(cfg, at.device, at.rank) if cfg.resolved.twin else None,
        spikes,
        replicas,
        joined,
    )


def _join_replicas(
    at: Rank, training: Training, batches: LocalBatches, spikes: SpikeGuard | None
) -> Replicas:
    """torchft's Manager for this rank of its replica group."""
    cfg, group = at.cfg, (at.world_rank, at.layout.world_size)
    state, load = healing(training, batches, spikes)
    return Replicas(
        cfg.run_dir, at.replica, group, cfg.backend.name, cfg.backend.timeout_s, state, load
    )


def _restore(at: Rank, training: Training) -> tuple[Checkpointer | None, int | None]:
    """The run's checkpointer, where it saves, resumes or exports, and the step it restored."""
    c = at.cfg.checkpoint
    if not (c.every_steps or c.resume or c.export != "none"):
        return None, None
    checkpoints = Checkpointer(
        at.cfg,
        training.model,
        training.optimizer,
        training.schedule,
        at.world_rank,
        training.loss_scale,
        at.replica.id if at.replica else None,
    )
    if _restarted(at):  # it joins its live peers at their step, with their state
        return checkpoints, None
    with inside(at.watchdog, 0, "checkpoint load", one_collective=False):
        return checkpoints, checkpoints.restore()


def _evaluator(
    at: Rank, training: Training, heldout: Source, replicas: Replicas | None
) -> Evaluator | None:
    tc = at.cfg.train
    if not tc.eval.every_steps:
        return None
    batches = HeldoutBatches(
        heldout,
        tc.eval.batches,
        tc.global_batch_size,
        tc.seq_len,
        *at.data_share(),
        at.device,
        cp=(cp_rank(at.layout, at.world_rank), at.layout.cp),
    )
    return Evaluator(
        training.model,
        batches,
        tc,
        dp_group(at.mesh),
        pp_group(at.mesh, at.layout),
        lambda: autocast(at.device, training.autocast_dtype),
        (lambda loss: replicas.reduce(loss, dist.ReduceOp.AVG)) if replicas else None,
    )


def _loop(at: Rank, setup: Setup) -> tuple[LoopState, LoopContext]:
    """The training loop, rank 0 logging each step; a failure first writes the steps that
    a log step would have (never in place of the error: a broken device may refuse even a
    copy of finished values)."""
    tc = at.cfg.train
    training, batches = setup.training, setup.batches
    show = at.rank == 0 and tc.progress_bar
    with rank_progress(tc.steps, tc.tokens_per_step, show) as progress:
        log_file = _metrics_file(at)
        metrics = MetricsLog(log_file, [progress.show] if progress else [])
        if setup.resumed_from_step:
            metrics.keep_before(setup.resumed_from_step)
        ctx = _loop_context(at, setup, metrics, progress)
        try:
            state = train_loop(
                training.model, training.optimizer, training.schedule, batches, tc, ctx
            )
        except Exception as err:
            if isinstance(err, torch.OutOfMemoryError) and ctx.inspection.snapshots is not None:
                ctx.inspection.snapshots.out_of_memory()
            with contextlib.suppress(Exception):
                unflushed = ctx.pending.salvage(batches.drain_waits())
                record_unflushed(at.cfg.run_dir, at.rank, unflushed)
            raise
        finally:
            if ctx.inspection.compiling is not None:
                ctx.inspection.compiling.stop()  # a run that ends in its untimed steps
    return state, ctx


def _metrics_file(at: Rank) -> Path | None:
    """Rank 0 writes metrics.jsonl; the first rank of each other torchft replica group its
    group's own (core/run_files/metrics.replica_metrics), from which the driver fills in the
    steps group 0 missed while it was down."""
    if at.rank == 0:
        return Path(at.cfg.run_dir) / METRICS_FILE
    if at.replica is not None and at.world_rank == 0:
        return replica_metrics(at.cfg.run_dir, at.replica.id)
    return None


def _loop_context(
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
        twin=setup.twin,
        routers=Routers.of(cfg.model),
        replicas=setup.replicas,
        inspection=_inspection(at),
        faults=InjectedFaults(
            failure=fault_injector(cfg.debug, at.rank) if not _restarted(at) else None,
            slow_step_s=cfg.debug.slow_step_s,
            corruption=corruption(cfg.debug),
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
        snapshots=MemorySnapshots(at.cfg.run_dir, at.rank, at.device)
        if debug.memory_snapshot
        else None,
        busy=_busy_clock(at),
        # the host's other load is what the ranks' gathered CPU time leaves of it; torchft's
        # replicas gather nothing (worlds of their own), so theirs is not measured
        host_load=HostLoad(measure_host=int(os.environ.get("LOCAL_RANK", "0")) == 0)
        if at.replica is None
        else None,
        compiling=CompileClock() if at.cfg.train.compile else None,
    )


def _restarted(at: Rank) -> bool:
    """A torchft replica started again: the failure it injected happened once."""
    return at.replica is not None and at.replica.attempt > 0


def _busy_clock(at: Rank) -> BusyClock | None:
    """CPU ranks of a multi-rank run (rank/metrics/busy.py); debug.slow_rank's slowed."""
    if at.layout.world_size == 1 or at.device.type != "cpu":
        return None
    debug = at.cfg.debug
    factor = debug.slow_factor if debug.slow_rank == at.rank else 1.0
    return BusyClock(torch.get_num_threads(), factor)


def _own_figures(setup: Setup, state: LoopState, ctx: LoopContext) -> RankFigures:
    model, memory = setup.training.model, setup.memory
    split = memory.breakdown(ModelState.of(model.parameters(), setup.training.optimizer))
    return RankFigures(
        memory=split or {"peak": memory.peak_bytes()},
        pipeline_busy=state.pipeline_busy_per_step,
        pipeline_span=state.pipeline_span_per_step,
        pretrained_read=model.pretrained_bytes_read,
        host_load=state.host_load,
        compile_s=ctx.inspection.compiling.seconds if ctx.inspection.compiling else None,
        busy_s=ctx.inspection.busy.median() if ctx.inspection.busy else None,
        rollbacks=ctx.guards.spikes.rollbacks if ctx.guards.spikes else [],
        host=socket.gethostname(),
    )


def _gathered(at: Rank, mine: RankFigures) -> list[RankFigures]:
    """Every rank's figures, on every rank (one collective, after the last step)."""
    if not dist.is_initialized():
        return [mine]
    ranks: list[Any] = [None] * dist.get_world_size()
    op = "all_gather_object (measurements)"
    with inside(at.watchdog, at.cfg.train.steps, op, one_collective=True):
        dist.all_gather_object(ranks, mine)
    return ranks


def _report(
    at: Rank, setup: Setup, ranks: list[RankFigures], split: StageSplit | None
) -> RankReport | None:
    """Rank 0's report of the run: its own figures beside every rank's."""
    if at.rank != 0:
        return None
    cfg = at.cfg
    spans = [r.pipeline_span for r in ranks]
    loads = [r.host_load for r in ranks]
    compiled = [r.compile_s for r in ranks if r.compile_s is not None]
    checkpoints = setup.checkpoints
    return RankReport(
        memory_per_rank=[{"rank": i, **r.memory} for i, r in enumerate(ranks)],
        fingerprint=host_fingerprint(cfg.launcher.threads_per_rank),
        resumed_from_step=setup.resumed_from_step,
        requeues=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        host_per_rank=[r.host for r in ranks],
        pipeline_bubble_per_rank=bubble_per_rank([r.pipeline_busy for r in ranks], spans)
        if ranks[0].pipeline_span
        else None,
        pp_split=split,
        pretrained_read_bytes_per_rank=[r.pretrained_read for r in ranks]
        if cfg.model.pretrained
        else None,
        twin_steps=setup.twin.steps if setup.twin else None,
        host_other_cpu_share=other_cpu_share(loads) if all(loads) else None,
        # the ranks compile at once; the run waits for the slowest
        compile_s=max(compiled) if compiled else None,
        busy_per_rank=[r.busy_s for r in ranks] if all(r.busy_s for r in ranks) else None,
        rollbacks=ranks[0].rollbacks or None,
        checkpoint_saves=[CheckpointSave(s.step, s.blocked_s, s.total_s) for s in checkpoints.saves]
        if checkpoints
        else None,
    )
