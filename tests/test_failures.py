"""A rank that fails or hangs brings the whole run down promptly: the run fails naming the
rank, leaves no process behind, and still records the run and its finished steps. The driver's
flow in-process (driver.experiment.run_experiment) over the real launcher (torch elastic), so
that teardown of every rank is what is tested: in the session's launch host (its ranks forked
from its forkserver), or in-process where the ranks carry a marked environment to find
survivors by; the CLI's exit codes are test_verify's and test_config_errors'."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from meshrun.core.hardware import oom_kills
from meshrun.driver.experiment import RunFailed, measure, reported, run_experiment
from meshrun.driver.launch import SIGNAL_UNSEEN
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
    results, store, seconds = failed_run(
        tmp_path, monkeypatch, marked_env, *FAIL, "debug.fail_rank=1", "debug.fail_step=3"
    )
    assert seconds < 60
    assert "rank 1 failed: RuntimeError: injected failure on rank 1 at step 3" in results["error"]
    assert results["status"] == "failed"
    assert results["failed_rank"] == 1
    assert len(results["losses"]) == 3  # steps 0..2 finished and are kept
    [row] = store.runs()
    assert row["status"] == "failed"
    assert "injected failure" in row["error"]
    assert row["losses"] == results["losses"]


@pytest.mark.waits  # on backend.timeout_s
def test_hanging_rank_times_out_instead_of_hanging(tmp_path, monkeypatch, marked_env):
    results, _, seconds = failed_run(
        tmp_path,
        monkeypatch,
        marked_env,
        *FAIL,
        "debug.fail_rank=1",
        "debug.fail_step=2",
        "debug.fail_mode=hang",
        "backend.timeout_s=5",
    )
    assert seconds < 90
    assert "Timed out" in results["error"]
    assert results["status"] == "failed"
    assert results["failed_rank"] == 0  # the peer whose collective timed out


# Steps 0-2 finish before rank 1 fails at step 3; the first log step would be step 4.
UNLOGGED = (
    "model=tiny",
    "train.steps=6",
    "train.untimed_steps=1",
    "train.log_every=5",
    "debug.fail_rank={rank}",
    "debug.fail_step=3",
)


def _unlogged(parallel: str, rank: int, *more: str) -> tuple[str, ...]:
    return (f"parallel={parallel}", *(o.format(rank=rank) for o in UNLOGGED), *more)


def test_steps_after_the_last_log_step_survive_a_failure(tmp_path, experiment, launch_host):
    """A single rank: the failed run's steps are the completed run's, exactly."""
    _, completed = experiment(
        "model=tiny",
        "parallel=single",
        "train.steps=6",
        "train.untimed_steps=1",
        "train.log_every=5",
    )
    cfg = config_in(tmp_path, *_unlogged("single", 0))
    failed = measure(cfg, "run", launch_host.launch)
    assert failed.meta.status == "failed"
    keys = ("step", "loss", "grad_norm", "lr")
    assert [{k: s[k] for k in keys} for s in failed.steps] == [
        {k: s[k] for k in keys} for s in completed.steps[:3]
    ]
    assert [s["step_time_s"] is not None for s in failed.steps] == [False, True, True]
    assert not any("partial_loss" in s for s in failed.steps)


def test_failed_ddp_run_keeps_the_dp_mean_and_prints_the_traceback(
    tmp_path, experiment, capsys, launch_host
):
    """Both ranks write their own losses as they fail; the driver's mean is the log step's.
    The failing rank's traceback is printed once beside the one-line error, and kept."""
    _, completed = experiment(
        "model=tiny", "parallel=ddp", "train.steps=6", "train.untimed_steps=1", "train.log_every=5"
    )
    cfg = config_in(tmp_path, *_unlogged("ddp", 1))
    capsys.readouterr()
    assert reported(lambda: run_experiment(cfg, launch_host.launch)) == 1
    out = capsys.readouterr().out
    results = json.loads((Path(cfg.run_dir) / "results.json").read_text())
    assert results["losses"] == [s["loss"] for s in completed.steps[:3]]
    assert results["grad_norms"] == [s["grad_norm"] for s in completed.steps[:3]]
    assert results["failed_rank"] == 1
    trace = results["traceback"]
    assert trace.startswith("Traceback (most recent call last):")
    assert "in inject" in trace and trace.rstrip().endswith(
        "RuntimeError: injected failure on rank 1 at step 3 (debug.fail_rank)"
    )
    assert out.count("Traceback (most recent call last):") == 1
    assert "in inject" in out
    assert "meshrun: run failed rank 1 failed: RuntimeError: injected failure" in out


def test_rank_killed_by_a_signal_is_the_one_named(tmp_path, launch_host):
    """Rank 1 SIGKILLs itself (no exception, no record, as the OOM killer leaves it); rank 0
    records the closed connection, yet rank 1 is named, with the memory figures. Only rank 0
    wrote its steps: their losses are rank 0's alone, and marked so."""
    cfg = config_in(tmp_path, *_unlogged("ddp", 1, "debug.fail_mode=kill"))
    failed = measure(cfg, "run", launch_host.launch)
    error = failed.meta.error
    assert failed.meta.failed_rank == 1
    assert error.startswith(tuple(f"rank 1 was killed ({s}), " for s in ("SIGKILL", SIGNAL_UNSEEN)))
    figures = (
        r"predicted peak \d+\.\d\d GiB per rank \(plan\), measured \d+\.\d\d GiB resident "
        r"before it died, host has \d+\.\d GiB for 2 rank\(s\)"
    )
    assert re.search(figures, error)
    # "out of memory" is claimed only where the kernel's counter says so
    counted = ("oom_kill count did not change" in error) or ("oom_kill count rose" in error)
    assert counted is (oom_kills() is not None)
    assert ("most likely out of host memory" in error) is not counted
    assert failed.meta.traceback is None
    assert [(s["step"], s.get("partial_loss")) for s in failed.steps] == [
        (0, True),
        (1, True),
        (2, True),
    ]
