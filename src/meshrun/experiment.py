"""The driver's flow for one experiment: baseline (from the store, or measured first), the run
itself, then results.json, the store row and W&B. Failed runs go through the same path."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from meshrun.config import ExperimentConfig
from meshrun.failures import FAILURES_DIR
from meshrun.launch import RankFailure
from meshrun.results import assemble, baseline_config, baseline_key, is_own_baseline
from meshrun.sinks.console import print_error, print_summary
from meshrun.sinks.store import ResultsStore
from meshrun.worker import METRICS_FILE

Launch = Callable[[ExperimentConfig], dict[str, Any] | None]


class RunFailed(RuntimeError):
    def __init__(self, results: dict[str, Any]) -> None:
        self.results = results
        super().__init__(results["error"])


def reported(run: Callable[[], dict[str, Any]]) -> int:
    """Runs an experiment to its record and prints the summary; the command's exit code."""
    try:
        results = run()
    except RunFailed as failed:
        print_summary(failed.results)
        print_error("run failed", str(failed))
        return 1
    print_summary(results)
    return 0


def run_experiment(cfg: ExperimentConfig, launch: Launch) -> dict[str, Any]:
    """Returns the results record; raises RunFailed (after recording) if a rank failed.

    The baseline is measured after the run, when the store has none: under torchrun the
    other ranks are then already gone and rank 0 measures it alone.
    """
    return finish_experiment(cfg, measure(cfg, "run", launch), launch)


def finish_experiment(cfg: ExperimentConfig, measured: Measured, launch: Launch) -> dict[str, Any]:
    """Baseline and record of a run measured already (here, or by a job submitted earlier)."""
    store = ResultsStore(cfg.store.path)
    baseline = None
    if cfg.metrics.baseline:
        twin = baseline_config(cfg)
        key = baseline_key(twin)
        baseline = store.find_baseline(key)
        if baseline is None and measured.ok and not is_own_baseline(cfg):
            baseline = record(twin, measure(twin, "baseline", launch), None, store)
    return record(cfg, measured, baseline, store)


@dataclass
class Measured:
    meta: dict[str, Any]
    steps: list[dict[str, Any]]
    memory: list[dict[str, int]] | None
    bubbles: list[float] | None

    @property
    def ok(self) -> bool:
        return self.meta["status"] == "completed"


def read_steps(run_dir: str) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def measure(cfg: ExperimentConfig, role: str, launch: Launch) -> Measured:
    meta = begin(cfg, role)
    return outcome(cfg, meta, time.time(), lambda: launch(cfg))


def begin(cfg: ExperimentConfig, role: str) -> dict[str, Any]:
    """Clears what an earlier attempt left in the run dir; the new run's identity."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    shutil.rmtree(run_dir / FAILURES_DIR, ignore_errors=True)
    return {
        "run_id": uuid.uuid4().hex[:12],
        "role": role,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def outcome(
    cfg: ExperimentConfig,
    meta: dict[str, Any],
    started: float,
    wait: Callable[[], dict[str, Any] | None],
) -> Measured:
    """`wait` returns rank 0's raw measurements once the ranks are done, or raises
    RankFailure; `started` is the epoch second the launch began."""
    meta = {**meta, "status": "completed", "error": None, "failed_rank": None}
    raw: dict[str, Any] | None = None
    try:
        raw = wait()
    except RankFailure as failure:
        meta.update(status="failed", error=str(failure), failed_rank=failure.rank)
    meta["duration_s"] = round(time.time() - started, 3)
    raw = raw or {}
    return Measured(
        meta,
        read_steps(cfg.run_dir),
        raw.get("memory_per_rank"),
        raw.get("pipeline_bubble_per_rank"),
    )


def record(
    cfg: ExperimentConfig,
    measured: Measured,
    baseline: dict[str, Any] | None,
    store: ResultsStore,
) -> dict[str, Any]:
    """results.json, the store row, and (for the run itself) W&B; raises RunFailed after."""
    results = assemble(
        cfg, measured.steps, measured.memory, measured.bubbles, baseline, measured.meta
    )
    (Path(cfg.run_dir) / "results.json").write_text(json.dumps(results, indent=2))
    store.record(results)
    if results["role"] == "run" and cfg.logger.name == "wandb":
        from meshrun.sinks.wandb_sink import log_run

        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        log_run(cfg.logger, asdict(cfg), results, measured.steps, tokens_per_step)
    if not measured.ok:
        raise RunFailed(results)
    return results
