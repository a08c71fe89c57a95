"""`meshrun`: compose the experiment (Hydra), validate it, launch its ranks, record results.

Runs once per experiment and starts the ranks itself (torch elastic). Started by torchrun
instead, every process is one rank: all compose and validate the same config, rank 0 then
measures the baseline if needed and writes the results.
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before anything touches CUDA

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from meshrun.core.attached import attached_nodes, attached_rank
from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.driver.collect import submit_pending
from meshrun.driver.command import hydra_command
from meshrun.driver.experiment import record_skipped, reported, run_experiment
from meshrun.driver.launch import TRAIN
from meshrun.driver.launch.dispatch import launch
from meshrun.driver.launch.registry import launcher_for
from meshrun.driver.resolve import resolve, resolve_trials
from meshrun.driver.resume import in_run_dir_of_resume
from meshrun.driver.sinks.console import print_error, print_note
from meshrun.driver.sweep import (
    SweepJobFailed,
    in_multirun,
    is_sweep_job,
    register_sweeps,
    sweep_name,
)
from meshrun.driver.trials import run_with_trials
from meshrun.validate.launcher import check_attached_world

register_sweeps(ConfigStore.instance())


def run(dict_cfg: DictConfig) -> int:
    cfg: ExperimentConfig = OmegaConf.to_object(dict_cfg)
    cfg = replace(cfg, sweep=sweep_name(cfg.sweep))
    rank = attached_rank()
    if rank is not None:
        cfg = replace(cfg, launcher=replace(cfg.launcher, nnodes=attached_nodes()))
    try:
        cfg = in_run_dir_of_resume(cfg)  # naming no run dir of its own: the checkpoint's run
        launcher = launcher_for(cfg.launcher.name)
        facts = HostFacts.detect()
        if cfg.plan.trials:
            plans = resolve_trials(cfg, facts, print_note)
            trials = [p.config for p in plans]
            return reported(lambda: run_with_trials(trials, cfg.plan, launch))
        cfg = resolve(cfg, facts, say=print_note).config  # every rank under torchrun alike
        check_attached_world(cfg.launcher, f"parallel={cfg.parallel.name}")
    except ConfigError as err:
        if is_sweep_job():  # an invalid grid point: recorded, and the sweep goes on
            record_skipped(cfg, err)
            print_error("skipped", str(err))
            return 0
        print_error("config error", str(err))
        return 2
    if rank not in (None, 0):
        TRAIN(asdict(cfg))
        return 0
    # torchft's replicas: the driver runs their lighthouse and restarts them, so it waits
    replicas = cfg.parallel.fault_tolerance == "torchft"
    if rank is None and not replicas and not launcher.waits(cfg.launcher, in_multirun()):
        submit_pending(cfg, launcher)
        return 0
    return reported(lambda: run_experiment(cfg, launch))


def _fail_sweep_job(code: int, dict_cfg: DictConfig) -> None:
    if in_multirun():
        raise SweepJobFailed(
            f"this job of the sweep exited {code} (see its error above)",
            dict_cfg.store.path,
            sweep_name(dict_cfg.sweep),
        )


main = hydra_command("train", run, on_failure=_fail_sweep_job)


if __name__ == "__main__":
    main()
