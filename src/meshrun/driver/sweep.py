"""Sweeps: the ready grids in `sweeps/` as the Hydra group `sweeps`, what makes a job part of
a sweep (its shared name, and skipping invalid grid points instead of stopping), and how a
sweep ends: its SLURM jobs collected, then the comparison table of its runs.

`meshrun -m +sweeps=batch_microbatch` selects sweeps/batch_microbatch.yaml. The files live
beside conf/ rather than in it so that they read as what they are: ready-made commands, not
experiment presets. The group is not called `sweep`: that is the config key naming a sweep
(`sweep=my-grid`), and Hydra reads `<group>=` as a group choice. A W&B agent's runs are sweep
jobs too (the agent sets WANDB_SWEEP_ID).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from meshrun.core.paths import REPO_ROOT
from meshrun.driver.collect import collect_sweep
from meshrun.driver.sinks.compare import print_sweep_table

SWEEPS_DIR = REPO_ROOT / "sweeps"


class SweepJobFailed(RuntimeError):
    """Raised instead of exiting, so Hydra still runs the sweep's other jobs and then exits
    non-zero naming this one; it carries what the sweep's closing table needs, since Hydra
    skips `on_multirun_end` when a job failed."""

    def __init__(self, message: str, store_path: str, sweep: str | None) -> None:
        super().__init__(message)
        self.store_path, self.sweep = store_path, sweep


def register_sweeps(store: ConfigStore) -> None:
    """Each sweeps/*.yaml becomes `+sweeps=<stem>`, merged at the top level (like
    `# @package _global_`) since a sweep sets hydra.sweeper.params and hydra.sweep.dir."""
    for path in sorted(SWEEPS_DIR.glob("*.yaml")):
        store.store(group="sweeps", name=path.stem, node=OmegaConf.load(path), package="_global_")


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def is_sweep_job() -> bool:
    """One point of a grid: a Hydra multirun job, or a run started by a W&B agent."""
    return in_multirun() or "WANDB_SWEEP_ID" in os.environ


def sweep_name(configured: str | None, sweep_dir: str | None = None) -> str | None:
    """The configured name, else the multirun's sweep dir name (one per `meshrun -m`), else
    the W&B sweep's id; None for a single run."""
    if configured:
        return configured
    if sweep_dir is None and in_multirun():
        sweep_dir = HydraConfig.get().sweep.dir
    if sweep_dir is not None:
        return Path(sweep_dir).name
    if "WANDB_SWEEP_ID" in os.environ:
        return f"wandb-{os.environ['WANDB_SWEEP_ID']}"
    return None


class SweepEnd(Callback):
    """At the end of a multirun: wait for and record its SLURM jobs (those submitted with
    launcher.wait=true), print the sweep's comparison table, exit 1 if a collected run
    failed. (A local job that failed ends the sweep through SweepJobFailed instead.)"""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # The default store path, ${hydra:runtime.cwd}/..., resolves through HydraConfig,
        # which Hydra leaves unset here: the sweep ended with an InterpolationResolutionError
        # (a warning) and no table wherever store.path was not given.
        HydraConfig.instance().set_config(config)
        code = collect_sweep(Path(config.hydra.sweep.dir))
        print_sweep_table(config.store.path, sweep_name(config.sweep, config.hydra.sweep.dir))
        if code:
            sys.exit(code)
