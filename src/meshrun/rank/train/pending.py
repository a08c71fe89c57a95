"""The steps since the last log step: each one's loss and gradient norm, still on device, its
LR and its clock marks. A log step reduces the losses across ranks (loop._flush); a rank that
fails first writes its own share instead (`salvage`), with no collective (a peer may be dead)
and without waiting on the device (work queued after a finished step may never finish)."""

from __future__ import annotations

import contextlib

import torch

from meshrun.core.run_files.metrics import StepRow
from meshrun.rank.metrics.step_clock import StepClock


def step_records(
    first_step: int,
    losses: list[float],
    norms: list[float],
    lrs: list[float],
    times: list[float],
    data_waits: list[float],
) -> list[StepRow]:
    """metrics.jsonl's records; `times` are those of the last steps (the first may be untimed)."""
    timed_from = len(losses) - len(times)
    return [
        StepRow(
            step=first_step + i,
            loss=loss,
            grad_norm=norms[i],
            lr=lrs[i],
            step_time_s=times[i - timed_from] if i >= timed_from else None,
            data_wait_s=data_waits[i],
        )
        for i, loss in enumerate(losses)
    ]


class PendingSteps:
    def __init__(self, device: torch.device, first_step: int) -> None:
        self.clock = StepClock(device)
        self.first_step = first_step
        self.values: list[torch.Tensor] = []  # (loss, grad norm) per step
        self.lrs: list[float] = []
        self._done: list[torch.cuda.Event] = []  # CUDA: recorded after each step's values
        self._cuda = device.type == "cuda"

    def add(self, values: torch.Tensor, lr: float) -> None:
        self.values.append(values)
        self.lrs.append(lr)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()  # queued, no sync: salvage asks it whether the step is done
            self._done.append(event)

    def take(self) -> tuple[int, list[torch.Tensor], list[float]]:
        """The log step's first step, values and LRs; the buffer starts after them."""
        taken = self.first_step, self.values, self.lrs
        self.first_step += len(self.values)
        self.values, self.lrs, self._done = [], [], []
        return taken

    def salvage(self, data_waits: list[float]) -> list[StepRow]:
        """After a failure: this rank's records of the steps the device has finished, its own
        loss (zero on a pipeline stage before the last). Step times only when all are done,
        as the clock's marks then are too."""
        done = len(self.values)
        if self._cuda:
            done = next((i for i, event in enumerate(self._done) if not event.query()), done)
        if not done:
            return []
        with torch.cuda.stream(torch.cuda.Stream()) if self._cuda else contextlib.nullcontext():
            values = torch.stack(self.values[:done]).cpu()  # a fresh stream waits on nothing
        times = self.clock.drain() if done == len(self.values) else []
        first, _, lrs = self.take()
        return step_records(
            first, values[:, 0].tolist(), values[:, 1].tolist(), lrs, times, data_waits
        )
