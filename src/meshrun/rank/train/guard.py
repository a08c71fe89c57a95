"""Steps that may not touch the weights (train.guard). A step whose global gradient norm is
not finite (a non-finite loss anywhere makes it so: its gradients reach every rank's norm) is
skipped on every rank alike, in every precision: the norm is already the same on every rank
(DTensor reduces over its mesh, pipeline stages add theirs), so the decision needs no
collective. It is made on the device: fused AdamW's `found_inf` (what torch's GradScaler
hands it) leaves the weights, the moments and the step count as they were, so no host sync a
step; where AdamW is not fused the norm is read on the host. fp16 keeps its loss scale's own
decision (rank/train/loss_scale.py), which reads it anyway.

The skipped steps are known on the host at the log steps, where the norms are read anyway:
`max_skipped` of them in a row stop the run there, naming the last checkpoint, whose weights
no skipped step touched.

Loss spikes (train.guard.spike) are judged there too, on the losses the log step reduced
(the same on every rank): a loss more than `spike_sigma` deviations above the mean of the
window before it (or above `spike_ratio` times it) rolls every rank back to the last
checkpoint, which predates the spike (a save is always preceded by the log step that judges
its steps), and the data skips the batches through the spike's: PaLM's remedy (Chowdhery et
al. 2022, section 5.1: restart from a checkpoint before the spike, skip the batches around
it)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshrun.core.config import DebugConfig, GuardConfig, corrupted_steps
from meshrun.core.rank_report import Rollback
from meshrun.models.shards import local_tensor

SPIKE = 10.0  # debug.corrupt_mode=spike: the loss (and its gradients) times this


class NonFiniteSteps(RuntimeError):
    """Too many steps in a row had a non-finite gradient norm."""


class LossSpikes(RuntimeError):
    """The run spiked again after train.guard.max_rollbacks rollbacks."""


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    mean: float
    std: float


class SpikeWatch:
    """The window of recent finite losses a log step's losses are judged against; at least
    half a window (and 4 steps) before any is judged."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.window: deque[tuple[int, float]] = deque(maxlen=cfg.spike_window)

    def judge(self, first_step: int, losses: list[float]) -> Spike | None:
        for step, loss in enumerate(losses, start=first_step):
            if not math.isfinite(loss):
                continue  # a non-finite step is skipped, not rolled back
            if len(self.window) >= max(4, self.cfg.spike_window // 2):
                recent = [value for _, value in self.window]
                mean, std = statistics.fmean(recent), statistics.pstdev(recent)
                ratio = self.cfg.spike_ratio
                limit = ratio * mean if ratio else mean + self.cfg.spike_sigma * std
                if loss > limit:
                    return Spike(step, loss, mean, std)
            self.window.append((step, loss))
        return None

    def forget_from(self, step: int) -> None:
        """The steps from `step` on are trained again: out of the window."""
        kept = [(s, loss) for s, loss in self.window if s < step]
        self.window.clear()
        self.window.extend(kept)


class StepGuard:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_skipped: int,
        last_checkpoint: Callable[[], str | None],
    ) -> None:
        self.optimizer, self.max_skipped = optimizer, max_skipped
        self.last_checkpoint = last_checkpoint
        self.on_device = all(group.get("fused") for group in optimizer.param_groups)
        self.streak = 0  # non-finite steps in a row, up to the last log step

    def gate(self, norm: torch.Tensor) -> bool:
        """Whether to call the optimizer: always where it decides on the device."""
        if self.on_device:  # on the parameters' device (the host's under FSDP2's offload)
            device = local_tensor(self.optimizer.param_groups[0]["params"][0]).device
            self.optimizer.found_inf = (~torch.isfinite(norm)).to(device, torch.float32)
            return True
        return math.isfinite(norm.item())

    def logged(self, first_step: int, norms: list[float]) -> None:
        """A log step's gradient norms (global: the same on every rank, so every rank stops
        at the same log step)."""
        for step, norm in enumerate(norms, start=first_step):
            self.streak = 0 if math.isfinite(norm) else self.streak + 1
            if self.streak >= self.max_skipped:
                last = self.last_checkpoint() or "none saved (checkpoint.every_steps=0)"
                raise NonFiniteSteps(
                    f"{self.streak} steps in a row up to step {step} had a non-finite gradient "
                    f"norm and were skipped (train.guard.max_skipped={self.max_skipped}): the "
                    f"loss or the gradients overflow, or the data holds a bad batch; the last "
                    f"good checkpoint: {last}"
                )


def corruption(debug: DebugConfig) -> Callable[[int], float] | None:
    """debug.corrupt_step's factor on a batch's loss: NaN or SPIKE where corrupted, else 1."""
    corrupted = corrupted_steps(debug)
    if not corrupted:
        return None
    factors = {b: float("nan") if mode == "nan" else SPIKE for b, mode in corrupted.items()}
    return lambda batch: factors.get(batch, 1.0)


class SpikeGuard:
    """train.guard.spike: the watch, and the rollbacks it caused."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.watch = SpikeWatch(cfg)
        self.rollbacks: list[Rollback] = []

    def judge(self, first_step: int, losses: list[float]) -> Spike | None:
        spike = self.watch.judge(first_step, losses)
        if spike is not None and len(self.rollbacks) == self.cfg.max_rollbacks:
            raise LossSpikes(
                f"the loss spiked at step {spike.step} ({spike.loss:.4g} against a mean of "
                f"{spike.mean:.4g} +- {spike.std:.3g}) after {len(self.rollbacks)} rollbacks "
                f"(train.guard.max_rollbacks={self.cfg.max_rollbacks}): lower the LR, or "
                "raise train.guard.skip_batches"
            )
        return spike

    def unrecoverable(self, spike: Spike) -> LossSpikes:
        """A spike before the run saved any checkpoint: nothing predates it to go back to."""
        return LossSpikes(
            f"the loss spiked at step {spike.step} ({spike.loss:.4g} against a mean of "
            f"{spike.mean:.4g} +- {spike.std:.3g}) before the run saved any checkpoint: "
            "nothing to roll back to (a smaller checkpoint.every_steps saves one sooner)"
        )

    def rolled_back(self, spike: Spike, restored: int, offset: int) -> Rollback:
        """The run went back to step `restored`, its data at `offset`: the batches it skips
        (from the restored step's through the spike's, and skip_batches more)."""
        first = restored + offset
        last = spike.step + offset + self.cfg.skip_batches
        rollback = Rollback(spike.step, spike.loss, spike.mean, spike.std, restored, (first, last))
        self.rollbacks.append(rollback)
        self.watch.forget_from(restored)
        return rollback

    def state_dict(self) -> dict[str, object]:
        """What a torchft replica that joins late needs to judge as its peers do."""
        return {"window": list(self.watch.window), "rollbacks": list(self.rollbacks)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.watch.window.clear()
        self.watch.window.extend(state["window"])
        self.rollbacks = list(state["rollbacks"])
