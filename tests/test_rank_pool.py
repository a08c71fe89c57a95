"""The test suite's rank pool (tests/ranks.py) leaves nothing behind: its workers end with
the pytest process that started them, even one killed outright, whose exit hooks never run
(a leftover worker spinning in a job steals the CPU of every later test on the box)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
