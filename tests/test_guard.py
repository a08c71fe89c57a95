"""Non-finite steps (issue 36, item 1): a step whose loss is not finite is skipped on every
rank alike in every precision, counted in the record, and a streak of them stops the run
naming the last good checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshrun.core.checkpoints import complete
from meshrun.core.run_files.metrics import ROLLED_BACK_FILE
from meshrun.driver.experiment import measure
from meshrun.driver.inspection import skipped_fields
from meshrun.driver.tool_config import TOLERANCES
from meshrun.rank.train.guard import SPIKE, SpikeWatch, corruption
from tests.helpers import compose_config
from tests.ranks import config_in, losses

COMMON = (
    "model=tiny",
    "train.steps=10",
    "train.untimed_steps=1",
    "train.seq_len=32",
    "train.log_every=1",
    "metrics.baseline=off",
)


def _run(tmp: Path, rank_pool, *overrides: str):
    return measure(config_in(tmp, *COMMON, *overrides), "run", rank_pool.launch)


@pytest.mark.parametrize(
    ("layout", "precision"), [("ddp", "bf16"), pytest.param("pp2", "fp32", marks=pytest.mark.slow)]
)
def test_a_non_finite_step_is_skipped_on_every_rank_and_counted(
    tmp_path, rank_pool, layout, precision
):
    """The ranks stay one model through the skip (a pipeline's first stage sees the NaN only
    through its gradients): the corrupted run trains as the corrupted single device does;
    before the step it trained as the clean run."""
    nan = ("debug.corrupt_step=5", "debug.corrupt_mode=nan", f"train.precision={precision}")
    parallel = f"parallel={layout}"
    clean = _run(tmp_path / "clean", rank_pool, parallel, f"train.precision={precision}")
    single = _run(tmp_path / "single", rank_pool, "parallel=single", *nan)
    run = _run(tmp_path / "run", rank_pool, parallel, *nan)
    assert single.ok and run.ok and clean.ok, run.meta.error
    got = losses(run)
    assert got[:5] == losses(clean)[:5]
    assert math.isnan(got[5]) and all(math.isfinite(loss) for loss in got[6:])
    for step, (loss, want) in enumerate(zip(got[6:], losses(single)[6:], strict=True), 6):
        assert abs(loss - want) <= TOLERANCES[precision] * want, f"step {step}"
    # the skipped step's update is missing, nothing else: the curve stays the clean one's
    for loss, want in zip(got[6:], losses(clean)[6:], strict=True):
        assert abs(loss - want) < 0.01 * want
    assert skipped_fields(run.steps) == {"skipped_steps": [5], "steps_skipped": 1}


def test_a_streak_of_skipped_steps_stops_the_run_naming_the_last_checkpoint(tmp_path, rank_pool):
    """fp16 at a scale of 2**40 overflows step after step: the third in a row stops it."""
    failed = _run(
        tmp_path,
        rank_pool,
        "parallel=single",
        "train.precision=fp16",
        f"train.loss_scale.init={2**40}",
        "train.guard.max_skipped=3",
        "checkpoint.every_steps=1",
    )
    assert not failed.ok
    error = failed.meta.error
    assert "NonFiniteSteps: 3 steps in a row up to step 2" in error
    assert "train.guard.max_skipped=3" in error
    [last, *_] = reversed(complete(tmp_path / "run" / "checkpoints"))
    assert f"the last good checkpoint: {last}" in error
    assert skipped_fields(failed.steps)["skipped_steps"] == [0, 1, 2]


def test_corruption_multiplies_only_its_step():
    nan = corruption(compose_config("debug.corrupt_step=3").debug)
    assert nan(2) == 1.0 and math.isnan(nan(3))
    spike = corruption(compose_config("debug.corrupt_step=3", "debug.corrupt_mode=spike").debug)
    assert spike(3) == SPIKE and spike(4) == 1.0
    assert corruption(compose_config().debug) is None


SPIKE_RUN = (
    "parallel=ddp",
    "train.steps=20",
    "checkpoint.every_steps=5",
    "train.log_every=5",
    "train.guard.spike=true",
)


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_loss_spike_rolls_back_to_the_checkpoint_and_skips_its_batches(tmp_path, rank_pool):
    """The spike's batch (step 12's) found at the step-14 log step: back to the step-10
    checkpoint, batches 10-12 skipped, the run goes on to step 19 under the same id."""
    clean = _run(tmp_path / "clean", rank_pool, *SPIKE_RUN)
    spiked = _run(
        tmp_path / "spiked", rank_pool, *SPIKE_RUN, "debug.corrupt_step=12",
        "debug.corrupt_mode=spike",
    )  # fmt: skip
    assert spiked.ok, spiked.meta.error
    [rollback] = spiked.report.rollbacks
    assert (rollback.step, rollback.restored_step, rollback.skipped_batches) == (12, 10, (10, 12))
    assert rollback.loss > rollback.mean + 5 * rollback.std
    got = losses(spiked)
    assert [s.step for s in spiked.steps] == list(range(20))  # each step once
    assert got[:10] == losses(clean)[:10]
    assert max(got[10:]) < max(got[:10])  # no spike kept; training went on
    undone = _steps(tmp_path / "spiked" / "run" / ROLLED_BACK_FILE)
    assert [(s["step"], s["rollback"]) for s in undone] == [(s, 1) for s in range(10, 15)]
    assert undone[2]["loss"] > SPIKE / 2 * got[9]  # the spike, kept where it is told
    # the same run resumed from its step-15 checkpoint trains on the same batches
    root = tmp_path / "spiked" / "run" / "checkpoints"
    resumed = measure(
        config_in(
            tmp_path / "resumed", *COMMON, *SPIKE_RUN, f"checkpoint.resume={root}/step-00000015"
        ),
        "run",
        rank_pool.launch,
    )
    assert resumed.ok and losses(resumed) == pytest.approx(got[15:], rel=1e-5)  # steps 15-19


def test_the_spike_watch_judges_against_the_window_before_each_loss():
    cfg = compose_config("train.guard.spike=true", "train.guard.spike_window=8").train.guard
    watch = SpikeWatch(cfg)
    steady = [5.0, 5.1, 4.9, 5.0, 5.05, 4.95, 5.0, 5.1]
    assert watch.judge(0, [*steady[:3], 50.0]) is None  # under half a window: not judged
    watch = SpikeWatch(cfg)
    assert watch.judge(0, steady) is None
    spike = watch.judge(8, [5.0, float("nan"), 5.6])  # NaN is skipped, not a spike
    assert spike is not None and spike.step == 10 and spike.loss == 5.6
    watch.forget_from(4)
    assert [step for step, _ in watch.window] == [1, 2, 3]  # the window held steps 1-8


def test_a_spike_before_any_checkpoint_stops_the_run_with_the_reason(tmp_path, rank_pool):
    failed = _run(
        tmp_path, rank_pool, *SPIKE_RUN, "checkpoint.every_steps=15", "debug.corrupt_step=12",
        "debug.corrupt_mode=spike",
    )  # fmt: skip
    assert not failed.ok
    assert "LossSpikes: the loss spiked at step 12" in failed.meta.error
    assert "before the run saved any checkpoint" in failed.meta.error
    assert [s.step for s in failed.steps] == list(range(15))  # every finished step kept
