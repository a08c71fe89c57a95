"""Run the real `meshrun` CLI in a subprocess and read back what it recorded."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from meshrun.core.paths import CONF_DIR
from meshrun.driver.schemas import register_schemas
from meshrun.driver.sinks.store import ResultsStore

# `meshrun -m`: Hydra's flags go before the overrides.
MULTIRUN = (sys.executable, "-m", "meshrun", "-m")
TRAIN_DEFAULTS = ("logger=none", "train.progress_bar=false")


@dataclass
class CliRun:
    returncode: int
    output: str
    run_dir: Path
    store_path: Path | None
    seconds: float

    @property
    def results(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "results.json").read_text())

    def stored(self) -> list[dict[str, Any]]:
        return ResultsStore(self.store_path).runs()


def run_meshrun(
    run_dir: Path,
    store_path: Path | None,
    *overrides: str,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    entrypoint: tuple[str, ...] = (sys.executable, "-m", "meshrun"),
    defaults: tuple[str, ...] = TRAIN_DEFAULTS,
) -> CliRun:
    """Isolated run: own run dir and store (None: a command without one), no W&B unless an
    override asks for it; `defaults` are the entrypoint's quiet settings."""
    store = [f"store.path={store_path}"] if store_path is not None else []
    command = [*entrypoint, f"hydra.run.dir={run_dir}", *store, *defaults, *overrides]
    started = time.monotonic()
    proc = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=run_dir.parent,
        env={**os.environ, **(env or {})},
    )
    seconds = time.monotonic() - started
    return CliRun(proc.returncode, proc.stdout + proc.stderr, run_dir, store_path, seconds)


def run_console(
    main: Callable[[], None],
    run_dir: Path,
    store_path: Path | None,
    *overrides: str,
    defaults: tuple[str, ...] = TRAIN_DEFAULTS,
    multirun: bool = False,
    flags: tuple[str, ...] = (),
) -> CliRun:
    """`run_meshrun` without the interpreter start: the console script's `main` called in
    this process with the same argv, its exit code and output captured. For commands whose
    ranks are not the subject (they run on the test's pool or not at all); the process
    boundary itself is proven by the tests that use `run_meshrun`. `flags`: Hydra's own
    (`--config-dir DIR`), which go before the overrides."""
    store = [f"store.path={store_path}"] if store_path is not None else []
    argv = [
        "meshrun",
        *(["-m"] if multirun else []),
        *flags,
        f"hydra.run.dir={run_dir}",
        *store,
        *defaults,
        *overrides,
    ]
    output = io.StringIO()
    started = time.monotonic()
    saved_argv, sys.argv = sys.argv, argv
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = saved_argv
    return CliRun(code, output.getvalue(), run_dir, store_path, time.monotonic() - started)


def compose_command(config_name: str, run_dir: Path, *overrides: str):
    """conf/<config_name>.yaml composed as the console script's Hydra would (schemas
    registered first, as hydra_command does), with `run_dir` set and created as Hydra's job
    dir is: to call the command's `run` in-process."""
    register_schemas()
    run_dir.mkdir(parents=True, exist_ok=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides=[f"run_dir={run_dir}", *overrides])


def interrupted_meshrun(
    run_dir: Path, store_path: Path, *overrides: str, after_steps: int = 4
) -> tuple[int, str]:
    """`meshrun` in a session of its own, Ctrl-C'd (SIGINT to its whole process group, as a
    terminal sends it) once `after_steps` steps are in its metrics.jsonl: its exit code and
    output."""
    command = [
        sys.executable, "-m", "meshrun", f"hydra.run.dir={run_dir}",
        f"store.path={store_path}", *TRAIN_DEFAULTS, *overrides,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=run_dir.parent,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= after_steps):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    return proc.returncode, output
