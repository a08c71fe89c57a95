"""Started by torchrun, `meshrun` acts as one rank: all ranks share one run dir, every rank
takes the same decision about the baseline (rank 0 trains it between the run's steps while
the others wait), and rank 0 records the run and its baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
ARGS = [
    "-m",
    "meshrun.driver.cli",
    "model=tiny",
    "logger=none",
    "train.progress_bar=false",
    "train.steps=6",
]


def torchrun(cwd: Path, *overrides: str, command=tuple(TORCHRUN)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command, *ARGS, f"store.path={cwd / 'meshrun.db'}", *overrides],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def check_ddp_recorded_once(cwd: Path, proc: subprocess.CompletedProcess) -> Path:
    """A completed 2-rank DDP run, reported by rank 0 alone; returns its results.json."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [results_file] = (cwd / "outputs" / "torchrun").glob("*/results.json")
    results = json.loads(results_file.read_text())
    assert results["status"] == "completed"
    assert results["world_size"] == 2
    assert results["speedup"] is not None
    assert proc.stdout.count("meshrun: tiny / ddp2") == 1  # rank 0 reports
    return results_file


@pytest.mark.slow
def test_torchrun_ranks_share_one_run_dir_and_record_once(tmp_path):
    results_file = check_ddp_recorded_once(tmp_path, torchrun(tmp_path, "parallel=ddp"))
    assert (results_file.parent / "baseline" / "results.json").exists()
    results = json.loads(results_file.read_text())
    # 6 steps, 2 untimed: 4 rounds
    assert results["baseline_mode"] == "fresh" and results["speedup_rounds"] == 4


def test_torchrun_world_that_does_not_fit_the_layout_is_a_config_error(meshrun_here, monkeypatch):
    """As rank 0 of the two that torchrun started (its environment; the run above starts real
    ones): exit 2 before any process group, nothing recorded."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    run = meshrun_here("model=tiny", "parallel=single")
    assert run.returncode == 2, run.output
    assert "WORLD_SIZE=2: torchrun started 2 ranks but parallel=single needs 1" in run.output
    assert not run.store_path.exists()
