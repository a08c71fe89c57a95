"""Local launch through torch.distributed.elastic, the machinery torchrun runs.

One agent on this node starts `nproc_per_node` worker processes running `run_rank`. When any
of them fails, the agent stops the others at once (no restarts) and we raise RankFailure
naming the first rank that failed and its error.
"""

from __future__ import annotations

import logging
import multiprocessing
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshrun.core.config import ExperimentConfig
from meshrun.core.tool_config import CommRunConfig
from meshrun.driver.launch import RankFailure
from meshrun.rank.failures import first_failure
from meshrun.rank.worker import run_rank

logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


def _error_text(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    if not message:
        message = f"exit code {failure.exitcode}"
    return str(message).strip()


def launch_local(
    cfg: ExperimentConfig | CommRunConfig,
    entry: Callable[[dict[str, Any]], Any] = run_rank,
) -> Any:
    """Rank 0's return value; `entry` is the per-rank function (training, or meshrun-comm's).

    With `start_method=forkserver` the ranks fork from one server per driver that imported
    the entry's module (torch with it) once: a sweep's jobs and their baselines then start
    their ranks in a fraction of spawn's time. The server keeps the environment it started
    with, so a driver that changes its environment between launches wants spawn."""
    launcher = cfg.launcher
    if launcher.start_method == "forkserver":
        multiprocessing.set_forkserver_preload([entry.__module__])
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=launcher.nproc_per_node,
        run_id=f"meshrun-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=launcher.monitor_interval_s,
        start_method=launcher.start_method,
    )
    try:
        returns = elastic_launch(config, entry)(asdict(cfg))
    except ChildFailedError as err:
        recorded = first_failure(cfg.run_dir)
        if recorded is None:  # died without raising (killed, segfault): elastic's record
            rank, failure = err.get_first_failure()
            recorded = rank, _error_text(failure)
        raise RankFailure(*recorded) from None
    return returns[0]
