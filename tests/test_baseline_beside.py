"""The baseline beside the run (resolved.baseline_beside): rank 0
trains exactly the baseline a run of its own would (same losses), one step after each of the
run's timed steps, without changing the run's training; and each rank's CPU time against the
host's says how busy the host was with other work. Real gloo ranks of the session's pool."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from meshrun.core.baseline import baseline_config
from meshrun.core.config import with_resolved
from meshrun.driver.experiment import measure
from tests.ranks import config_in, losses

RUN = (
    "model=tiny",
    "train.steps=6",
    "train.untimed_steps=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=32",
    "metrics.baseline=off",
)


# -m slow: the main job's test (test_end_to_end) measures DDP beside its baseline in CI
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "pp2"])
def test_the_baseline_beside_the_run_is_the_single_device_run_and_leaves_it_alone(
    tmp_path, rank_pool, layout
):
    beside = with_resolved(
        config_in(tmp_path / "beside", *RUN, f"parallel={layout}"), baseline_beside=True
    )
    run = measure(beside, "run", rank_pool.launch)
    assert run.ok, run.meta.error
    alone = measure(
        config_in(tmp_path / "alone", *RUN, f"parallel={layout}"), "run", rank_pool.launch
    )
    assert losses(run) == losses(alone)  # training itself is untouched
    baseline = measure(baseline_config(beside), "baseline", rank_pool.launch)
    steps = run.report.baseline_steps
    assert [s.step for s in steps] == [2, 3, 4, 5]  # after its 2 untimed steps
    assert [s.loss for s in steps] == pytest.approx(losses(baseline)[2:], rel=1e-6)
    assert all(s.step_time_s > 0 for s in steps)
    timed = [s.step_time_s for s in run.steps if s.step_time_s is not None]
    assert len(timed) == len(steps)  # one round per timed step


@pytest.mark.slow
def test_a_cpu_hog_beside_the_run_is_the_share_other_processes_used(tmp_path, rank_pool):
    """A busy loop in another process takes a core's worth of the 2-core box's time while
    the run is timed; the run sees at least a fifth of the host's CPU go to others."""
    cfg = config_in(tmp_path, *RUN, "parallel=ddp", "train.steps=12", "debug.slow_step_s=0.1")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        run = measure(cfg, "run", rank_pool.launch)
    finally:
        hog.kill()
        hog.wait()
    assert run.ok, run.meta.error
    assert run.report.host_other_cpu_share >= 0.2
