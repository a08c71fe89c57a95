"""Checkpoints of a training run with torch.distributed.checkpoint (DCP): saved in the
background while training goes on, loaded under any layout.

Every tensor is keyed by the model's own parameter name (no DDP `module.`, no activation
checkpointing wrapper), its optimizer state under `optim.<name>.<key>`: a DTensor of FSDP
or TP, a pipeline stage's plain tensor and a replicated DDP parameter are all saved as the
global tensor they are a piece of, so DCP can load them into another layout's pieces. The
LR schedule, step and layout go into the manifest (core/checkpoints.py), each rank's RNG
states into a file of its own, tensors only (core/rng_state.py: read without unpickling
anything else).

Saves run on a gloo process group of their own: the background thread's collectives then
never interleave with training's. A save waits for the one before it; rank 0 writes the
manifest when its save has finished, which for DCP means every rank's data and the
metadata are on disk.

A run that checkpoints also stops cleanly: SIGINT (Ctrl-C), SIGTERM (a preemption, `scontrol
requeue`, torch elastic's teardown) and SIGUSR2 (SLURM's warning before the time limit, as
submitit asks for it) only raise a flag. After each step the ranks agree on it (one
all-reduce of an integer on a third gloo group, the one collective checkpointing adds to a
step), save at once, and raise `Stopped`.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshrun.core.checkpoints import (
    AUTO,
    Manifest,
    checkpoint_root,
    complete,
    find_restore,
    read_manifest,
    step_dir,
    write_manifest,
)
from meshrun.core.config import ExperimentConfig, resolved_of
from meshrun.core.layout import Layout
from meshrun.core.naming import layout_name
from meshrun.core.rng_state import read_rng_state, rng_file
from meshrun.core.run_files.failures import Stopped
from meshrun.models import model_key, model_shape
from meshrun.models.shards import fill, local_tensor, model_name, named_tensors, stored_view
from meshrun.rank.control_collectives import control_all_reduce, control_barrier
from meshrun.rank.parallel.parallel_model import ParallelModel
from meshrun.rank.stop_signals import STOP_SIGNALS
from meshrun.rank.train.auto_interval import AutoInterval
from meshrun.rank.train.checkpoint_refill import refills
from meshrun.rank.train.loss_scale import LossScale
from meshrun.rank.train.optim_states import dense_state, is_quantized


@dataclass
class Save:
    """One checkpoint being written (or written): what the record reports of it."""

    step: int
    path: Path
    started: float
    blocked_s: float
    lr_schedule: dict
    loss_scale: dict | None = None
    data_offset: int = 0
    future: Future | None = None
    total_s: float | None = None


# A run of one process (a single device, a torchft replica) saves and loads with no_dist: DCP
# warns it assumes so, each time.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninit")


def _inner(part: nn.Module) -> nn.Module:
    return part.module if isinstance(part, DistributedDataParallel | nn.DataParallel) else part


def state_tensors(
    model: ParallelModel, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Model (parameters and persistent buffers) and optimizer tensors by the model's names:
    detached views, which DCP reads from and loads into; a quantized optimizer state as an
    fp32 copy (`requantize` writes a loaded one back)."""
    tensors: dict[str, torch.Tensor] = {}
    for part in model.parts:
        inner = _inner(part)
        for name, tensor in inner.state_dict(keep_vars=True).items():
            tensors[f"model.{model_name(name)}"] = stored_view(tensor.detach())
    for key, value in _optimizer_states(model, optimizer).items():
        tensors[key] = dense_state(value)
    return tensors


