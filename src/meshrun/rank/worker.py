"""One rank of an experiment, top to bottom: process group and mesh, model, parallel form,
training, measurements. Takes the driver's fully resolved config as a plain dict (no Hydra,
no `auto` left in it but `parallel.pp_layers=auto`, which only the ranks can time) and
returns rank 0's raw measurements (with the split that auto chose)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshrun.core.config import ExperimentConfig, from_dict
from meshrun.core.hardware import host_fingerprint
from meshrun.core.layout import Layout, dp_rank
from meshrun.core.run_files.failures import (
    forget_failure,
    note_finished,
    note_process,
    record_failure,
    record_unflushed,
)
from meshrun.core.run_files.metrics import METRICS_FILE
from meshrun.core.stages import PP_AUTO, with_layers
from meshrun.models import model_shape
from meshrun.rank.device import autocast
from meshrun.rank.faults import fault_injector
from meshrun.rank.library_warnings import show_once
from meshrun.rank.mesh import build_mesh, dp_group, init_distributed, pp_group, select_device
from meshrun.rank.metrics.bubble import bubble_per_rank
from meshrun.rank.metrics.compile_time import CompileClock
from meshrun.rank.metrics.host import HostLoad, other_cpu_share
from meshrun.rank.metrics.log import MetricsLog
from meshrun.rank.metrics.memory import MemoryMeter, ModelState
from meshrun.rank.parallel.balance import balance_stages
from meshrun.rank.progress import rank_progress
from meshrun.rank.train.build import COMPUTE_DTYPES, build_training
from meshrun.rank.train.checkpoint import Checkpointer
from meshrun.rank.train.data import HeldoutBatches, LocalBatches, build_streams
from meshrun.rank.train.evaluate import Evaluator
from meshrun.rank.train.loop import LoopContext, train_loop
from meshrun.rank.train.pending import PendingSteps
from meshrun.rank.train.twin import Twin
from meshrun.rank.watchdog import Watchdog, step_collectives


def _freeze_libraries() -> None:
    """Leaves what the process holds before its first run (the imported libraries' objects,
    millions of them with torch) out of garbage collection: the memory meter's collection
    before the measured step then walks only the runs' own objects (a full one took 0.25
    CPU-s per rank). Once per process: a later run's garbage (a process that runs several,
    as torchrun's rank 0 with its baseline) stays collectable."""
    if gc.get_freeze_count() == 0:
        gc.freeze()


