"""`meshrun-verify` passes a correct layout, fails a user TP plan that silently changes the
math, and stops bad configs and crashing ranks with the same messages and exit codes as
`meshrun`. Real gloo processes, model=tiny, 10 steps."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from meshrun.core.paths import REPO_ROOT
from tests.cli import CliRun, run_meshrun

TOLERANCE = 1e-4
VERIFY_MODULE = (sys.executable, "-m", "meshrun.tools.verify")


def run_verify(
    tmp_path: Path, *overrides: str, entrypoint: tuple[str, ...] = VERIFY_MODULE
) -> CliRun:
    """The repo root on PYTHONPATH so that the driver and ranks import tests.plans."""
    paths = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return run_meshrun(
        tmp_path / "verify", tmp_path / "meshrun.db", "train.seq_len=64", *overrides,
        timeout=280, env={"PYTHONPATH": os.pathsep.join(paths)}, entrypoint=entrypoint,
    )  # fmt: skip


def report(run: CliRun) -> dict[str, Any]:
    return json.loads((run.run_dir / "verify.json").read_text())


def test_correct_layout_passes(tmp_path):
    run = run_verify(tmp_path, "parallel=tp2_pp2")
    assert run.returncode == 0, run.output
    assert "PASS" in run.output
    result = report(run)
    assert result["passed"] is True
    assert result["tolerance"] == TOLERANCE
    assert len(result["steps"]) == 10
    assert result["max_loss_deviation"] < TOLERANCE
    assert result["max_grad_norm_deviation"] < TOLERANCE
    for role in ("layout", "reference"):
        assert (run.run_dir / role / "metrics.jsonl").exists()


def test_wrong_tp_plan_fails_on_the_numbers(tmp_path):
    run = run_verify(tmp_path, "parallel=tp2", "parallel.tp_plan=tests.plans:wrong_wo_sharding")
    assert run.returncode == 1, run.output
    assert "FAIL" in run.output
    result = report(run)
    # Both runs completed: the plan changes the math instead of crashing.
    assert result["error"] is None
    assert len(result["steps"]) == 10
    assert result["passed"] is False
    assert result["max_grad_norm_deviation"] > 100 * TOLERANCE


def test_config_mistake_exits_2_before_any_run(tmp_path):
    script = Path(sys.executable).parent / "meshrun-verify"
    run = run_verify(tmp_path, "parallel=tp4", "model.n_kv_heads=2", entrypoint=(str(script),))
    assert run.returncode == 2, run.output
    assert "meshrun: config error parallel.tp=4" in run.output
    assert "n_kv_heads (2) is not divisible by tp" in run.output
    assert not (run.run_dir / "layout").exists()


def test_failing_rank_exits_1_naming_it(tmp_path):
    run = run_verify(tmp_path, "parallel=ddp", "debug.fail_rank=1")
    assert run.returncode == 1, run.output
    assert "meshrun: layout run failed rank 1 failed" in run.output
    result = report(run)
    assert result["passed"] is False
    assert result["failed_run"] == "layout"
    assert "injected failure on rank 1" in result["error"]
    assert not (run.run_dir / "reference").exists()  # no reference for a layout that crashed


def test_non_positive_tolerance_is_a_config_error(tmp_path):
    run = run_verify(tmp_path, "verify.tolerance=0")
    assert run.returncode == 2, run.output
    assert "meshrun: config error verify.tolerance=0.0: must be positive" in run.output
