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
no skipped step touched."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from meshrun.core.config import DebugConfig

SPIKE = 10.0  # debug.corrupt_mode=spike: the loss (and its gradients) times this


class NonFiniteSteps(RuntimeError):
    """Too many steps in a row had a non-finite gradient norm."""


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
        if self.on_device:
            self.optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32)
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
    """debug.corrupt_step's factor on a step's loss: NaN or SPIKE at that step, else 1."""
    if debug.corrupt_step is None:
        return None
    factor = float("nan") if debug.corrupt_mode == "nan" else SPIKE
    return lambda step: factor if step == debug.corrupt_step else 1.0
