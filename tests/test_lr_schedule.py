"""The LR schedule: a linear warmup to train.lr, then constant, linear or cosine decay to
the floor at the last step; a run trains each step at the LR the schedule gives and logs it,
under a layout as on one device."""

from __future__ import annotations

import itertools
import math

import pytest

from meshrun.core.config import LrScheduleConfig
from meshrun.rank.train.optim import lr_factor
from tests.ranks import losses

STEPS = 10


def factors(decay: str, warmup: int = 2, floor: float = 0.1) -> list[float]:
    schedule = LrScheduleConfig(decay=decay, warmup_steps=warmup, min_lr_ratio=floor)
    return [lr_factor(step, schedule, STEPS) for step in range(STEPS)]


def test_warmup_reaches_the_lr_then_each_decay_ends_at_the_floor():
    for decay in ("constant", "linear", "cosine"):
        got = factors(decay)
        assert got[:3] == [0.5, 1.0, 1.0]  # warmup's last step and the first after it: full LR
        assert got[-1] == pytest.approx(1.0 if decay == "constant" else 0.1)
    linear, cosine = factors("linear"), factors("cosine")
    assert linear[2:] == pytest.approx([0.1 + 0.9 * (1 - i / 7) for i in range(8)])
    assert cosine[2:] == pytest.approx(
        [0.1 + 0.45 * (1 + math.cos(math.pi * i / 7)) for i in range(8)]
    )
    assert all(a >= b for a, b in itertools.pairwise(cosine[1:]))
    assert factors("constant", warmup=0) == [1.0] * STEPS


RUN = (
    "model=tiny",
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.lr=1e-3",
    "train.lr_schedule.decay=cosine",
    "train.lr_schedule.warmup_steps=3",
    "train.lr_schedule.min_lr_ratio=0.1",
    "metrics.baseline=off",
)


@pytest.mark.slow
def test_each_step_trains_and_logs_the_scheduled_lr_under_any_layout(experiment):
    _, single = experiment(*RUN, "parallel=single")
    _, fsdp = experiment(*RUN, "parallel=fsdp")
    schedule = LrScheduleConfig(decay="cosine", warmup_steps=3, min_lr_ratio=0.1)
    expected = [1e-3 * lr_factor(step, schedule, STEPS) for step in range(STEPS)]
    for measured in (single, fsdp):
        assert measured.ok, measured.meta.error
        assert [s.lr for s in measured.steps] == pytest.approx(expected, rel=1e-12)
    assert losses(fsdp) == pytest.approx(losses(single), rel=1e-4)
    _, constant = experiment(*RUN[:4], "parallel=single", "metrics.baseline=off")
    assert losses(constant)[1] != pytest.approx(losses(single)[1], rel=1e-6)  # the LR matters
