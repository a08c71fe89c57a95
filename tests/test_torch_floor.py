"""The torch floor: the version pyproject.toml promises is the one meshrun checks, and a
torch older than it is refused before anything starts (exit 2, naming what is needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tomllib
import torch
from packaging.requirements import Requirement

from meshrun.core.errors import ConfigError
from meshrun.core.paths import REPO_ROOT
from meshrun.core.torch_floor import TORCH_FLOOR, check_torch
from meshrun.driver import cli
from meshrun.driver import command as command_module
from tests.cli import run_console


def test_pyproject_promises_the_floor_that_is_checked():
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    [torch] = [Requirement(d) for d in dependencies["dependencies"] if d.startswith("torch")]
    assert str(torch.specifier) == f">={TORCH_FLOOR}"


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.12.0a0+git1a2b3c", "2.11.0+cu130"])
def test_the_floor_and_newer_builds_pass(version):
    check_torch(version)


@pytest.mark.parametrize("version", ["2.10.2", "2.6.0+cu124", "2.10.0a0+gitdeadbee"])
def test_an_older_torch_is_refused_with_the_version_needed(version):
    with pytest.raises(ConfigError) as caught:
        check_torch(version)
    assert caught.value.key == "torch"
    assert f"torch>={TORCH_FLOOR}" in str(caught.value)


def test_meshrun_refuses_an_older_torch_before_it_composes(tmp_path, monkeypatch):
    """The installed torch's version, as the package metadata says it, is 2.10: exit 2."""
    monkeypatch.setattr(command_module, "check_torch", lambda: check_torch("2.10.1"))
    run = run_console(cli.main, tmp_path / "run", tmp_path / "meshrun.db")
    assert run.returncode == 2
    assert "config error torch='2.10.1': is older than the oldest torch" in run.output
    assert not (tmp_path / "meshrun.db").exists()  # nothing ran, nothing was recorded


def test_the_floor_script_refuses_a_venv_without_the_floor_torch(tmp_path):
    """scripts/test-torch-floor.sh (CI's floor job) takes the floor meshrun checks and will
    not pass the subset on another torch: here make install's venv stands as the floor's."""
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    run = subprocess.run(
        [REPO_ROOT / "scripts" / "test-torch-floor.sh", "test"],
        env={**os.environ, "FLOOR_VENV": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1
    assert f"has torch {torch.__version__}, not the floor {TORCH_FLOOR}" in run.stderr
