"""One SLURM job through submitit: its sbatch parameters from the launcher's keys, its
submission said with where its logs go (a run's job, a sweep's, a torchft replica group's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import submitit

from meshrun.core.config import ExperimentConfig, SlurmLauncherConfig
from meshrun.driver.sinks.console import console
from meshrun.driver.tool_config import CommRunConfig

SLURM_DIR = "slurm"
SACCT_TIMEOUT_S = 30


def executor(cfg: ExperimentConfig | CommRunConfig) -> submitit.SlurmExecutor:
    launcher = cfg.launcher
    if not isinstance(launcher, SlurmLauncherConfig):
        raise TypeError(f"launcher={launcher.name} is not a SLURM launcher")
    ex = submitit.SlurmExecutor(folder=Path(cfg.run_dir).absolute() / SLURM_DIR / "%j")
    ex.update_parameters(
        job_name=f"meshrun-{cfg.name}",
        nodes=launcher.nnodes,
        ntasks_per_node=launcher.nproc_per_node,
        cpus_per_task=launcher.cpus_per_task,
        gpus_per_node=launcher.gpus_per_node or None,
        mem=f"{round(launcher.mem_gb * 1024)}M" if launcher.mem_gb else None,
        time=launcher.time_min,
        partition=launcher.partition,
        account=launcher.account,
        qos=launcher.qos,
        constraint=launcher.constraint,
        exclusive=True if launcher.exclusive else None,
        setup=list(launcher.setup),
        additional_parameters=dict(launcher.sbatch_extra),
        srun_args=["--kill-on-bad-exit=1"],
        signal_delay_s=launcher.signal_delay_s,
    )
    return ex


def submit_with(
    ex: submitit.SlurmExecutor, cfg: ExperimentConfig | CommRunConfig, *args: Any
) -> submitit.Job:
    """`ex.submit(*args)`, said with the job's shape and where its logs go."""
    job = ex.submit(*args)
    console.print(
        f"submitted SLURM job {job.job_id} ({cfg.launcher.nnodes} node(s) x "
        f"{cfg.launcher.nproc_per_node} task(s)); logs: {log_dir(cfg, job.job_id)}",
        highlight=False,
        soft_wrap=True,
    )
    return job


def log_dir(cfg: ExperimentConfig | CommRunConfig, job_id: str) -> Path:
    return Path(cfg.run_dir).absolute() / SLURM_DIR / job_id
