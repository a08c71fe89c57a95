"""A run's metadata is built, never changed: each step that learns more of the run (how its
attempt ended, where its baseline came from, its export) makes a new RunMeta."""

from __future__ import annotations

import dataclasses

import pytest

from meshrun.core.run_files.metrics import StepRow
from meshrun.driver.experiment import attempt, begin, finish_experiment
from meshrun.driver.launch import RankFailure
from meshrun.driver.measured import Measured, RunMeta
from tests.helpers import resolved_config


def test_run_meta_is_frozen():
    meta = RunMeta()
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.status = "failed"  # type: ignore[misc]


def test_a_failed_attempt_is_a_new_meta_and_the_given_one_is_unchanged(tmp_path):
    def wait() -> None:
        raise RankFailure(1, "RuntimeError: boom", "Traceback ...")

    given = RunMeta()
    ended, returned = attempt(given, str(tmp_path), 0.0, wait)
    assert returned is None
    assert (ended.status, ended.failed_rank, ended.traceback) == ("failed", 1, "Traceback ...")
    assert ended.error.startswith("rank 1 failed: RuntimeError: boom")
    assert ended.run_id == given.run_id and ended.duration_s > 0
    assert (given.status, given.error, given.duration_s) == ("completed", None, None)


def test_the_baseline_mode_goes_into_the_record_not_into_the_measured_meta(tmp_path):
    cfg = resolved_config(
        "parallel=single",
        "train.steps=4",
        f"run_dir={tmp_path / 'run'}",
        f"store.path={tmp_path / 'store.db'}",
    )
    meta = begin(cfg, "run")
    steps = [StepRow(step=i, loss=5.0, step_time_s=0.1) for i in range(4)]
    measured = Measured(meta, steps)
    record = finish_experiment(cfg, measured, launch=lambda cfg: None)
    assert record.comparison.baseline_mode == "own" and record.run_id == meta.run_id
    assert measured.meta.baseline_mode is None and measured.meta is meta
