"""Held-out evaluation between training steps: the mean token cross-entropy of the model as
it stands over a fixed set of held-out batches, and its perplexity.

It runs what training runs minus the backward: the same micro-batches (a pipeline, a
schedule of training's kind and micro-batch count over the same modules, run through torch's
forward-only `eval`: ParallelModel.eval_schedule), the same autocast and the same loss,
under no_grad with the modules in eval mode. Every micro-batch
has the same number of tokens, so the mean of the micro-batch means is the mean over all
tokens; reduced like the training loss (mesh.mean_over_ranks), it is the same number in
every layout. It touches no parameter, gradient, optimizer or RNG state, so training goes
on bit for bit as without it; the loop keeps its time out of the step times and reports it
as `eval_time_s`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshrun.core.config import TrainConfig
from meshrun.rank.mesh import mean_over_ranks
from meshrun.rank.metrics.step_clock import StepClock
from meshrun.rank.parallel.loss import loss_context, micro_batch_loss
from meshrun.rank.parallel.parallel_model import ParallelModel
from meshrun.rank.train.data import HeldoutBatches


class Evaluator:
    def __init__(
        self,
        model: ParallelModel,
        heldout: HeldoutBatches,
        cfg: TrainConfig,
        dp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        autocast: Callable[[], contextlib.AbstractContextManager],
        across_replicas: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """`across_replicas`: torchft's mean over the replica groups, each of which evaluated
        its share of the held-out batches (in place)."""
        self.model = model
        self.across_replicas = across_replicas
        self.heldout = heldout
        self.every_steps = cfg.eval.every_steps
        self.steps = cfg.steps
        self.micro_batch = cfg.micro_batch_size
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.autocast = autocast
        self.clock = StepClock(heldout.device)

    def due(self, steps_done: int) -> bool:
        """After every `every_steps` steps, and after the last."""
        return steps_done % self.every_steps == 0 or steps_done == self.steps

    def __call__(self) -> dict[str, float]:
        """The evaluation's fields of the step record it follows (the one host sync)."""
        self.clock.restart()
        for part in self.model.parts:
            part.eval()
        try:
            with torch.no_grad():
                losses = torch.stack([self._loss(x, y) for x, y in self.heldout])
                loss = mean_over_ranks(losses.mean().reshape(1), self.dp_group, self.pp_group)
                if self.across_replicas is not None:
                    self.across_replicas(loss)
        finally:
            for part in self.model.parts:
                part.train()
        self.clock.mark()
        (seconds,) = self.clock.drain()
        return {
            "eval_loss": loss.item(),
            "eval_perplexity": loss.exp().item(),
            "eval_time_s": seconds,
        }

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One held-out batch's mean loss on this rank (zero off a pipeline's last stage)."""
        if self.model.schedule is not None:
            with self.autocast():
                return self.model.run_schedule(inputs, targets, train=False)
        module = self.model.parts[0]
        chunks = list(
            zip(inputs.split(self.micro_batch), targets.split(self.micro_batch), strict=True)
        )
        total = torch.zeros((), device=inputs.device)
        method = self.model.loss.method
        for x, y in chunks:
            with self.autocast(), loss_context(method):
                total += micro_batch_loss(module, x, y, method)
        return total / len(chunks)
