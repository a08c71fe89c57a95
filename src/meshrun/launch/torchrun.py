"""Attach mode: this process was started by torchrun (or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR/PORT) and is one rank; torchrun owns teardown on failure."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from meshrun.config import CommRunConfig, ExperimentConfig
from meshrun.launch import RankFailure
from meshrun.worker import run_rank


def attached_rank() -> int | None:
    """This process's rank when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def attached_nodes() -> int:
    """How many nodes torchrun started ranks on (its --nnodes)."""
    return int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def run_dir_override() -> str:
    """One run dir for all ranks: `${now:}` would differ per process."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        run_id = f"port{os.environ.get('MASTER_PORT', '0')}"
    return f"hydra.run.dir=outputs/torchrun/{run_id}"


def launch_attached(
    cfg: ExperimentConfig | CommRunConfig,
    entry: Callable[[dict[str, Any]], Any] = run_rank,
) -> Any:
    try:
        return entry(asdict(cfg))
    except Exception as err:
        raise RankFailure(attached_rank() or 0, f"{type(err).__name__}: {err}") from err
