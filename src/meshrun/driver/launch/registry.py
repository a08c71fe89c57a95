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
from meshrun.driver.launch.launcher import Launcher, ReplicaLauncher, Submitter
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


def replica_launcher(cfg: ExperimentConfig) -> ReplicaLauncher:
    """The launcher that starts parallel.fault_tolerance=torchft's replica groups apart;
    ConfigError (exit 2) for one that cannot."""
    launcher = launcher_for(cfg.launcher.name)
    if not isinstance(launcher, ReplicaLauncher):
        capable = [
            name for name, built_in in BUILT_IN.items() if isinstance(built_in, ReplicaLauncher)
        ]
        fail(
            "launcher.name",
            cfg.launcher.name,
            "cannot start torchft's replica groups apart (parallel.fault_tolerance=torchft): it "
            "has no replica_groups",
            f"{' | '.join(capable)}, or parallel.fault_tolerance=none",
        )
    return launcher


Config = TypeVar("Config", bound=ExperimentConfig)


def launcher_checked(cfg: Config) -> Config:
    """`cfg` past its launcher's own rules (the driver's resolve step, once the layout placed
    the ranks), with what they resolve: ConfigError before any process starts."""
    launcher = launcher_for(cfg.launcher.name)
    if cfg.parallel.fault_tolerance == "torchft":
        launcher = replica_launcher(cfg)
    return dataclasses.replace(cfg, launcher=launcher.check(cfg))