def run_rank(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    _freeze_libraries()
    cfg = from_dict(cfg_dict)
    layout = Layout.of(cfg.parallel)
    rank = int(os.environ.get("RANK", "0"))
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
        watchdog = Watchdog(cfg.run_dir, rank, cfg.backend.timeout_s)
        init_distributed(cfg.backend.name, cfg.backend.timeout_s)
        mesh = build_mesh(layout, device.type)
    try:
        measured = _train(cfg, layout, rank, device, mesh, watchdog)
        note_finished(cfg.run_dir, rank)
        return measured
    except Exception as err:
        record_failure(cfg.run_dir, rank, err)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        # The run's process groups live in reference cycles: freed here, their gloo threads
        # stop while the interpreter still runs, not during its exit or the next run.
        gc.collect()


def _train(
    cfg: ExperimentConfig,
    layout: Layout,
    rank: int,
    device: torch.device,
    mesh,
    watchdog: Watchdog | None,
) -> dict | None:
    pp_split = None
    if cfg.parallel.pp_layers == PP_AUTO:
        dtype = COMPUTE_DTYPES[cfg.train.precision]
        with watchdog.inside(0, "pipeline stage probe (all_gather)", one_collective=False):
            pp_split = balance_stages(cfg, layout, rank, device, dtype)
        cfg = with_layers(cfg, pp_split.counts)
    tc = cfg.train
    memory = MemoryMeter(device)
    memory.start()
    training = build_training(cfg, layout, device, mesh)
    model, optimizer, schedule = training.model, training.optimizer, training.schedule
    loss_scale, autocast_dtype = training.loss_scale, training.autocast_dtype
    checkpoints = start = None
    c = cfg.checkpoint
    if c.every_steps or c.resume or c.export != "none":
        checkpoints = Checkpointer(cfg, model, optimizer, schedule, rank, loss_scale)
        loading = watchdog.inside(0, "checkpoint load") if watchdog else contextlib.nullcontext()
        with loading:
            start = checkpoints.restore()
    train_data, heldout = build_streams(
        cfg.data, model_shape(cfg.model).vocab_size, tc.seed, tc.seq_len
    )
    batches = LocalBatches(
        train_data,
        tc.global_batch_size,
        tc.seq_len,
        dp_rank(layout, rank),
        layout.dp_size,
        device,
        start_step=start or 0,
    )
    evaluate = None
    if tc.eval.every_steps:
        evaluate = Evaluator(
            model,
            HeldoutBatches(
                heldout,
                tc.eval.batches,
                tc.global_batch_size,
                tc.seq_len,
                dp_rank(layout, rank),
                layout.dp_size,
                device,
            ),
            tc,
            dp_group(mesh),
            pp_group(mesh, layout),
            lambda: autocast(device, autocast_dtype),
        )
    twin = Twin(cfg, device, rank) if cfg.metrics.alongside else None
    host_load = HostLoad(measure_host=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    tokens_per_step = tc.tokens_per_step
    with rank_progress(tc.steps, tokens_per_step, rank == 0 and tc.progress_bar) as progress:
        metrics = MetricsLog(
            Path(cfg.run_dir) / METRICS_FILE if rank == 0 else None,
            [progress.show] if progress else [],
        )
        if start:
            metrics.keep_before(start)
        ctx = LoopContext(
            device=device,
            dp_group=dp_group(mesh),
            pp_group=pp_group(mesh, layout),
            autocast_dtype=autocast_dtype,
            memory=memory,
            on_log=metrics,
            pending=PendingSteps(device, start or 0),
            progress=progress,
            fault=fault_injector(cfg.debug, rank),
            watchdog=watchdog,
            step_collectives=step_collectives(layout.degrees()),
            start_step=start or 0,
            slow_step_s=cfg.debug.slow_step_s,
            checkpoints=checkpoints,
            evaluate=evaluate,
            loss_scale=loss_scale,
            baseline=twin,
            host_load=host_load,
            compiling=CompileClock() if tc.compile else None,
        )
        try:
            state = train_loop(model, optimizer, schedule, batches, tc, ctx)
        except Exception:
            # What a log step would have written; never in place of the error (a broken
            # device may refuse even a copy of finished values).
            with contextlib.suppress(Exception):
                record_unflushed(cfg.run_dir, rank, ctx.pending.salvage(batches.drain_waits()))
            raise
        finally:
            if ctx.compiling is not None:
                ctx.compiling.stop()  # a run that ends in its untimed steps
    split = memory.breakdown(ModelState.of(model.parameters(), optimizer))
    mine = {
        "memory": {"rank": rank, **(split or {"peak": memory.peak_bytes()})},
        "busy": state.pipeline_busy_per_step,
        "span": state.pipeline_span_per_step,
        "pretrained_read": model.pretrained_bytes_read,
        "host_load": state.host_load,
        "compile_s": ctx.compiling.seconds if ctx.compiling else None,
    }
    ranks = [mine]
    if dist.is_initialized():
        ranks = [{} for _ in range(dist.get_world_size())]
        with watchdog.inside(tc.steps, "all_gather_object (measurements)", one_collective=True):
            dist.all_gather_object(ranks, mine)
    if rank != 0:
        return None
    return {
        "memory_per_rank": [r["memory"] for r in ranks],
        "pipeline_bubble_per_rank": bubble_per_rank(
            [r["busy"] for r in ranks], [r["span"] for r in ranks]
        )
        if state.pipeline_span_per_step
        else None,
        "pp_split": dataclasses.asdict(pp_split) if pp_split else None,
        "pretrained_read_bytes_per_rank": [r["pretrained_read"] for r in ranks]
        if cfg.model.pretrained
        else None,
        "resumed_from_step": start,
        "skipped_steps": loss_scale.skipped if loss_scale else None,
        "requeues": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        # the single-device baseline's timed steps, trained beside the run's (metrics.alongside)
        "baseline_steps": twin.steps if twin else None,
        "host_other_cpu_share": other_cpu_share([r["host_load"] for r in ranks])
        if all(r["host_load"] for r in ranks)
        else None,
        "fingerprint": host_fingerprint(cfg.launcher.threads_per_rank),
        # the ranks compile at once; the run waits for the slowest
        "compile_s": max(r["compile_s"] for r in ranks) if ctx.compiling else None,
        "checkpoints": [
            {"step": s.step, "blocked_s": s.blocked_s, "total_s": s.total_s}
            for s in checkpoints.saves
        ]
        if checkpoints
        else None,
    }
