"""What a rank builds before its first step: the parallel model and its optimizer, the
memory meter, its share of the data, the checkpoint it resumes, evaluation, the baseline
beside the run, the guards and torchft's replica group."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from meshrun.core.layout import cp_rank
from meshrun.models import model_shape
from meshrun.rank.device import autocast
from meshrun.rank.mesh import dp_group, pp_group
from meshrun.rank.metrics.cuda_peaks import metered_devices
from meshrun.rank.metrics.memory import MemoryMeter
from meshrun.rank.place import Rank, restarted
from meshrun.rank.train.baseline_beside import BaselineBeside
from meshrun.rank.train.build import Training, build_training
from meshrun.rank.train.checkpoint import Checkpointer
from meshrun.rank.train.data import HeldoutBatches, LocalBatches, Source, build_streams
from meshrun.rank.train.evaluate import Evaluator
from meshrun.rank.train.guard import SpikeGuard
from meshrun.rank.train.replicas import Replicas, healing
from meshrun.rank.watchdog import inside


@dataclass
class Setup:
    """What a rank builds before its first step."""

    training: Training
    memory: MemoryMeter
    batches: LocalBatches
    checkpoints: Checkpointer | None
    resumed_from_step: int | None  # the checkpoint restored
    evaluate: Evaluator | None
    baseline_beside: BaselineBeside | None
    spikes: SpikeGuard | None
    replicas: Replicas | None
    start_step: int  # the resumed step, or the one a torchft replica joined its peers at


def set_up(at: Rank) -> Setup:
    cfg, tc = at.cfg, at.cfg.train
    memory = MemoryMeter(metered_devices(at.device, cfg.parallel))
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
        BaselineBeside(cfg, at.device, at.rank) if cfg.resolved.baseline_beside else None,
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
    if restarted(at):  # it joins its live peers at their step, with their state
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
