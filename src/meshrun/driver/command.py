"""What every console script shares: Hydra composes conf/<name>.yaml into the command's
schema, the command returns its exit code, and under torchrun all ranks share one run dir
(`${now:}` in the default would differ per process).

A config mistake Hydra or OmegaConf finds while composing (an unknown key or preset, a value
of the wrong type or outside an enum), and a key that is not in the schema even when added
with `+`, exit 2 with meshrun's one-line config error before anything starts, in a single run
and in a multirun (driver/compose.py). For that Hydra runs with HYDRA_FULL_ERROR=1, so its
exceptions reach us instead of being printed with its own advice; any other exception keeps
exit code 1, with its message (a failed sweep job) or its traceback (a bug).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
from omegaconf import DictConfig

from meshrun.core.attached import attached_rank
from meshrun.core.errors import ConfigError
from meshrun.core.paths import CONF_DIR
from meshrun.core.torch_floor import check_torch
from meshrun.driver.compose import check_keys, config_error
from meshrun.driver.launch.torchrun import run_dir_override
from meshrun.driver.schemas import register_schemas
from meshrun.driver.sinks.compare import print_sweep_table
from meshrun.driver.sinks.console import print_error
from meshrun.driver.sweep import SweepJobFailed

FULL_ERROR = "HYDRA_FULL_ERROR"


@contextmanager
def _hydra_raises() -> Iterator[bool]:
    """HYDRA_FULL_ERROR=1 while Hydra runs; yields whether the user had set it already."""
    before = os.environ.get(FULL_ERROR)
    os.environ[FULL_ERROR] = "1"
    try:
        yield before == "1"
    finally:
        if before is None:
            os.environ.pop(FULL_ERROR, None)
        else:
            os.environ[FULL_ERROR] = before


def _torch_refused() -> bool:
    """Whether the installed torch is older than the floor (and says so)."""
    try:
        check_torch()
    except ConfigError as err:
        print_error("config error", str(err))
        return True
    return False


def _pin_torchrun_dir() -> None:
    """Under torchrun every rank runs the command: one run dir for all, unless pinned."""
    pinned = any(arg.startswith("hydra.run.dir=") for arg in sys.argv)
    if attached_rank() is not None and not pinned:
        sys.argv.append(run_dir_override())


def hydra_command(
    config_name: str,
    run: Callable[[DictConfig], int],
    config_dir: Path = CONF_DIR,
    on_failure: Callable[[int, DictConfig], None] | None = None,
) -> Callable[[], None]:
    """The console script's `main`. `on_failure` sees a non-zero code and the config before
    the exit (a sweep job raises there instead, so Hydra goes on with the other jobs)."""
    register_schemas()

    @hydra.main(config_path=str(config_dir), config_name=config_name, version_base="1.3")
    def command(dict_cfg: DictConfig) -> None:
        try:
            check_keys(dict_cfg)
        except ConfigError as err:
            print_error("config error", str(err))
            code = 2
        else:
            code = run(dict_cfg)
        if code and on_failure is not None:
            on_failure(code, dict_cfg)
        if code:
            sys.exit(code)

    def main() -> None:
        if _torch_refused():
            sys.exit(2)
        _pin_torchrun_dir()
        overrides = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
        with _hydra_raises() as user_wants_tracebacks:
            try:
                command()
            except Exception as exc:  # what Hydra's run_and_report would have printed
                error = config_error(exc, overrides)
                if error is not None:
                    print_error("config error", str(error))
                    sys.exit(2)
                if user_wants_tracebacks:
                    raise
                if isinstance(exc, SweepJobFailed):
                    print_sweep_table(exc.store_path, exc.sweep)
                    print_error("sweep failed", f"{type(exc).__name__}: {exc}")
                else:
                    traceback.print_exc()
                sys.exit(1)

    return main
