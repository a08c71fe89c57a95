"""parallel.fault_tolerance=torchft: what the replicas as worlds of their own can run today
(driver/launch/replicas.py, rank/replicas.py)."""

from __future__ import annotations

import importlib.util

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.layout import Layout


def check_fault_tolerance(cfg: ExperimentConfig) -> None:
    p = cfg.parallel
    if p.replica_restarts < 0:
        fail(
            "parallel.replica_restarts",
            p.replica_restarts,
            "is how many times in all the run starts a failed replica again",
            "an integer >= 0 (default 3)",
        )
    if p.replica_restart_delay_s < 0:
        fail(
            "parallel.replica_restart_delay_s",
            p.replica_restart_delay_s,
            "is how long the run waits before it starts a failed replica again",
            "a number of seconds >= 0",
        )
    if p.fault_tolerance == "none":
        return
    if importlib.util.find_spec("torchft") is None:
        fail(
            "parallel.fault_tolerance",
            p.fault_tolerance,
            "needs torchft, which is not installed",
            "pip install 'meshrun[ft]' (torchft), or none",
        )
    _check_layout(cfg)
    if cfg.launcher.name != "local" or cfg.launcher.nnodes != 1:
        fail(
            "parallel.fault_tolerance",
            p.fault_tolerance,
            "runs its replicas on this host only so far (launcher=local, launcher.nnodes=1)",
            "launcher=local, or none with launcher=slurm (a failed job is requeued)",
        )
    if cfg.train.eval.every_steps:
        fail(
            "train.eval.every_steps",
            cfg.train.eval.every_steps,
            "under torchft each replica would evaluate its own share of the held-out data "
            "alone, and the record hold one replica's",
            "0 with parallel.fault_tolerance=torchft",
        )
    if cfg.debug.slow_rank is not None:
        fail(
            "debug.slow_rank",
            cfg.debug.slow_rank,
            "compares the busy time of the ranks of one world; torchft's replicas are worlds "
            "of their own",
            "null with parallel.fault_tolerance=torchft",
        )


def _check_layout(cfg: ExperimentConfig) -> None:
    """Replicas of one rank each: the dp_replicate dimension alone."""
    layout = Layout.of(cfg.parallel)
    others = {dim: n for dim, n in layout.degrees().items() if dim != "dp_replicate" and n > 1}
    if layout.dp_replicate < 2 or others or layout.ep > 1:
        given = ", ".join(f"{dim}={n}" for dim, n in layout.degrees().items())
        fail(
            "parallel.fault_tolerance",
            cfg.parallel.fault_tolerance,
            f"runs data-parallel replicas of one rank each; the layout is {given}",
            "parallel=ddp on 2 or more ranks (dp_replicate >= 2, every other degree 1)",
        )
    if cfg.parallel.data_parallel == "dataparallel":
        fail(
            "parallel.data_parallel",
            cfg.parallel.data_parallel,
            "runs in one process; torchft's replicas are processes of their own",
            "auto with parallel.fault_tolerance=torchft",
        )
