"""Which launcher starts a run's ranks: the configured one (torch elastic here, submitit for
SLURM), torchft's replica groups (parallel.fault_tolerance), or, in a process torchrun
started as rank 0, that rank itself. Every command that starts ranks (`meshrun`,
`meshrun-comm`, `meshrun-verify`) goes through `launch`."""

from __future__ import annotations

from typing import Any

from meshrun.core.attached import attached_rank
from meshrun.core.config import ExperimentConfig
from meshrun.driver.launch import TRAIN, RankEntry
from meshrun.driver.launch.local import launch_local
from meshrun.driver.launch.replicas import launch_replicas
from meshrun.driver.launch.slurm import launch_slurm
from meshrun.driver.launch.torchrun import launch_attached

LAUNCHERS = {"local": launch_local, "slurm": launch_slurm}


def launch(cfg: Any, entry: RankEntry = TRAIN) -> Any:
    """Rank 0's return value of `entry` run on every rank; RankFailure if a rank failed."""
    if attached_rank() == 0:
        return launch_attached(cfg, entry)
    if isinstance(cfg, ExperimentConfig) and cfg.parallel.fault_tolerance == "torchft":
        return launch_replicas(cfg, entry)
    return LAUNCHERS[cfg.launcher.name](cfg, entry)
