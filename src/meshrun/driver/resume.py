"""Which run a resume continues. A run dir the user names is theirs: `checkpoint.resume` in a
command that gives its run a dir (`hydra.run.dir=` or `run_dir=`, or a sweep's job, each in
its own) other than the checkpoint's is a new run there, linked to the run it started from
(validate/checkpoint.py, driver/experiment.begin); a command that gives none continues the
checkpoint's run, in that run's dir."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hydra.core.hydra_config import HydraConfig

from meshrun.core.attached import attached_rank
from meshrun.core.checkpoints import find_resume, read_manifest
from meshrun.core.config import ExperimentConfig
from meshrun.driver.launch.torchrun import run_dir_override
from meshrun.driver.sweep import is_sweep_job

RUN_DIR_KEYS = ("hydra.run.dir=", "run_dir=")


def names_run_dir(overrides: Sequence[str], added: str | None = None) -> bool:
    """Whether `overrides` give the run a dir: `hydra.run.dir=` or `run_dir=`, not `added`
    (the one `meshrun` adds itself under torchrun, one dir for all ranks)."""
    return any(o.lstrip("+").startswith(RUN_DIR_KEYS) and o != added for o in overrides)


def gives_run_dir() -> bool:
    """Whether this command gives its run a dir of its own: one named among its overrides,
    or a sweep's job's (a multirun's, a W&B agent's)."""
    if is_sweep_job():
        return True
    if not HydraConfig.initialized():  # composed by the caller, run dir and all
        return True
    overrides = HydraConfig.get().overrides
    added = run_dir_override() if attached_rank() is not None else None
    return names_run_dir([*overrides.hydra, *overrides.task], added)


def in_run_dir_of_resume(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` in the run dir its resume continues in: the checkpoint's, where the command
    gives the run no dir of its own (Hydra's generated one stays empty, as today)."""
    if cfg.checkpoint.resume is None or gives_run_dir():
        return cfg
    path = find_resume(cfg.checkpoint, cfg.run_dir)
    if path is None:
        return cfg
    return dataclasses.replace(cfg, run_dir=read_manifest(path).run_dir)
