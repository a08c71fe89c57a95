"""One rank of an experiment, top to bottom: process group and mesh (its place, place.py),
what it builds (setup.py), the loop (with loop_context.py's context), its report
(report.py). Takes the driver's resolved config (core/config.RunConfig) as a
plain dict (no Hydra, no `auto` left in it but `parallel.pp_layers=auto`, which only the
ranks can time) and returns rank 0's RankReport (with the split that auto chose)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from meshrun.core.config import RunConfig, from_dict
from meshrun.core.rank_report import RankReport, StageSplit
from meshrun.core.replica_place import ReplicaPlace
from meshrun.core.run_files.failures import (
    Stopped,
    await_peers_records,
    forget_failure,
    note_finished,
    note_process,
    record_failure,
    record_unflushed,
)
from meshrun.core.run_files.metrics import METRICS_FILE, replica_metrics
from meshrun.core.stages import PP_AUTO, with_layers
from meshrun.rank import flight_recorder, stop_signals
from meshrun.rank.device import set_fp32_matmul
from meshrun.rank.library_warnings import show_once
from meshrun.rank.loop_context import loop_context
from meshrun.rank.mesh import build_mesh, end_distributed, init_distributed, select_device
from meshrun.rank.metrics.log import MetricsLog
from meshrun.rank.parallel.balance import balance_stages
from meshrun.rank.place import Rank, place_in_run
from meshrun.rank.progress import rank_progress
from meshrun.rank.report import build_report, gathered, own_figures
from meshrun.rank.setup import Setup, set_up
from meshrun.rank.train.build import COMPUTE_DTYPES
from meshrun.rank.train.context import LoopContext, LoopState
from meshrun.rank.train.loop import train_loop
from meshrun.rank.watchdog import Watchdog, inside

# How long a failed rank waits, its groups closed, for its peers' records before it exits
# (core/run_files/failures.await_peers_records): gloo's peers see the closed connection in
# milliseconds; the rest is a loaded host's scheduling.
PEERS_RECORD_S = 5.0


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
    layout, rank = place_in_run(cfg, place)
    device = _set_up_process(cfg, rank)
    mesh = watchdog = None
    await_peers = False
    if layout.has_mesh:
        watchdog = Watchdog(cfg.run_dir, rank, layout.world_size, cfg.backend.timeout_s)
        flight_recorder.enable(cfg.backend.name, cfg.run_dir)
        init_distributed(cfg.backend.name, cfg.backend.timeout_s)
        mesh = build_mesh(layout, device.type)
    try:
        report = _train(Rank(cfg, layout, rank, device, mesh, watchdog, place))
        note_finished(cfg.run_dir, rank)
        return report
    except Exception as err:
        # (no flight dumps in a torchft replica group: they would be named by the run's
        # ranks, not its world's, and the group is started again, not diagnosed)
        dumps = watchdog is not None and not isinstance(err, Stopped) and place is None
        _record(cfg.run_dir, rank, err, layout.world_size if dumps else None)
        traceback.clear_frames(err.__traceback__)  # its frames' locals hold the mesh
        await_peers = dumps
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        del mesh  # it holds the process groups, which end here, not at the process's exit
        end_distributed()  # gloo peers blocked on this rank see its connections close now
        if await_peers:
            await_peers_records(cfg.run_dir, rank, PEERS_RECORD_S)


def _set_up_process(cfg: RunConfig, rank: int) -> torch.device:
    """This process's device and settings, and its notes in the run dir."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.update(flight_recorder.rank_env(cfg.backend, cfg.run_dir, os.environ))
    if cfg.launcher.threads_per_rank:
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    device = select_device(cfg.hardware.device_type, local_rank, cfg.backend.name == "gloo")
    set_fp32_matmul(device, cfg.train.precision, cfg.train.tf32)
    forget_failure(cfg.run_dir, rank)  # an earlier attempt's, in a job SLURM requeued
    show_once(cfg.run_dir, rank)
    note_process(cfg.run_dir, rank)
    return device


def _record(run_dir: str, rank: int, err: Exception, dump_world: int | None) -> None:
    """The failure's record (and the flight recorder's dumps of `dump_world` ranks), written
    whole though torch elastic stops this rank meanwhile (stop signals held from the loop's
    own failure on, where it wrote its unflushed steps)."""
    stop_signals.hold()
    try:
        record_failure(run_dir, rank, err)
        if dump_world is not None:
            flight_recorder.dump_all(run_dir, rank, dump_world)
    finally:
        stop_signals.release()


def _train(at: Rank) -> RankReport | None:
    """Set up, train, report (rank 0 returns the report, the others None)."""
    cfg, split = _split_pipeline(at)
    at = dataclasses.replace(at, cfg=cfg)
    setup = set_up(at)
    state, ctx = _loop(at, setup)
    figures = own_figures(setup, state, ctx)
    return build_report(at, setup, gathered(at, figures), split)


def _split_pipeline(at: Rank) -> tuple[RunConfig, StageSplit | None]:
    """parallel.pp_layers=auto: the split the ranks' probes chose, written into the config
    every later step builds from; the config as it is otherwise."""
    if at.cfg.parallel.pp_layers != PP_AUTO:
        return at.cfg, None
    dtype = COMPUTE_DTYPES[at.cfg.train.precision]
    with inside(at.watchdog, 0, "pipeline stage probe (all_gather)", one_collective=False):
        split = balance_stages(at.cfg, at.layout, at.world_rank, at.device, dtype)
    return with_layers(at.cfg, split.counts), split


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
        ctx = loop_context(at, setup, metrics, progress)
        try:
            state = train_loop(
                training.model, training.optimizer, training.schedule, batches, tc, ctx
            )
        except Exception as err:
            stop_signals.hold()  # released once run_rank has recorded the failure too
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
