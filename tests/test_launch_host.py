"""The launch host (tests/launch_host.py) keeps the real launcher's promise across its process
boundary: a launch past its deadline ends the host with its forkserver and every rank (one
process group), and the next launch starts a fresh host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.launch_host import LaunchHost
from tests.ranks import config_in

RUN = ("model=tiny", "parallel=ddp", "train.seq_len=32", "metrics.baseline=off")


def _in_group(pgid: int) -> set[int]:
    """Live processes of process group `pgid`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.add(int(stat.parent.name))
    return found


@pytest.mark.waits  # on the launch's deadline
def test_a_launch_past_its_deadline_ends_the_host_and_its_ranks_and_the_next_starts_afresh(
    tmp_path,
):
    host = LaunchHost()
    try:
        host.start()
        first = host.pid
        slow = config_in(tmp_path / "slow", *RUN, "train.steps=50", "debug.slow_step_s=0.5")
        with pytest.raises(TimeoutError):
            host.launch(slow, timeout=10)  # 25 s of pauses at least
        deadline = time.monotonic() + 10
        while _in_group(first) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _in_group(first) == set(), "the host's forkserver or ranks outlived it"
        quick = config_in(tmp_path / "quick", *RUN, "train.steps=2", "train.untimed_steps=1")
        report = host.launch(quick)
        assert host.pid != first and report is not None
    finally:
        host.close()