def _optimizer_states(
    model: ParallelModel, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    names: dict[int, str] = {}
    for part in model.parts:
        names.update({id(param): name for name, param in named_tensors(_inner(part))})
    return {
        f"optim.{names[id(param)]}.{key}": value
        for param, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def requantize(
    model: ParallelModel, optimizer: torch.optim.Optimizer, loaded: dict[str, torch.Tensor]
) -> None:
    """The quantized optimizer states set from their loaded fp32 copies (`state_tensors`)."""
    for key, value in _optimizer_states(model, optimizer).items():
        if is_quantized(value):
            local_tensor(value).copy_(local_tensor(loaded[key]))


def local_state(model: ParallelModel, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shares of `state_tensors` as plain tensors (copies), for a peer of the
    same layout (a torchft replica's rank of the same place) to load."""
    return {
        key: local_tensor(value).clone() for key, value in state_tensors(model, optimizer).items()
    }


def load_local_state(
    model: ParallelModel, optimizer: torch.optim.Optimizer, given: dict[str, torch.Tensor]
) -> None:
    """`local_state` of a peer of the same layout, copied into this rank's shares."""
    _init_optimizer_state(optimizer)
    with torch.no_grad():
        tensors = state_tensors(model, optimizer)
        for key, value in tensors.items():
            local_tensor(value).copy_(given[key])
        requantize(model, optimizer, tensors)
    model.refresh_float8_scales()


def load_schedule(
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    state: dict,
) -> None:
    """The LR schedule where `state` left it, and the optimizer's LR with it (the schedule
    sets that only as it steps)."""
    schedule.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, schedule.get_last_lr(), strict=True):
        group["lr"] = lr


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's state tensors (a step at lr 0 on zero gradients leaves every
    parameter bit for bit as it was), so that DCP has tensors to load into."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


class Checkpointer:
    def __init__(
        self,
        cfg: ExperimentConfig,
        model: ParallelModel,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        rank: int,
        loss_scale: LossScale | None = None,
        replica: int | None = None,
    ) -> None:
        """`replica`: a torchft replica's number. Replica 0 alone writes the run's checkpoints
        (the replicas hold the same state), in the foreground: each replica's rollback then
        finds the save of its step complete."""
        self.cfg = cfg
        self.writes = replica in (None, 0)
        self.background = replica is None
        self.loss_scale = loss_scale
        self.every = cfg.checkpoint.every_steps
        self.root = checkpoint_root(cfg.checkpoint, cfg.run_dir)
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.rank = rank
        distributed = dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.stop_group = dist.new_group(backend="gloo") if distributed else None
        self.pending: Save | None = None
        self.saves: list[Save] = []
        self.signal = 0
        resolved = resolved_of(cfg)
        self.auto = (  # every_steps=auto: no save between steps until it has chosen
            AutoInterval(
                resolved.checkpoint_interval_s,
                resolved.checkpoint_interval_why or "",
                self.stop_group,  # the main thread's alone, as the broadcast must be
                rank,
            )
            if self.every == AUTO and resolved.checkpoint_interval_s
            else None
        )
        # the batches skipped before the checkpoint last loaded (train.guard's rollbacks)
        self.restored_offset = 0
        if self.every:
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signal = self.signal or signum  # the first: elastic forwards Ctrl-C's again

    def stop_requested(self) -> bool:
        """Whether any rank got a stop signal (every rank gets the same answer)."""
        if not self.every:
            return False
        flag = torch.tensor([self.signal])
        if self.stop_group is not None:
            control_all_reduce(flag, self.stop_group, dist.ReduceOp.MAX)
        self.signal = self.signal or int(flag.item())
        return self.signal != 0

    def stop(self, steps_done: int, data_offset: int) -> None:
        """Save now, whole, and stop the run."""
        if self.writes and (not self.saves or self.saves[-1].step != steps_done):
            self.save(steps_done, data_offset, background=False)
        self.wait()
        raise Stopped(self.signal, steps_done, step_dir(self.root, steps_done))

    # what is saved

    def _tensors(self) -> dict[str, torch.Tensor]:
        return state_tensors(self.model, self.optimizer)

    def due(self, steps_done: int) -> bool:
        if not self.writes:
            return False
        last = steps_done == self.cfg.train.steps
        if last and self.cfg.checkpoint.export != "none":
            return True  # the export reads the final checkpoint
        if self.every == AUTO:  # the interval not chosen yet: the last step's save only
            return last
        return self.every > 0 and (steps_done % self.every == 0 or last)

    def measured(self, step_times: list[float]) -> None:
        """A log step's step times: every_steps=auto chooses its steps once it has enough
        (every rank at the same log step)."""
        if self.auto is not None and (chosen := self.auto.measured(step_times)) is not None:
            self.every = chosen

    # saving

    def save(self, steps_done: int, data_offset: int, background: bool = True) -> None:
        """Checkpoint after `steps_done` steps, the data `data_offset` batches ahead of them
        (LocalBatches.offset); returns once training may change the weights again (staged to
        host memory when saving in the background)."""
        self.wait()
        started = time.perf_counter()
        path = step_dir(self.root, steps_done)
        if self.rank == 0:
            if path.exists():  # a save of this step cut off earlier: never loaded, replaced
                shutil.rmtree(path)
            path.mkdir(parents=True)
        self._barrier()
        rng = rng_file(path, self.rank)
        rng.parent.mkdir(exist_ok=True)
        torch.save(_rng_state(), rng)
        tensors = self._tensors()
        scale = self.loss_scale.state_dict() if self.loss_scale else None
        save = Save(steps_done, path, started, 0.0, self.schedule.state_dict(), scale, data_offset)
        final = steps_done == self.cfg.train.steps
        if self.cfg.checkpoint.async_save and self.background and background and not final:
            save.future = dcp.async_save(
                tensors, checkpoint_id=path, process_group=self.group, no_dist=self.group is None
            )
            save.blocked_s = time.perf_counter() - started
            self.pending = save
        else:
            dcp.save(
                tensors, checkpoint_id=path, process_group=self.group, no_dist=self.group is None
            )
            save.blocked_s = time.perf_counter() - started
            self._finished(save)
        self.saves.append(save)

    def last_complete(self) -> str | None:
        """The newest complete checkpoint's path, if any."""
        found = complete(self.root)
        return str(found[-1]) if found else None

    def poll(self) -> None:
        """Finishes the background save if it is done (the manifest, the old ones pruned)."""
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        save, self.pending = self.pending, None
        save.future.result()  # a failed write raises here, on the rank whose write failed
        self._finished(save)

    def _finished(self, save: Save) -> None:
        save.total_s = time.perf_counter() - save.started
        if self.rank != 0:
            return
        layout = Layout.of(self.cfg.parallel)
        write_manifest(
            save.path,
            Manifest(
                step=save.step,
                run_dir=self.cfg.run_dir,
                model=model_key(self.cfg.model)[1],
                layout=layout_name(self.cfg),
                degrees=layout.degrees(),
                vocab_rows=self._vocab_rows(),
                lr_schedule=save.lr_schedule,
                saved_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                seconds_blocked=round(save.blocked_s, 4),
                seconds_total=round(save.total_s, 4),
                bytes=sum(f.stat().st_size for f in save.path.rglob("*") if f.is_file()),
                ranks=layout.world_size,
                extra={
                    **({"loss_scale": save.loss_scale} if save.loss_scale else {}),
                    **({"data_offset": save.data_offset} if save.data_offset else {}),
                },
            ),
        )
        self._prune(save.step)

    def _prune(self, newest: int) -> None:
        """Keep the last `keep` complete checkpoints; drop older ones cut off mid-write."""
        keep = complete(self.root)[-self.cfg.checkpoint.keep :]
        for path in self.root.iterdir():
            if not path.name.startswith("step-") or path in keep:
                continue
            if int(path.name.removeprefix("step-")) < newest:
                shutil.rmtree(path, ignore_errors=True)

    def _vocab_rows(self) -> int:
        for part in self.model.parts:
            for name, param in named_tensors(_inner(part)):
                if name.startswith("tok_embeddings."):
                    return int(param.shape[0])
        return 0

    def _barrier(self) -> None:
        if self.group is not None:
            control_barrier(self.group)

    # loading

    def restore(self) -> int:
        """Loads the checkpoint `checkpoint.resume` names; the step to start at (0: none)."""
        requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0  # SLURM requeued it
        found = find_restore(self.cfg.checkpoint, self.cfg.run_dir, requeued)
        return self._load(self._decided(str(found or "")))

    def roll_back(self) -> int:
        """Loads the newest complete checkpoint of this run (train.guard's rollback, the save
        in flight finished first); the step it holds."""
        self.wait()
        self._barrier()  # rank 0's manifest of that save is written
        return self._load(self._decided(self.last_complete() or ""))

    def _decided(self, path: str) -> str:
        """Rank 0's choice, so that no rank can pick another step."""
        found = [path]
        if self.group is not None:
            dist.broadcast_object_list(found, src=0, group=self.group)
        return found[0]

    def _load(self, found: str) -> int:
        if not found:
            return 0
        path = Path(found)
        manifest = read_manifest(path)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if any(key.startswith("optim.") for key in saved):  # none: saved before any update
            _init_optimizer_state(self.optimizer)  # (fp16 skipped every step up to it)
        tensors = self._tensors()
        layout = Layout.of(self.cfg.parallel)
        refill = refills(
            tensors,
            [_inner(part) for part in self.model.parts],
            (manifest.vocab_rows, manifest.degrees.get("tp", 1)),
            (self._vocab_rows(), layout.tp),
            model_shape(self.cfg.model).vocab_size,
        )
        dcp.load(
            {**tensors, **{key: r.whole for key, r in refill.items()}},
            checkpoint_id=path,
            process_group=self.group,
            no_dist=self.group is None,
        )
        for key, r in refill.items():
            fill(tensors[key], r.source(r.whole))
        requantize(self.model, self.optimizer, tensors)
        self.model.refresh_float8_scales()
        load_schedule(self.optimizer, self.schedule, manifest.lr_schedule)
        if self.loss_scale and "loss_scale" in manifest.extra:
            self.loss_scale.load_state_dict(manifest.extra["loss_scale"])
        self.restored_offset = manifest.extra.get("data_offset", 0)
        rng = rng_file(path, self.rank)
        if manifest.degrees == layout.degrees() and rng.is_file():
            _set_rng_state(read_rng_state(rng))
        return manifest.step


def _rng_state() -> dict[str, torch.Tensor]:
    """The generators a rank draws from, as core/rng_state.py stores them: the CPU's and its
    own device's (torch.cuda.get_rng_state() is the current device's: torch/cuda/random.py)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
