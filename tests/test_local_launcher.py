"""The local launcher forks ranks from one forkserver per driver, and spawns them instead
where the server's environment or working directory would be stale."""

from __future__ import annotations

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
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         check=True, timeout=120).stdout  # fmt: skip
    assert out.split() == ["forkserver", "forkserver", "spawn", "spawn"]
