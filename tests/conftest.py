"""Shared fixtures."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from meshrun.driver.experiment import measure
from tests.cli import CliRun, run_meshrun
from tests.ranks import RankPool, config_in


@pytest.fixture
def meshrun(tmp_path: Path) -> Callable[..., CliRun]:
    """Call with Hydra overrides; each call gets its own run dir, all calls of one test share
    a results store (so baselines are reused as in real use)."""
    counter = iter(range(1000))

    def run(*overrides: str, **kwargs) -> CliRun:
        return run_meshrun(tmp_path / f"run{next(counter)}", tmp_path / "meshrun.db",
                           *overrides, **kwargs)  # fmt: skip

    return run


def processes_with(token: str) -> set[int]:
    """Live processes whose environment carries `token` (a run's ranks inherit it)."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if token.encode() in environ.read_bytes():
                found.add(int(environ.parent.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found


@pytest.fixture
def marked_env():
    """An env marker for one run; afterwards no process may still carry it. Started first,
    multiprocessing's resource tracker (this process's helper, alive until it exits) does not
    inherit the marker when the test sets it in this process's env for an in-process launch."""
    resource_tracker.ensure_running()
    token = f"run-{uuid.uuid4().hex}"
    yield {"MESHRUN_TEST_MARK": token}
    assert processes_with(token) == set(), "rank processes outlived meshrun"


@pytest.fixture(scope="session")
def rank_pool():
    """Eight real worker processes for the session (dp2 x tp2 x pp2 is the widest layout)."""
    pool = RankPool(8)
    yield pool
    pool.close()


@pytest.fixture
def experiment(tmp_path: Path, rank_pool: RankPool):
    """Call with Hydra overrides: the run measured on the pool (driver.experiment.measure,
    no CLI); each call gets its own run dir under tmp_path."""
    counter = iter(range(1000))

    def run(*overrides: str, role: str = "run"):
        cfg = config_in(tmp_path / f"exp{next(counter)}", *overrides)
        return cfg, measure(cfg, role, rank_pool.launch)

    return run
