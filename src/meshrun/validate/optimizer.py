"""train.optimizer_states: what each kind of moments needs (rank/train/optim_states.py):
torchao for `8bit`, and weights that are no float8 wrapper (train.float8's FSDP2 all-gather)."""

from __future__ import annotations

import importlib.util

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.layout import Layout

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
    f8 = cfg.train.float8
    gathers_float8 = f8.enabled and f8.gathers_float8 and Layout.of(cfg.parallel).uses_fsdp
    if gathers_float8 and cfg.parallel.data_parallel != "dataparallel":
        fail(
            "train.optimizer_states",
            "8bit",
            "steps through torchao's compiled update, which crashes the rank (SIGSEGV, "
            "torchao 0.18) on the float8 weights FSDP2 all-gathers in float8",
            "train.float8.fsdp_all_gather=false (measured to train), or "
            "train.optimizer_states=bf16",
        )
