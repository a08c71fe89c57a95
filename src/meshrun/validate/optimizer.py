"""train.optimizer_states: what each kind of moments needs (rank/train/optim_states.py)."""

from __future__ import annotations

import importlib.util

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail

INSTALL = "pip install 'meshrun[float8]' (torchao; make install installs it)"


def check_optimizer_states(cfg: ExperimentConfig) -> None:
    if cfg.train.optimizer_states != "8bit":
        return
    if importlib.util.find_spec("torchao") is None:
        fail(
            "train.optimizer_states",
            "8bit",
            "is torchao's AdamW8bit, and torchao is not installed",
            f"{INSTALL}, or train.optimizer_states=bf16 (meshrun's own) or fp32",
        )
