"""Dynamic loss scaling for fp16 training (torch's GradScaler algorithm): the loss is
multiplied by `scale` before backward so small gradients survive fp16; the gradients are
divided by it before the norm, clipping and the step. A step whose gradient norm is not
finite is skipped and the scale halved; after `growth_interval` finite steps in a row it
doubles.

Unlike GradScaler, the overflow decision is the global gradient norm, which every rank
computes the same (DTensor reduces over its mesh, pipeline stages add theirs): every rank
skips the same steps under any layout, with no extra collective. It costs one host sync a
step (GradScaler's `step` has the same), so only fp16 runs pay it.
"""

from __future__ import annotations

import math

import torch

from meshrun.core.config import LossScaleConfig
from meshrun.rank.train.optim import LocalGrads


class LossScale:
    def __init__(self, cfg: LossScaleConfig) -> None:
        self.scale = float(cfg.init)
        self.growth_interval = cfg.growth_interval
        self.good_steps = 0

    def unscale(self, grads: LocalGrads) -> None:
        grads.scale_(1.0 / self.scale)

    def update(self, norm: torch.Tensor) -> bool:
        """Whether the step may update the weights (its gradients are finite)."""
        if not math.isfinite(norm.item()):
            self.scale /= 2
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2
            self.good_steps = 0
        return True

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
