"""Local launch through torch.distributed.elastic, the machinery torchrun runs.

One agent on this node starts `nproc_per_node` worker processes running the rank entry. When any
of them fails, the agent stops the others at once (no restarts) and we raise RankFailure
naming the first rank that failed and its error.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshrun.core.config import ExperimentConfig, LocalLauncherConfig
from meshrun.core.run_files.failures import first_failure, recorded_failures
from meshrun.driver.launch import SIGNAL_UNSEEN, TRAIN, RankEntry, RankFailure, interrupted
from meshrun.driver.launch.launcher import LauncherHere
from meshrun.driver.launch.local_replicas import LocalReplicaGroups
from meshrun.driver.launch.start_method import rank_start_method
from meshrun.driver.tool_config import CommRunConfig

logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


def _error_text(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    if not message:
        message = f"exit code {failure.exitcode}"
    return str(message).strip()


def root_cause(err: ChildFailedError, run_dir: str) -> RankFailure:
    """The rank whose failure caused the others': one killed by a signal without recording an
    exception (SIGKILL, SIGSEGV: its peers only saw its connection close), else the earliest
    recorded exception, else elastic's first failure."""
    recorded = recorded_failures(run_dir)
    killed = [
        rank for rank, f in sorted(err.failures.items()) if f.exitcode < 0 and rank not in recorded
    ]
    if killed:
        return RankFailure(killed[0], "", signal=err.failures[killed[0]].signal_name())
    # elastic names one failed rank; a peer that failed on seeing it gone knows it died first
    gone = sorted({r for f in recorded.values() for r in f["gone_peers"] if r not in recorded})
    if gone:
        return RankFailure(gone[0], "", signal=SIGNAL_UNSEEN)
    first = first_failure(run_dir)
    if first is not None:
        return RankFailure(*first)
    rank, failure = err.get_first_failure()
    return RankFailure(rank, _error_text(failure))


def launch_local(
    cfg: ExperimentConfig | CommRunConfig,
    entry: RankEntry = TRAIN,
) -> Any:
    """Rank 0's return value; `entry` is the per-rank function (training, or meshrun-comm's).

    With `start_method=forkserver` (the default) the ranks fork from one server per driver
    that imported the entry's module (torch with it) once: a run's baseline, a sweep's jobs
    and their baselines then start their ranks without importing torch again (a DDP run of
    `tiny` with its baseline: 13 s instead of spawn's 20 s here)."""
    launcher = cfg.launcher
    method = rank_start_method(launcher.start_method, entry)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=launcher.nproc_per_node,
        run_id=f"meshrun-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=launcher.monitor_interval_s,
        start_method=method,
    )
    try:
        returns = elastic_launch(config, entry)(asdict(cfg))
    except ChildFailedError as err:
        raise root_cause(err, cfg.run_dir) from None
    except SignalException as err:  # Ctrl-C or SIGTERM here: the agent has stopped the ranks
        raise interrupted(err.sigval.name, cfg.run_dir) from None
    return returns[0]


class LocalLauncher(LauncherHere):
    """launcher=local: the ranks on this host, waited for; no rules beyond the common ones
    (validate/launcher.py)."""

    name = "local"
    schema = LocalLauncherConfig

    def run(self, cfg: ExperimentConfig | CommRunConfig, entry: RankEntry) -> Any:
        return launch_local(cfg, entry)

    def replica_groups(self, cfg: ExperimentConfig, entry: RankEntry) -> LocalReplicaGroups:
        return LocalReplicaGroups(cfg, entry)
