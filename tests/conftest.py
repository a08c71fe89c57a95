"""Shared fixtures."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli import CliRun, run_meshrun


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
    """An env marker for one run; afterwards no process may still carry it."""
    token = f"run-{uuid.uuid4().hex}"
    yield {"MESHRUN_TEST_MARK": token}
    assert processes_with(token) == set(), "rank processes outlived meshrun"
