"""launcher=slurm: the ranks of one experiment as the tasks of one SLURM job, via submitit.

One task per rank (`nproc_per_node` tasks on each of `nnodes` nodes); each task exports the
torch distributed environment from SLURM's (rendezvous on the job's first node) and runs the
same `run_rank` as a local launch. `srun --kill-on-bad-exit` stops every task when one fails.
submitit's logs, one stdout and stderr per task, land in `<run dir>/slurm/<job id>/`.

`launch_slurm` submits and waits (a single run, and baselines); `submit` and `wait` apart let
a sweep's jobs run concurrently (meshrun.driver.collect).

A run that checkpoints survives its time limit and preemption in the same job: SLURM sends
SIGUSR2 `launcher.signal_delay_s` before the limit, every rank saves and stops
(rank/train/checkpoint.py), rank 0 requeues the job, and the job's next start resumes from
the checkpoint (SLURM_RESTART_COUNT > 0 means `checkpoint.resume=auto`). A preemption or
`scontrol requeue` sends SIGTERM instead: the ranks save the same way and SLURM requeues.
A stopped task exits without a result, so the driver keeps waiting for the job, which
finishes once, with the losses of an uninterrupted run.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import submitit

from meshrun.core.config import ExperimentConfig, LauncherConfig, SlurmLauncherConfig
from meshrun.core.run_files.failures import first_failure
from meshrun.driver.launch import TRAIN, RankEntry, RankFailure
from meshrun.driver.launch.slurm_jobs import executor, log_dir, submit_with
from meshrun.driver.launch.slurm_replicas import SlurmReplicaGroups
from meshrun.driver.launch.slurm_rules import check_slurm
from meshrun.driver.launch.slurm_task import SlurmTask
from meshrun.driver.tool_config import CommRunConfig


def submit(cfg: ExperimentConfig | CommRunConfig, entry: RankEntry = TRAIN) -> str:
    """Submits the job, returns its id at once."""
    return submit_with(executor(cfg), cfg, SlurmTask(), asdict(cfg), entry).job_id


def wait_until_done(job: submitit.Job) -> None:
    """Job.wait, asking SLURM itself more often: submitit reads sacct every half of the
    job's age (a rank killed without a result, as srun does to a hung one, is seen up to a
    minute late); here every tenth of it, 2 to 30 s apart (one sacct call each)."""
    started = checked = time.monotonic()
    while not job.done():
        time.sleep(1)
        now = time.monotonic()
        if now - checked >= min(30.0, max(2.0, (now - started) / 10)):
            checked = now
            if job.done(force_check=True):
                return


def wait(cfg: ExperimentConfig | CommRunConfig, job_id: str) -> Any:
    """Rank 0's raw measurements once the job is done; RankFailure naming the first rank
    that failed (by the ranks' own records, else submitit's) with where its log is."""
    ranks = cfg.launcher.nnodes * cfg.launcher.nproc_per_node
    job: submitit.Job = submitit.SlurmJob(log_dir(cfg, job_id), job_id, tasks=range(ranks))
    wait_until_done(job)
    failures = [(rank, job.task(rank).exception()) for rank in range(ranks)]
    failures = [(rank, err) for rank, err in failures if err is not None]
    if not failures:
        return job.task(0).result()
    rank, text, trace = first_failure(cfg.run_dir) or (
        failures[0][0],
        _last_line(failures[0][1]),
        str(failures[0][1]),
    )
    stderr = job.task(rank).paths.stderr
    raise RankFailure(rank, f"{text} (SLURM job {job_id}, state {job.state}; log: {stderr})", trace)


def _last_line(err: Exception) -> str:
    """submitit's message ends with the trace; its last line is the exception itself."""
    lines = [line for line in str(err).splitlines() if line.strip() and set(line) != {"-"}]
    footer = ("You can check", "or at paths", "  -")
    traced = [line for line in lines if not line.startswith(footer)]
    return (traced or lines or [type(err).__name__])[-1].strip()


def launch_slurm(cfg: ExperimentConfig | CommRunConfig, entry: RankEntry = TRAIN) -> Any:
    """Submits and waits; an interrupted driver (Ctrl-C) cancels its job."""
    job_id = submit(cfg, entry)
    try:
        return wait(cfg, job_id)
    except KeyboardInterrupt:
        cancel(cfg, job_id)
        raise


def cancel(cfg: ExperimentConfig | CommRunConfig, job_id: str) -> None:
    submitit.SlurmJob(log_dir(cfg, job_id), job_id).cancel(check=False)


class SlurmLauncher:
    """launcher=slurm: the ranks as one job's tasks on the profile's nodes (not this login
    host); a sweep's jobs, and any with `launcher.wait=false`, are submitted and left."""

    name = "slurm"
    schema = SlurmLauncherConfig
    ranks_here = False

    def check(self, cfg: ExperimentConfig | CommRunConfig) -> LauncherConfig:
        return check_slurm(cfg)

    def waits(self, launcher: LauncherConfig, in_sweep: bool) -> bool:
        """A multirun's jobs are collected at the sweep's end (driver/sweep.SweepEnd), so
        that they run concurrently; with launcher.wait=false, by meshrun-collect."""
        return launcher.waits_for_ranks() and not in_sweep

    def run(self, cfg: ExperimentConfig | CommRunConfig, entry: RankEntry) -> Any:
        return launch_slurm(cfg, entry)

    def submit(self, cfg: ExperimentConfig | CommRunConfig, entry: RankEntry) -> str:
        return submit(cfg, entry)

    def wait(self, cfg: ExperimentConfig | CommRunConfig, job_id: str) -> Any:
        return wait(cfg, job_id)

    def cancel(self, cfg: ExperimentConfig | CommRunConfig, job_id: str) -> None:
        cancel(cfg, job_id)

    def replica_groups(self, cfg: ExperimentConfig, entry: RankEntry) -> SlurmReplicaGroups:
        return SlurmReplicaGroups(cfg, entry)
