"""The test suite's rank pool (tests/ranks.py) leaves nothing behind: its workers end with
the pytest process that started them, even one killed outright, whose exit hooks never run
(a leftover worker spinning in a job steals the CPU of every later test on the box); a
failed job restarts it only where a worker may still be busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import ranks
from tests.ranks import RankFailed

POOL = """
from tests.ranks import RankPool
if __name__ == "__main__":
    pool = RankPool(2)
    pool.start()
    print(*(p.pid for p in pool.procs), flush=True)
    input()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_workers_end_with_a_pytest_process_killed_outright(tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(POOL)
    root = Path(__file__).parent.parent
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(map(_alive, workers))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, workers)), "rank pool workers outlived their pytest process"


def _raises_on(rank_to_raise: int | None) -> int:
    """Rank `rank_to_raise` raises; every other rank returns its pid, or (rank_to_raise
    None) every rank raises."""
    rank = int(os.environ["RANK"])
    if rank_to_raise is None or rank == rank_to_raise:
        raise ValueError(f"rank {rank} refuses")
    return os.getpid()


def _stuck_beside_a_failure(seconds: float) -> int:
    """Rank 1 raises; rank 0 runs on past the pool's grace, as one stuck in a collective with
    it would."""
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank 1 fails")
    time.sleep(seconds)
    return os.getpid()


def test_a_job_whose_ranks_all_reported_leaves_the_pool_up(rank_pool):
    """A refusal every rank makes, or one rank's error beside peers that finished, frees the
    workers: the next job runs on the same processes (a restart costs every later test the
    workers' start)."""
    rank_pool.start()
    workers = [p.pid for p in rank_pool.procs]
    for raising in (None, 1):
        with pytest.raises(RankFailed) as failed:
            rank_pool.run(_raises_on, raising, world_size=2)
        assert "refuses" in failed.value.error and failed.value.peers_done
    assert [p.pid for p in rank_pool.procs] == workers


def test_a_failure_beside_a_rank_still_running_tears_the_pool_down(rank_pool, monkeypatch):
    monkeypatch.setattr(ranks, "PEERS_GRACE_S", 0.5)  # the default's 5 s, shortened
    rank_pool.start()
    workers = [p.pid for p in rank_pool.procs]
    with pytest.raises(RankFailed) as failed:
        rank_pool.run(_stuck_beside_a_failure, 3.0, world_size=2)
    assert failed.value.rank == 1 and not failed.value.peers_done
    assert not rank_pool.procs  # closed; the next job starts fresh workers
    assert not any(_alive(pid) for pid in workers)
