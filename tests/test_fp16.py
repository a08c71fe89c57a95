"""fp16 with dynamic loss scaling: layouts agree with one device, an overflowing step is
skipped on every rank alike and the scale backs off, and the scale survives a resume."""

from __future__ import annotations

import pytest

from meshrun.core.checkpoints import complete
from meshrun.driver.inspection import skipped_fields
from meshrun.driver.tool_config import TOLERANCES
from tests.ranks import losses, measured_in

COMMON = (
    "model=tiny",
    "train.steps=8",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=32",
    "train.seed=4",
    "train.precision=fp16",
    "metrics.baseline=off",
)


@pytest.fixture(scope="module")
def single_fp16(tmp_path_factory, rank_pool) -> list[float]:
    return losses(
        measured_in(tmp_path_factory.mktemp("single"), rank_pool, *COMMON, "parallel=single")
    )


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("ddp", marks=pytest.mark.slow),
        pytest.param("pp2", marks=pytest.mark.slow),
        pytest.param("fsdp", marks=pytest.mark.slow),
        pytest.param("tp2", marks=pytest.mark.slow),
    ],
)
def test_fp16_layouts_train_like_one_device(tmp_path, rank_pool, single_fp16, layout):
    got = losses(measured_in(tmp_path, rank_pool, *COMMON, f"parallel={layout}"))
    for step, (loss, want) in enumerate(zip(got, single_fp16, strict=True)):
        assert abs(loss - want) <= TOLERANCES["fp16"] * want, f"step {step}: {loss} vs {want}"
    assert got[-1] < got[0]


@pytest.mark.parametrize("layout", ["single", pytest.param("pp2", marks=pytest.mark.slow)])
def test_overflowing_steps_are_skipped_and_the_scale_backs_off(tmp_path, rank_pool, layout):
    """A scale of 2**26 overflows fp16's gradients: the first steps are skipped, the scale
    halves each time until the gradients fit, and the run then trains."""
    measured = measured_in(
        tmp_path,
        rank_pool,
        *COMMON,
        f"parallel={layout}",
        f"train.loss_scale.init={2**26}",
        "train.steps=16",
    )
    skipped = skipped_fields(measured.steps)["skipped_steps"]  # every rank skipped them
    assert skipped[:4] == [0, 1, 2, 3] and len(skipped) <= 10, skipped  # 2**22 still overflows
    trained = [step for step in range(16) if step not in skipped]
    got = losses(measured)
    assert got[-1] < got[trained[0]]


@pytest.mark.slow
def test_the_loss_scale_survives_a_resume_bit_for_bit(tmp_path, rank_pool):
    """A scale that overflows at first and grows every 2 steps: the scale and its count of
    good steps are in the checkpoint, so the resumed run skips and grows as the whole did."""
    scaling = (f"train.loss_scale.init={2**26}", "train.loss_scale.growth_interval=2")
    whole = measured_in(
        tmp_path / "whole", rank_pool, *COMMON, "parallel=ddp", "checkpoint.every_steps=4", *scaling
    )
    first = complete(tmp_path / "whole" / "run" / "checkpoints")[0]
    resumed = measured_in(
        tmp_path / "resumed",
        rank_pool,
        *COMMON,
        "parallel=ddp",
        f"checkpoint.resume={first}",
        f"checkpoint.dir={tmp_path}/more",
        *scaling,
    )
    assert losses(resumed) == losses(whole)[4:]  # a new run: its steps from 4 on
