"""Which launcher starts a run's ranks: the one `launcher.name` registered (registry.py), as
torchft's replica groups where parallel.fault_tolerance says so, or, in a process torchrun
started as rank 0, that rank itself. Every command that starts ranks (`meshrun`,
`meshrun-comm`, `meshrun-verify`) goes through `launch`."""

from __future__ import annotations

from typing import Any

from meshrun.core.attached import attached_rank
from meshrun.core.config import ExperimentConfig
from meshrun.driver.launch import TRAIN, RankEntry
from meshrun.driver.launch.registry import launcher_for, replica_launcher
from meshrun.driver.launch.replicas import launch_replicas
from meshrun.driver.launch.torchrun import ATTACHED


def launch(cfg: Any, entry: RankEntry = TRAIN) -> Any:
    """Rank 0's return value of `entry` run on every rank; RankFailure if a rank failed."""
    if attached_rank() == 0:
        return ATTACHED.run(cfg, entry)
    if isinstance(cfg, ExperimentConfig) and cfg.parallel.fault_tolerance == "torchft":
        return launch_replicas(cfg, replica_launcher(cfg).replica_groups(cfg, entry))
    return launcher_for(cfg.launcher.name).run(cfg, entry)
