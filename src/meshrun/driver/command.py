"""What every console script shares: Hydra composes conf/<name>.yaml into the command's
schema, the command returns its exit code, and under torchrun all ranks share one run dir
(`${now:}` in the default would differ per process)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig

from meshrun.core.attached import attached_rank
from meshrun.core.paths import CONF_DIR
from meshrun.core.schemas import register_schemas
from meshrun.driver.launch.torchrun import run_dir_override


def hydra_command(
    config_name: str,
    run: Callable[[DictConfig], int],
    config_dir: Path = CONF_DIR,
    on_failure: Callable[[int], None] | None = None,
) -> Callable[[], None]:
    """The console script's `main`. `on_failure` sees a non-zero code before the exit (a
    sweep job raises there instead, so Hydra goes on with the other jobs)."""

    @hydra.main(config_path=str(config_dir), config_name=config_name, version_base="1.3")
    def command(dict_cfg: DictConfig) -> None:
        code = run(dict_cfg)
        if code and on_failure is not None:
            on_failure(code)
        if code:
            sys.exit(code)

    register_schemas()

    def main() -> None:
        pinned = any(arg.startswith("hydra.run.dir=") for arg in sys.argv)
        if attached_rank() is not None and not pinned:
            sys.argv.append(run_dir_override())
        command()

    return main
