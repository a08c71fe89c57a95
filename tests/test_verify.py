"""`meshrun-verify` passes a correct layout, fails a user TP plan that silently changes the
math, and stops bad configs and crashing ranks with the same messages and exit codes as
`meshrun`. Real gloo processes, model=tiny, 10 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrun.paths import REPO_ROOT

TOLERANCE = 1e-4


@dataclass
class VerifyRun:
    returncode: int
    output: str
    run_dir: Path

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "verify.json").read_text())


def run_verify(
    tmp_path: Path, *overrides: str, command: tuple[str, ...] | None = None
) -> VerifyRun:
    """Isolated run dir and store; the repo root on PYTHONPATH so the ranks import tests.plans."""
    run_dir = tmp_path / "verify"
    command = command or (sys.executable, "-m", "meshrun.verify")
    args = [
        *command, f"hydra.run.dir={run_dir}", f"store.path={tmp_path / 'meshrun.db'}",
        "train.seq_len=64", "train.progress_bar=false", *overrides,
    ]  # fmt: skip
    paths = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    proc = subprocess.run(
        args, check=False, capture_output=True, text=True, timeout=280, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
    )  # fmt: skip
    return VerifyRun(proc.returncode, proc.stdout + proc.stderr, run_dir)


def test_correct_layout_passes(tmp_path):
    run = run_verify(tmp_path, "parallel=tp2_pp2")
    assert run.returncode == 0, run.output
    assert "PASS" in run.output
    report = run.report
    assert report["passed"] is True
    assert report["tolerance"] == TOLERANCE
    assert len(report["steps"]) == 10
    assert report["max_loss_deviation"] < TOLERANCE
    assert report["max_grad_norm_deviation"] < TOLERANCE
    for role in ("layout", "reference"):
        assert (run.run_dir / role / "metrics.jsonl").exists()


def test_wrong_tp_plan_fails_on_the_numbers(tmp_path):
    run = run_verify(tmp_path, "parallel=tp2", "parallel.tp_plan=tests.plans:wrong_wo_sharding")
    assert run.returncode == 1, run.output
    assert "FAIL" in run.output
    report = run.report
    # Both runs completed: the plan changes the math instead of crashing.
    assert report["error"] is None
    assert len(report["steps"]) == 10
    assert report["passed"] is False
    assert report["max_grad_norm_deviation"] > 100 * TOLERANCE


def test_config_mistake_exits_2_before_any_run(tmp_path):
    script = Path(sys.executable).parent / "meshrun-verify"
    run = run_verify(tmp_path, "parallel=tp4", "model.n_kv_heads=2", command=(str(script),))
    assert run.returncode == 2, run.output
    assert "meshrun: config error parallel.tp=4" in run.output
    assert "n_kv_heads (2) is not divisible by tp" in run.output
    assert not (run.run_dir / "layout").exists()


def test_failing_rank_exits_1_naming_it(tmp_path):
    run = run_verify(tmp_path, "parallel=ddp", "debug.fail_rank=1")
    assert run.returncode == 1, run.output
    assert "meshrun: layout run failed rank 1 failed" in run.output
    report = run.report
    assert report["passed"] is False
    assert report["failed_run"] == "layout"
    assert "injected failure on rank 1" in report["error"]
    assert not (run.run_dir / "reference").exists()  # no reference for a layout that crashed
