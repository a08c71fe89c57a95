"""parallel.fault_tolerance=torchft: what replica groups as worlds of their own can run
today (driver/launch/replicas.py, rank/train/replicas.py)."""

from __future__ import annotations

import importlib.util

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail


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
    if cfg.debug.slow_rank is not None:
        fail(
            "debug.slow_rank",
            cfg.debug.slow_rank,
            "compares the busy time of the ranks of one world; torchft's replicas are worlds "
            "of their own",
            "null with parallel.fault_tolerance=torchft",
        )


def _check_layout(cfg: ExperimentConfig) -> None:
    """Replica groups along dp_replicate; each group any layout of the other dimensions."""
    p = cfg.parallel
    if p.dp_replicate < 2:
        fail(
            "parallel.fault_tolerance",
            p.fault_tolerance,
            f"keeps data-parallel replica groups training when one fails; parallel.dp_replicate "
            f"is {p.dp_replicate}",
            "parallel.dp_replicate >= 2 (parallel=ddp on 2 or more ranks; with dp_shard, tp, "
            "pp, cp: each group of that layout)",
        )
    if p.data_parallel == "dataparallel":
        fail(
            "parallel.data_parallel",
            p.data_parallel,
            "runs in one process; torchft's replicas are processes of their own",
            "auto with parallel.fault_tolerance=torchft",
        )
