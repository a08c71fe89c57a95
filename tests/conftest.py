"""Shared fixtures."""

from __future__ import annotations

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
