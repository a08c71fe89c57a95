"""Runs submitted without waiting (a Submitter's: SLURM's), recorded once their jobs are done.

With `launcher.wait=false`, and for every job of a multirun sweep (so that the sweep's jobs
run concurrently), `meshrun` submits the job and leaves `<run dir>/<launcher>/submitted.json`
(`slurm/submitted.json`).
Collecting one waits for its job and records it exactly as a waiting run would: results.json,
the store row, W&B, and the baseline (from the store, else measured by its own job).

    meshrun-collect multirun/2026-11-29/10-00-00     # a sweep dir, a run dir, or several

At the end of a multirun whose jobs wait, the `SweepEnd` Hydra callback (driver/sweep.py,
conf/train.yaml) collects the sweep's jobs itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from meshrun.core.checkpoints import RESULTS_FILE
from meshrun.core.config import ExperimentConfig, from_dict
from meshrun.driver.experiment import begin, finish_experiment, live_run, measured_run, reported
from meshrun.driver.launch import TRAIN
from meshrun.driver.launch.dispatch import launch
from meshrun.driver.launch.launcher import Launcher
from meshrun.driver.launch.registry import launcher_for, submitter
from meshrun.driver.measured import RunMeta
from meshrun.driver.sinks.console import console

SUBMITTED_FILE = "submitted.json"


def submit_pending(cfg: ExperimentConfig, launcher: Launcher) -> str:
    """Submits the run's job and notes what collecting it later needs."""
    meta = begin(cfg, "run")
    started = time.time()
    job_id = submitter(launcher).submit(cfg, TRAIN)
    record = {
        "job_id": job_id,
        "submitted_at": started,
        "wait": cfg.launcher.wait,
        "meta": asdict(meta),
        "config": asdict(cfg),
    }
    folder = Path(cfg.run_dir) / launcher.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SUBMITTED_FILE).write_text(json.dumps(record, indent=2))
    if not cfg.launcher.wait:
        console.print(
            f"record it later with: meshrun-collect {cfg.run_dir}", highlight=False, soft_wrap=True
        )
    return job_id


def pending(dirs: Iterable[str | Path]) -> list[Path]:
    """Submission records under `dirs` whose run has no results yet, oldest first."""
    found = []
    for folder in map(Path, dirs):
        for path in folder.glob(f"**/*/{SUBMITTED_FILE}"):
            record = json.loads(path.read_text())
            if _recorded_run_id(path.parent.parent) != record["meta"]["run_id"]:
                found.append((record["submitted_at"], path))
    return [path for _, path in sorted(found)]


def _recorded_run_id(run_dir: Path) -> str | None:
    results = run_dir / RESULTS_FILE
    return json.loads(results.read_text())["run_id"] if results.exists() else None


def collect_one(path: Path) -> int:
    """Waits for one submitted run and records it; 0 completed, 1 failed."""
    record = json.loads(path.read_text())
    cfg = from_dict(record["config"])
    job_id = record["job_id"]
    meta = RunMeta(**record["meta"])
    launcher = submitter(launcher_for(cfg.launcher.name))
    live = live_run(cfg, meta)
    measured = measured_run(cfg, meta, record["submitted_at"], lambda: launcher.wait(cfg, job_id))
    return reported(lambda: finish_experiment(cfg, measured, launch, live))


def collect(paths: list[Path]) -> int:
    """Collects the given submission records; the exit code: 1 if any run failed."""
    return max((collect_one(path) for path in paths), default=0)


def collect_sweep(sweep_dir: Path) -> int:
    """At a multirun's end (driver/sweep.SweepEnd): its jobs submitted with wait=true
    recorded; those with wait=false left for meshrun-collect, saying so. 1 if a run failed."""
    code = collect([p for p in pending([sweep_dir]) if json.loads(p.read_text())["wait"]])
    left = pending([sweep_dir])
    if left:
        console.print(
            f"{len(left)} SLURM job(s) submitted with launcher.wait=false; record them "
            f"later with: meshrun-collect {sweep_dir}",
            highlight=False,
            soft_wrap=True,
        )
    return code


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="meshrun-collect",
        description="Wait for SLURM runs submitted without waiting and record their results.",
    )
    parser.add_argument("dirs", nargs="+", help="run or sweep directories to search")
    paths = pending(parser.parse_args().dirs)
    if not paths:
        console.print("nothing to collect: every submitted run there has its results")
    sys.exit(collect(paths))


if __name__ == "__main__":
    main()
