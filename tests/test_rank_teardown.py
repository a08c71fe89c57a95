"""A rank's process groups end with its run, finished or failed: their gloo threads stop
while the interpreter runs. Left to the interpreter's exit, a torchrun rank aborted after a
completed run ("terminate called without an active exception", SIGABRT: srun then failed
the job). Each rank here runs on the session's rank pool and reads its threads as soon as
its run returns or raises, before anything else of the process runs: what the interpreter's
exit would find."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshrun.rank.worker import run_rank
from tests.ranks import config_in

RUN = ("model=tiny", "parallel=ddp", "train.steps=4", "train.untimed_steps=1")


def _gloo_threads_once_run(cfg: dict[str, Any]) -> list[str]:
    """The rank's run, then its threads of gloo process groups (a group's loop and workers)."""
    with contextlib.suppress(Exception):
        run_rank(cfg)
    tasks = Path("/proc/self/task")
    names = [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]
    return [name for name in names if name.startswith(("gloo", "pt_gloo"))]


def test_a_finished_run_leaves_no_process_group_threads_in_its_ranks(tmp_path, rank_pool):
    cfg = config_in(tmp_path, *RUN)
    assert rank_pool.run(_gloo_threads_once_run, asdict(cfg), world_size=2) == [[], []]


def test_a_failed_run_leaves_no_process_group_threads_in_its_ranks(tmp_path, rank_pool):
    """Rank 1 raises; rank 0 fails on the connection it closed: both failures' tracebacks
    held the mesh in their frames."""
    cfg = config_in(tmp_path, *RUN, "debug.fail_rank=1", "debug.fail_step=2")
    assert rank_pool.run(_gloo_threads_once_run, asdict(cfg), world_size=2) == [[], []]
    assert (Path(cfg.run_dir) / "failures").is_dir()  # it did fail
