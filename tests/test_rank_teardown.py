"""A rank's process groups end with its run, finished or failed: their gloo threads stop
while the interpreter runs. Left to the interpreter's exit, a torchrun rank aborted after a
completed run ("terminate called without an active exception", SIGABRT: srun then failed
the job). Each rank here runs on the session's rank pool and reads its threads as soon as
its run returns or raises, before anything else of the process runs: what the interpreter's
exit would find (the count is the run's own, after against before)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from meshrun.rank.mesh import end_distributed
from meshrun.rank.worker import run_rank
from tests.ranks import config_in

RUN = ("model=tiny", "train.steps=4", "train.untimed_steps=1", "metrics.baseline=off")


def _gloo_threads() -> int:
    """This process's threads of gloo process groups (a group's loop and its workers)."""
    tasks = Path("/proc/self/task")
    names = [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


def _threads_the_run_left(cfg: dict[str, Any]) -> int:
    end_distributed()  # an earlier pool job's groups (DTensor's caches): not the run's
    before = _gloo_threads()
    with contextlib.suppress(Exception):
        run_rank(cfg)
    return _gloo_threads() - before


def _none_added(left: list[int]) -> bool:
    """No rank has more gloo threads after its run than before. Fewer is no leak: a group an
    earlier pool job left (one, 3 threads, that end_distributed did not reach) was collected
    during the run, its count -3 on both ranks (twice in some 3,000 runs of the fast suite;
    waiting 10 s before counting did not end them)."""
    return all(n <= 0 for n in left)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp2"])
def test_a_finished_run_leaves_no_process_group_threads_in_its_ranks(layout, tmp_path, rank_pool):
    """DDP's mesh (a cycle with its flattened dimension) was still the rank's local; FSDP2's
    groups also sit in DTensor's sharding cache and take a second collection; TP's in
    DTensor's redistribution planners and its mesh topology cache (6 groups, 18 threads), and
    in loss_parallel's tensor metadata (tp2's loss is vocab_parallel)."""
    cfg = config_in(tmp_path, *RUN, f"parallel={layout}")
    assert _none_added(rank_pool.run(_threads_the_run_left, asdict(cfg), world_size=2))
    assert (Path(cfg.run_dir) / "metrics.jsonl").exists()  # it did train


def test_a_failed_run_leaves_no_process_group_threads_in_its_ranks(tmp_path, rank_pool):
    """Rank 1 raises; rank 0 fails on the connection it closed: both failures' tracebacks
    held the mesh in their frames."""
    cfg = config_in(tmp_path, *RUN, "parallel=ddp", "debug.fail_rank=1", "debug.fail_step=2")
    left = rank_pool.run(_threads_the_run_left, asdict(cfg), world_size=2)
    assert _none_added(left)
    assert (Path(cfg.run_dir) / "failures").is_dir()  # it did fail
