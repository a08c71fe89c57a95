"""parallel.fault_tolerance=torchft: what replica groups as worlds of their own can run
today (driver/launch/replicas.py, rank/train/replicas.py); the launcher's own rules
(driver/launch/registry.replica_launcher) say whether it starts them."""

from __future__ import annotations

import importlib.util

from meshrun.core.attached import attached_rank
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
    key, value = "parallel.fault_tolerance", str(p.fault_tolerance)
    if importlib.util.find_spec("torchft") is None:
        fail(key, value, "needs torchft, which is not installed", "pip install 'meshrun[ft]'")
    if p.dp_replicate < 2:
        fail(
            key,
            value,
            f"keeps data-parallel replica groups training when one fails; parallel.dp_replicate "
            f"is {p.dp_replicate}",
            "parallel.dp_replicate >= 2 (parallel=ddp on 2 or more ranks; with dp_shard, tp, "
            "pp, cp: each group of that layout)",
        )
    if attached_rank() is not None:
        fail(
            key,
            value,
            "starts its replica groups itself, each a world of its own: torchrun's ranks are one",
            "`meshrun ... launcher=local` or `launcher=slurm`, not under torchrun",
        )
    if cfg.debug.slow_rank is not None:
        fail(
            "debug.slow_rank",
            cfg.debug.slow_rank,
            "compares the busy time of the ranks of one world; torchft's replicas are worlds "
            "of their own",
            "null with parallel.fault_tolerance=torchft",
        )
