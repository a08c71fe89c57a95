"""Which Launcher a `launcher.name` selects. meshrun's own: local (torch elastic) and slurm
(submitit); a user's is registered with `register_launcher` before meshrun composes its
config (docs/architecture.md, "A new launcher"). torchrun's ranks need none: each is a
process torchrun started (driver/launch/torchrun.py)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from hydra.core.config_store import ConfigStore

from meshrun.core.config import LAUNCHER_SCHEMAS, ExperimentConfig
from meshrun.core.errors import choice
from meshrun.driver.launch.launcher import Launcher
from meshrun.driver.launch.local import LocalLauncher
from meshrun.driver.launch.slurm import SlurmLauncher

LAUNCHERS: dict[str, Launcher] = {
    launcher.name: launcher for launcher in (LocalLauncher(), SlurmLauncher())
}


def register_launcher(launcher: Launcher) -> None:
    """`launcher` selectable by its name: its schema stored for Hydra as `<name>_schema` (the
    first default of its conf/launcher/<name>.yaml) and for rebuilding configs by name."""
    LAUNCHERS[launcher.name] = launcher
    LAUNCHER_SCHEMAS[launcher.name] = launcher.schema
    ConfigStore.instance().store(
        group="launcher", name=f"{launcher.name}_schema", node=launcher.schema
    )


def launcher_for(name: str) -> Launcher:
    """The launcher `launcher.name` names; ConfigError for an unknown one."""
    choice("launcher.name", name, tuple(LAUNCHERS))
    return LAUNCHERS[name]


Config = TypeVar("Config", bound=ExperimentConfig)


def launcher_checked(cfg: Config) -> Config:
    """`cfg` past its launcher's own rules (the driver's resolve step, once the layout placed
    the ranks), with what they resolve: ConfigError before any process starts."""
    return dataclasses.replace(cfg, launcher=launcher_for(cfg.launcher.name).check(cfg))
