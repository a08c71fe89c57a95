"""A rank that fails or hangs brings the whole run down promptly: meshrun exits non-zero
naming the rank, leaves no process behind, and still records the run and its finished steps."""

from __future__ import annotations

FAIL = ("model=tiny", "parallel=ddp", "train.steps=8", "train.warmup_steps=1", "train.log_every=1")


def test_raising_rank_fails_run_fast_and_is_recorded(meshrun, marked_env):
    run = meshrun(*FAIL, "debug.fail_rank=1", "debug.fail_step=3", env=marked_env)
    assert run.returncode == 1
    assert run.seconds < 60
    assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 3" in run.output
    results = run.results
    assert results["status"] == "failed"
    assert results["failed_rank"] == 1
    assert len(results["losses"]) == 3  # steps 0..2 finished and are kept
    [row] = run.stored()
    assert row["status"] == "failed"
    assert "injected failure" in row["error"]
    assert row["losses"] == results["losses"]


def test_hanging_rank_times_out_instead_of_hanging(meshrun, marked_env):
    run = meshrun(*FAIL, "debug.fail_rank=1", "debug.fail_step=2", "debug.fail_mode=hang",
                  "backend.timeout_s=5", env=marked_env)  # fmt: skip
    assert run.returncode == 1
    assert run.seconds < 90
    assert "Timed out" in run.output
    assert run.results["status"] == "failed"
    assert run.results["failed_rank"] == 0  # the peer whose collective timed out
