"""The local launcher forks ranks from one forkserver per driver, and spawns them instead
where the server's environment or working directory would be stale; the driver waits for
the server at exit, so its ranks' CPU time is the driver's. Plain fork is refused where the
ranks would use CUDA."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from meshrun.core.errors import ConfigError
from meshrun.core.hardware import CudaDevice, HostFacts
from meshrun.core.paths import REPO_ROOT
from meshrun.driver.resolution import resolved_config
from tests.helpers import compose_config

CHECK = """
import os
from meshrun.driver.launch.start_method import start_method
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


PRELOAD = """
import multiprocessing
from meshrun.driver.launch import RankEntry
from meshrun.driver.launch.start_method import rank_start_method

if __name__ == "__main__":
    entry = RankEntry("tests.preload_probe", "imported_elsewhere")
    for configured in ("forkserver", "spawn"):
        ctx = multiprocessing.get_context(rank_start_method(configured, entry))
        with ctx.Pool(1) as pool:
            print(pool.apply(entry, ({},)))
"""


@pytest.mark.slow
def test_forked_ranks_find_their_entry_preloaded_by_the_server(tmp_path):
    """What both launchers (torch elastic's, torchft's replicas) start their ranks with: a
    forkserver that imported the entry's module once, so no rank imports torch again."""
    script = tmp_path / "driver.py"
    script.write_text(PRELOAD)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    ).stdout
    assert out.split() == ["True", "False"]


BURN = """
import multiprocessing
import resource
import time

from meshrun.driver.launch.start_method import start_method


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


@pytest.mark.slow
def test_a_forkserver_ranks_cpu_time_is_the_drivers(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(BURN)
    before = _children_cpu_s()
    driver = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=120
    )
    beyond_the_driver = _children_cpu_s() - before - float(driver.stdout)
    assert beyond_the_driver >= 1.0  # the rank's second of CPU, not lost with the server


def test_fork_is_refused_where_the_ranks_would_use_cuda():
    """A box of two H100s as the driver sees it: it has read their properties, so CUDA is
    initialised in it and a forked rank could not use it; forkserver and spawn start clean."""
    gpus = HostFacts([CudaDevice("NVIDIA H100 80GB HBM3", 79.1)] * 2, cpu_count=16, memory_gib=128)
    with pytest.raises(ConfigError) as refused:
        resolved_config(compose_config("launcher.start_method=fork", "parallel=ddp"), gpus)
    assert refused.value.key == "launcher.start_method"
    assert "forkserver (the default) or spawn" in str(refused.value)
    for method in ("forkserver", "spawn"):
        resolved_config(compose_config(f"launcher.start_method={method}", "parallel=ddp"), gpus)
    on_cpu = ("launcher.start_method=fork", "hardware=cpu", "backend=gloo", "parallel=ddp")
    assert resolved_config(compose_config(*on_cpu), gpus).hardware.device_type == "cpu"
