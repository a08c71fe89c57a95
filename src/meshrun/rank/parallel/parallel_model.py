"""What one rank trains once its model is in parallel form: its part(s), and under PP the
schedule that drives them (one pass of it: `run_schedule`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule

from meshrun.rank.parallel.loss import loss_context
from meshrun.rank.parallel.pipeline import ScaledLoss
from meshrun.rank.parallel.tied import TiedWeights


@dataclass
class ParallelModel:
    """What one rank trains: its model part(s) and, under PP, the schedule that drives them."""

    parts: list[nn.Module]
    schedule: _PipelineSchedule | None = None
    is_first_stage: bool = True
    is_last_stage: bool = True
    pretrained_bytes_read: int = 0
    new_schedule: Callable[[], _PipelineSchedule] | None = None  # another one over `parts`
    loss: ScaledLoss = dataclasses.field(default_factory=ScaledLoss)  # its method: train.loss's
    tied: TiedWeights | None = None  # a tied embedding's end on a pipeline's first/last stage
    float8_scales: bool = False  # FSDP2 all-gathers float8 weights at precomputed scales

    def refresh_float8_scales(self) -> None:
        """The float8 all-gather's scales from the weights as they now are: after each
        optimizer step and each load of the weights (parallel/float8.py)."""
        if self.float8_scales:
            from meshrun.rank.parallel.float8 import refresh_scales  # noqa: PLC0415

            refresh_scales(self.parts)

    def norm_copies(self) -> list[nn.Parameter]:
        """Parameters that copy another rank's (a tied head): left out of the gradient norm."""
        return [self.tied.param] if self.tied is not None and self.tied.is_copy else []

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters() if p.requires_grad]

    @functools.cached_property
    def eval_schedule(self) -> _PipelineSchedule:
        """The evaluation's own schedule over the same modules, only ever run forward-only.
        One schedule switched between `eval` and `step` re-initialises its stages (P2P
        warm-up, shape inference, buffers) at every switch, and the switch back would run
        inside the next timed training step."""
        return self.new_schedule(loss_fn=ScaledLoss(self.loss.method))

    def run_schedule(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        train: bool = True,
        loss_scale: float = 1.0,
        loss_factor: float = 1.0,
    ) -> torch.Tensor:
        """One pass of a pipeline schedule over a batch: a training step (its backward
        from the loss times `loss_scale`; the loss itself times `loss_factor`: a corrupted
        step's), or forward only (`train` false:
        `eval_schedule.eval`, which skips every backward action). Neither keeps the last
        stage's outputs: torch's schedule would hold every micro-batch's logits until the
        step ends (m x micro-batch x seq x vocab floats), for a merged output nobody reads.
        The mean of the micro-batch losses (unscaled) on the last stage, zero elsewhere."""
        self.loss.scale = loss_scale if train else 1.0
        self.loss.factor = loss_factor if train else 1.0
        losses: list[torch.Tensor] = []
        kwargs = {
            "target": targets if self.is_last_stage else None,
            "losses": losses,
            "return_outputs": False,
        }
        if self.loss.method == "chunked":  # the last stage's head takes its micro-batch's
            kwargs["targets"] = targets
        run = self.schedule.step if train else self.eval_schedule.eval
        with loss_context(self.loss.method):
            if self.is_first_stage:
                run(inputs, **kwargs)
            else:
                run(**kwargs)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([loss.detach() for loss in losses]).mean() / self.loss.scale

    @property
    def casts_params(self) -> bool:
        """FSDP casts parameters itself (MixedPrecisionPolicy); other wrappers need autocast."""
        return isinstance(self.parts[0], FSDPModule)
