"""A rank that fails or hangs brings the whole run down promptly: the run fails naming the
rank, leaves no process behind, and still records the run and its finished steps. The driver's
flow in-process (driver.experiment.run_experiment) over the real launcher (torch elastic), so
that teardown of every rank is what is tested: in the session's launch host (its ranks forked
from its forkserver), or in-process where the ranks carry a marked environment to find
survivors by; the CLI's exit codes are test_verify's and test_config_errors'."""

from __future__ import annotations

import json
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshrun.core.hardware import oom_kills
from meshrun.core.run_files.failures import (
    FAILURES_DIR,
    await_peers_records,
    note_process,
    read_unflushed,
    record_failure,
    record_unflushed,
)
from meshrun.core.run_files.metrics import StepRow
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
    assert [{k: getattr(s, k) for k in keys} for s in failed.steps] == [
        {k: getattr(s, k) for k in keys} for s in completed.steps[:3]
    ]
    assert [s.step_time_s is not None for s in failed.steps] == [False, True, True]
    assert not any(s.partial_loss is not None for s in failed.steps)


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
    assert results["losses"] == [s.loss for s in completed.steps[:3]]
    assert results["grad_norms"] == [s.grad_norm for s in completed.steps[:3]]
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
    assert [(s.step, s.partial_loss) for s in failed.steps] == [
        (0, True),
        (1, True),
        (2, True),
    ]


def _in_a_process(code: str, file_bytes: int = resource.RLIM_INFINITY):
    """`code` run by a Python of its own, whose files may grow to `file_bytes`."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))

    command = [sys.executable, "-c", code]
    return subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=60, preexec_fn=limited
    )


def test_steps_cut_off_as_they_are_written_leave_the_earlier_record_whole(tmp_path):
    """A rank whose write is cut off (here by the kernel's 4 KiB file-size limit, as a
    SIGTERM from torch elastic or an error could mid-write) leaves the record it had whole,
    never a torn file the driver cannot read (CI saw `JSONDecodeError` from such a rank)."""
    record_unflushed(str(tmp_path), 0, [StepRow(step=0, loss=1.0)])
    many = "[StepRow(step=s, loss=1.0) for s in range(1000)]"  # ~100 KiB of JSON
    write = (
        "from meshrun.core.run_files.failures import record_unflushed as write; "
        "from meshrun.core.run_files.metrics import StepRow; write"
    )
    cut = _in_a_process(f"{write}({str(tmp_path)!r}, 0, {many})", file_bytes=4096)
    assert cut.returncode != 0 and "File too large" in cut.stderr, cut.stderr
    assert read_unflushed(str(tmp_path)) == {0: [StepRow(step=0, loss=1.0)]}


def test_a_stop_signal_waits_until_a_failing_rank_has_written_its_records(tmp_path):
    """torch elastic's SIGTERM to a rank still writing its failure: noted, then delivered
    once the records are on disk (the rank still ends by it); unheld, it ends the rank first."""

    def failing_rank(record: Path, hold: bool) -> subprocess.CompletedProcess:
        return _in_a_process(
            "import os, signal, pathlib; from meshrun.rank import stop_signals; "
            + ("stop_signals.hold(); " if hold else "")
            + "os.kill(os.getpid(), signal.SIGTERM); "
            + f"pathlib.Path({str(record)!r}).write_text('whole'); stop_signals.release(); "
            + "print('not reached')"
        )

    held = failing_rank(tmp_path / "held", hold=True)
    assert held.returncode == -signal.SIGTERM, held.stderr
    assert (tmp_path / "held").read_text() == "whole" and "not reached" not in held.stdout
    unheld = failing_rank(tmp_path / "unheld", hold=False)
    assert unheld.returncode == -signal.SIGTERM and not (tmp_path / "unheld").exists()


def test_a_failed_rank_exits_only_once_its_live_peers_have_recorded_theirs(tmp_path):
    """Torch elastic stops the others at a failed rank's exit: that rank waits until each
    peer on its host still running has recorded its failure (CI lost rank 0's steps, and a DDP
    run's mean became rank 1's loss, when rank 1 exited first), never past the bound, and not
    for a peer already gone."""
    run_dir = str(tmp_path)
    note_process(run_dir, 0)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        noted = {"host": socket.gethostname(), "pid": live.pid}
        (tmp_path / FAILURES_DIR / "process-rank1.json").write_text(json.dumps(noted))
        started = time.monotonic()
        await_peers_records(run_dir, 0, 1.0)
        assert 1.0 <= time.monotonic() - started < 5  # rank 1 runs and recorded nothing
        threading.Timer(0.3, record_failure, (run_dir, 1, RuntimeError("peer"))).start()
        started = time.monotonic()
        await_peers_records(run_dir, 0, 30.0)
        assert 0.3 <= time.monotonic() - started < 5
        (tmp_path / FAILURES_DIR / "rank1.json").unlink()
        live.kill()
        live.wait()
        started = time.monotonic()
        await_peers_records(run_dir, 0, 30.0)
        assert time.monotonic() - started < 5  # its process is gone
