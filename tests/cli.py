"""Run the real `meshrun` CLI in a subprocess and read back what it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrun.sinks.store import ResultsStore

# `meshrun -m`: Hydra's flags go before the overrides.
MULTIRUN = (sys.executable, "-m", "meshrun.cli", "-m")


@dataclass
class CliRun:
    returncode: int
    output: str
    run_dir: Path
    store_path: Path
    seconds: float

    @property
    def results(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "results.json").read_text())

    def stored(self) -> list[dict[str, Any]]:
        return ResultsStore(self.store_path).runs()


def run_meshrun(
    run_dir: Path,
    store_path: Path,
    *overrides: str,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    entrypoint: tuple[str, ...] = (sys.executable, "-m", "meshrun.cli"),
) -> CliRun:
    """Isolated run: own run dir and store, no W&B unless an override asks for it."""
    command = [
        *entrypoint,
        f"hydra.run.dir={run_dir}", f"store.path={store_path}",
        "logger=none", "train.progress_bar=false", *overrides,
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=timeout,
        cwd=run_dir.parent,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    seconds = time.monotonic() - started
    return CliRun(proc.returncode, proc.stdout + proc.stderr, run_dir, store_path, seconds)
