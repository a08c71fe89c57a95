"""One rank inside its SLURM task: what submitit pickles, and runs in each task.

SLURM's warning before the time limit (SIGUSR2, `launcher.signal_delay_s`) may come up to a
minute early, and on a loaded node a task takes seconds to import torch: a warning then
would kill it, before any handler exists. So this module stays light, and unpickling the
task (the first thing submitit does, before importing what it runs) starts noting the
warning; a task warned that early requeues its job at once, with nothing to save. Later,
submitit's own handler requeues (`checkpoint`), and once training runs, the checkpointer's
saves first (rank/train/checkpoint.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import submitit

from meshrun.core.run_files.failures import Stopped
from meshrun.driver.launch import RankEntry

_warned: list[int] = []


def _note(signum: int, frame: object) -> None:
    _warned.append(signum)


def _in_task() -> SlurmTask:
    """Unpickling: from here on a SIGUSR2 is noted, not fatal."""
    signal.signal(signal.SIGUSR2, _note)
    return SlurmTask()


class SlurmTask:
    """MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK from SLURM's environment, then the
    rank itself (training's, or meshrun-comm's). CUDA_VISIBLE_DEVICES stays as SLURM set it:
    a task that sees the node's GPUs takes its LOCAL_RANK-th, one bound to a single GPU
    (--gpus-per-task=1) takes that one (rank/mesh.py's cuda_index)."""

    def __reduce__(self) -> tuple[Callable[[], SlurmTask], tuple]:
        return _in_task, ()

    def __call__(
        self, cfg_dict: dict[str, Any], entry: RankEntry, env: dict[str, str] | None = None
    ) -> Any:
        """`env`: a torchft replica group's (driver/launch/slurm_replicas.py), whose job is
        not requeued: a stopped group fails, and the driver starts it again."""
        submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True
        )
        os.environ.update(env or {})
        if _warned and _checkpoints(cfg_dict) and not env:
            _requeue(signal.SIGUSR2)
        try:
            return entry(cfg_dict)
        except Stopped as stopped:
            if env:
                raise
            _requeue(stopped.signum)

    def checkpoint(
        self, cfg_dict: dict[str, Any], entry: RankEntry, env: dict[str, str] | None = None
    ) -> submitit.helpers.DelayedSubmission | None:
        """submitit's answer to SIGUSR2 arriving before the rank listens for it itself (while
        it starts): requeue as it is, a checkpointing run resumes from its last save."""
        if not _checkpoints(cfg_dict) or env:
            return None
        return submitit.helpers.DelayedSubmission(SlurmTask(), cfg_dict, entry)


def _checkpoints(cfg_dict: dict[str, Any]) -> bool:
    return bool(cfg_dict.get("checkpoint", {}).get("every_steps"))


def _requeue(signum: int) -> None:
    """The time limit's warning: rank 0 requeues the job (a preemption's SIGTERM: SLURM
    does). No result either way: submitit would take it for the job's; the requeued job
    gives it."""
    if signum == signal.SIGUSR2 and os.environ.get("SLURM_PROCID") == "0":
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
    raise SystemExit(0)
