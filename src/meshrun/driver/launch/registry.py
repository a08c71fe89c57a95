"""Which Launcher a `launcher.name` selects: meshrun's own, local (torch elastic) and slurm
(submitit), or a user's, named by its import path "package.module:attribute" (a Launcher
class or instance in their module, imported as model kinds are: core/imports.py; see
docs/architecture.md, "A new launcher"). torchrun's ranks need none: each is a process
torchrun started (driver/launch/torchrun.py)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TypeVar

from meshrun.core.config import LAUNCHER_SCHEMAS, ExperimentConfig
from meshrun.core.errors import choice, fail
from meshrun.core.imports import import_target
from meshrun.driver.launch.launcher import Launcher, Submitter
from meshrun.driver.launch.local import LocalLauncher
from meshrun.driver.launch.slurm import SlurmLauncher

BUILT_IN: dict[str, Launcher] = {
    launcher.name: launcher for launcher in (LocalLauncher(), SlurmLauncher())
}


def launcher_for(name: str) -> Launcher:
    """The launcher `launcher.name` names; ConfigError (exit 2) where it names none."""
    if ":" not in name:
        choice("launcher.name", name, tuple(LAUNCHER_SCHEMAS))
        return BUILT_IN[name]
    launcher = _imported(name)
    if launcher is None:
        fail(
            "launcher.name",
            name,
            "is no launcher of meshrun's, nor an importable Launcher",
            f"{' | '.join(BUILT_IN)}, or package.module:attribute of a Launcher",
        )
    return launcher


@functools.cache
def _imported(name: str) -> Launcher | None:
    try:
        launcher = import_target(name)
    except (ImportError, ValueError):
        return None
    launcher = launcher() if isinstance(launcher, type) else launcher  # a class or its instance
    return launcher if isinstance(launcher, Launcher) else None


def submitter(launcher: Launcher) -> Submitter:
    """`launcher` as one whose ranks outlive the driver; TypeError for one that cannot be
    left (its `waits` must then be true)."""
    if not isinstance(launcher, Submitter):
        raise TypeError(f"launcher={launcher.name} waits for its ranks: it submits nothing")
    return launcher


Config = TypeVar("Config", bound=ExperimentConfig)


def launcher_checked(cfg: Config) -> Config:
    """`cfg` past its launcher's own rules (the driver's resolve step, once the layout placed
    the ranks), with what they resolve: ConfigError before any process starts."""
    return dataclasses.replace(cfg, launcher=launcher_for(cfg.launcher.name).check(cfg))
