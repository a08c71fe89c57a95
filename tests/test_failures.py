"""A rank that fails or hangs brings the whole run down promptly: the run fails naming the
rank, leaves no process behind, and still records the run and its finished steps. The driver's
flow in-process (driver.experiment.run_experiment) over the real launcher (torch elastic), so
that teardown of every rank is what is tested; the CLI's exit codes are test_verify's and
test_config_errors'."""

from __future__ import annotations

import time

import pytest

from meshrun.driver.experiment import RunFailed, run_experiment
from meshrun.driver.launch.local import launch_local
from meshrun.driver.sinks.store import ResultsStore
from tests.ranks import config_in

FAIL = ("model=tiny", "parallel=ddp", "train.steps=8", "train.untimed_steps=1", "train.log_every=1")


def failed_run(tmp_path, monkeypatch, env, *overrides):
    """The results of a run that must fail, its store and how long it took."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the ranks inherit it: marked_env finds survivors
    cfg = config_in(tmp_path, *overrides)
    started = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        run_experiment(cfg, launch_local)
    return failed.value.results.as_dict(), ResultsStore(cfg.store.path), time.monotonic() - started


def test_raising_rank_fails_run_fast_and_is_recorded(tmp_path, monkeypatch, marked_env):
    results, store, seconds = failed_run(tmp_path, monkeypatch, marked_env, *FAIL,
                                         "debug.fail_rank=1", "debug.fail_step=3")  # fmt: skip
    assert seconds < 60
    assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 3" in results["error"]
    assert results["status"] == "failed"
    assert results["failed_rank"] == 1
    assert len(results["losses"]) == 3  # steps 0..2 finished and are kept
    [row] = store.runs()
    assert row["status"] == "failed"
    assert "injected failure" in row["error"]
    assert row["losses"] == results["losses"]


def test_hanging_rank_times_out_instead_of_hanging(tmp_path, monkeypatch, marked_env):
    results, _, seconds = failed_run(tmp_path, monkeypatch, marked_env, *FAIL, "debug.fail_rank=1",
                                     "debug.fail_step=2", "debug.fail_mode=hang",
                                     "backend.timeout_s=5")  # fmt: skip
    assert seconds < 90
    assert "Timed out" in results["error"]
    assert results["status"] == "failed"
    assert results["failed_rank"] == 0  # the peer whose collective timed out
