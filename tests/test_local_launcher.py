"""The local launcher forks ranks from one forkserver per driver, and spawns them instead
where the server's environment or working directory would be stale; the driver waits for
the server at exit, so its ranks' CPU time is the driver's."""

from __future__ import annotations

import resource
import subprocess
import sys

CHECK = """
import os
from meshrun.driver.launch.local import start_method
seen = [start_method("forkserver")]
os.environ["WANDB_SERVICE"] = "set by the driver's W&B sink"
os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "set by torch elastic as it launches"
seen.append(start_method("forkserver"))
os.environ["NCCL_P2P_DISABLE"] = "1"  # what a sweep job's hydra.job.env_set might change
seen.append(start_method("forkserver"))
seen.append(start_method("spawn"))
print(" ".join(seen))
"""


def test_forkserver_unless_the_drivers_environment_changed_since_it_started():
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.split() == ["forkserver", "forkserver", "spawn", "spawn"]


BURN = """
import multiprocessing
import resource
import time

from meshrun.driver.launch.local import start_method


def burn() -> None:
    end = time.process_time() + 1.0
    while time.process_time() < end:
        pass


if __name__ == "__main__":
    rank = multiprocessing.get_context(start_method("forkserver")).Process(target=burn)
    rank.start()
    rank.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(usage.ru_utime + usage.ru_stime)
"""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_a_forkserver_ranks_cpu_time_is_the_drivers(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(BURN)
    before = _children_cpu_s()
    driver = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=120
    )
    beyond_the_driver = _children_cpu_s() - before - float(driver.stdout)
    assert beyond_the_driver >= 1.0  # the rank's second of CPU, not lost with the server
