"""Compose experiment configs in-process with Hydra's compose API (no subprocess, no run dir).

`compose_config` returns the typed config exactly as Hydra composes it (before validation);
`resolved_config` runs it through `meshrun.driver.resolve.resolve` against this host's facts.

`conf/train.yaml` takes `run_dir` and `store.path` from `${hydra:...}` interpolations that only
a running Hydra job can resolve, so unless the overrides set them these helpers pin them to
paths under the system temp dir (composing never creates or writes them; a test that runs
anything should pass its own `tmp_path` paths). `logger` defaults to `none` for the same reason:
no W&B in unit tests unless asked for.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from meshrun.core.config import ExperimentConfig, RunConfig
from meshrun.core.hardware import HostFacts
from meshrun.core.paths import CONF_DIR
from meshrun.driver.compose import check_keys, config_error
from meshrun.driver.resolve import resolve
from meshrun.driver.schemas import register_schemas
from meshrun.rank.train.data import LocalBatches, build_dataset

SCRATCH = Path(tempfile.gettempdir()) / "meshrun-tests"  # the tests' own files outside tmp_path
_DEFAULTS = {
    "run_dir": str(SCRATCH / "run"),
    "store.path": str(SCRATCH / "meshrun.db"),
    "logger": "none",
}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compose_config(*overrides: str) -> ExperimentConfig:
    """The raw typed config of `meshrun <overrides>` (unvalidated: `auto`s and -1s remain).

    Composition is as strict as the CLI's: an unknown key (with or without `+`), preset,
    type or enum value raises the ConfigError `meshrun` would print (driver/compose.py)."""
    return OmegaConf.to_object(composed(*overrides))


def composed(*overrides: str) -> DictConfig:
    """`compose_config`'s config before it is typed (Hydra's compose: ~0.1 s a call)."""
    register_schemas()
    given = {_key(o) for o in overrides}
    defaults = [f"{key}={value}" for key, value in _DEFAULTS.items() if key not in given]
    composed = [*defaults, *overrides]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=composed)
        check_keys(cfg)
    except Exception as exc:
        error = config_error(exc, composed)
        if error is None:
            raise
        raise error from exc
    return cfg


def resolved_config(*overrides: str) -> RunConfig:
    """`compose_config(*overrides)` after `resolve` on this host (layout and hardware resolved)."""
    return resolve(compose_config(*overrides), HostFacts.detect()).config


def transformers_first_loss(cfg: RunConfig, model: torch.nn.Module, step: int = 0) -> float:
    """A transformers model's own loss on the batch a run of `cfg` trains step `step` on."""
    t = cfg.train
    vocab = model.config.vocab_size
    data = build_dataset(cfg.data, cfg.resolved.data_cache, vocab, t.seed, t.seq_len)
    batches = LocalBatches(data, t.global_batch_size, t.seq_len, 0, 1, "cpu", start_step=step)
    inputs, targets = batches.for_step(step)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
