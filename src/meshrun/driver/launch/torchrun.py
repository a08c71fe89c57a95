"""Attach mode: this process was started by torchrun (or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR/PORT) and is one rank; torchrun owns teardown on failure."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from meshrun.core.attached import attached_rank
from meshrun.core.config import ExperimentConfig, LauncherConfig
from meshrun.driver.launch import TRAIN, RankEntry, RankFailure
from meshrun.driver.launch.launcher import LauncherHere
from meshrun.driver.tool_config import CommRunConfig


def run_dir_override() -> str:
    """One run dir for all ranks: `${now:}` would differ per process."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        run_id = f"port{os.environ.get('MASTER_PORT', '0')}"
    return f"hydra.run.dir=outputs/torchrun/{run_id}"


def launch_attached(
    cfg: ExperimentConfig | CommRunConfig,
    entry: RankEntry = TRAIN,
) -> Any:
    try:
        return entry(asdict(cfg))
    except Exception as err:
        raise RankFailure(attached_rank() or 0, f"{type(err).__name__}: {err}") from err


class AttachedLauncher(LauncherHere):
    """The ranks torchrun started, this process one of them: selected by the environment
    (dispatch.launch), not by `launcher.name`; no rules of its own beyond the world's size
    (validate/launcher.check_attached_world)."""

    name = "torchrun"
    schema = LauncherConfig

    def run(self, cfg: ExperimentConfig | CommRunConfig, entry: RankEntry) -> Any:
        return launch_attached(cfg, entry)


ATTACHED = AttachedLauncher()
