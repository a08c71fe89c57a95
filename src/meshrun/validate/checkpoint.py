"""The checkpoint rules: what `checkpoint.*` may be, and whether the checkpoint a resume names
can continue this experiment (same model, rows in an order this layout reads, RNG states
that are tensors only, room left to train, no later checkpoint overwritten, a disk with room
for the next one).

A resume in the checkpoint's own run dir continues its run; in another run dir it is a new
run there (driver/resume.py says which run dir a command gives), which loads that very
checkpoint and never saves into the checkpoint dir it came from."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from meshrun.core.checkpoints import (
    AUTO,
    BYTES_PER_PARAM,
    Manifest,
    checkpoint_root,
    complete,
    find_resume,
    read_manifest,
    resumed_checkpoint,
)
from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.layout import Layout
from meshrun.core.rng_state import RngStateRefused, read_rng_state, rng_file
from meshrun.models import model_key, model_kind, param_counts

NOT_THE_MODEL = ("name", "pretrained")  # a resume takes the weights from the checkpoint
NOT_THE_EXPERTS = ("grouped_mm",)  # how model.moe's experts compute, not what they hold


def check_checkpoint(cfg: ExperimentConfig) -> None:
    """A resume's checkpoint found and checked, and the checkpoint dir the run saves into
    (core/checkpoints.resumed_checkpoint's)."""
    c = cfg.checkpoint
    _check_values(cfg)
    path = find_resume(c, cfg.run_dir)
    if path is not None:
        manifest = read_manifest(path)
        _check_same_model(cfg, manifest)
        _check_rng_states(cfg, path, manifest)
        _check_steps_left(cfg, path, manifest)
        checkpoint = resumed_checkpoint(c, cfg.run_dir, path, manifest)
        cfg = dataclasses.replace(cfg, checkpoint=checkpoint)
        _check_nothing_overwritten(cfg, manifest)
    if c.every_steps or c.export != "none":
        _check_space(cfg)


def _check_values(cfg: ExperimentConfig) -> None:
    """What `checkpoint.*` may be, before the disk is looked at."""
    c = cfg.checkpoint
    if c.every_steps != AUTO and (type(c.every_steps) is not int or c.every_steps < 0):
        fail(
            "checkpoint.every_steps",
            c.every_steps,
            "must not be negative" if isinstance(c.every_steps, int) else "is no step count",
            "0 (no checkpoints), the steps between two, or auto (the plan's interval for "
            "plan.mtbf_hours, in steps of the measured step time)",
        )
    if c.keep < 1:
        fail("checkpoint.keep", c.keep, "keeps at least the latest", "an integer >= 1")
    refused = model_kind(cfg.model).hf_form_refused(cfg.model) if c.export == "hf" else None
    if refused is not None:
        fail("checkpoint.export", c.export, *refused)


def _check_same_model(cfg: ExperimentConfig, manifest: Manifest) -> None:
    """The weights must fit this model; its name and source may differ, as a resume takes the
    weights from the checkpoint."""
    saved, ours = _weights_of(manifest.model), _weights_of(model_key(cfg.model)[1])
    if saved != ours:
        differ = sorted(k for k in saved.keys() | ours.keys() if saved.get(k) != ours.get(k))
        fail(
            "checkpoint.resume",
            cfg.checkpoint.resume,
            f"is a checkpoint of another model (model.{', model.'.join(differ)} differ)",
            f"a checkpoint of this model, or the model it was saved with: {saved}",
        )


def _weights_of(model: str) -> dict:
    """A model config (JSON) less what does not shape its weights."""
    fields = {k: v for k, v in json.loads(model).items() if k not in NOT_THE_MODEL}
    if isinstance(fields.get("moe"), dict):
        fields["moe"] = {k: v for k, v in fields["moe"].items() if k not in NOT_THE_EXPERTS}
    return fields


def _check_rng_states(cfg: ExperimentConfig, path: Path, manifest: Manifest) -> None:
    """The RNG states the ranks will load (under the layout that saved them), read here as
    they will be: a file that pickles anything but tensors is refused before any rank
    starts, nothing in it run (core/rng_state.py; the ranks read it the same way)."""
    layout = Layout.of(cfg.parallel)
    if manifest.degrees != layout.degrees():
        return
    for rank in range(layout.world_size):
        if (found := rng_file(path, rank)).is_file():
            try:
                read_rng_state(found)
            except RngStateRefused as refused:
                fail("checkpoint.resume", cfg.checkpoint.resume, refused.problem, refused.fix)


def _check_steps_left(cfg: ExperimentConfig, path: Path, manifest: Manifest) -> None:
    """A resume with nothing left to train would only repeat the checkpoint."""
    if manifest.step >= cfg.train.steps:
        fail(
            "train.steps",
            cfg.train.steps,
            f"the checkpoint {path} has trained {manifest.step} steps already",
            f"more than {manifest.step} to train on",
        )


def _check_nothing_overwritten(resumed: ExperimentConfig, manifest: Manifest) -> None:
    """A resume from an older checkpoint that saves again would replace the later ones of the
    run it continues."""
    c = resumed.checkpoint
    root = checkpoint_root(c, resumed.run_dir)
    later = [p.name for p in complete(root) if read_manifest(p).step > manifest.step]
    if later and c.every_steps:
        fail(
            "checkpoint.resume",
            c.resume,
            f"is older than {', '.join(later)} in {root}: its saves would overwrite them",
            "the latest (checkpoint.resume=auto), or a new checkpoint.dir",
        )


def _check_space(cfg: ExperimentConfig) -> None:
    root = checkpoint_root(cfg.checkpoint, cfg.run_dir)
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is None:
        return
    params = param_counts(cfg.model, cfg.train.seq_len)[0]
    need = params * BYTES_PER_PARAM
    free = shutil.disk_usage(existing).free
    if free < need:
        fail(
            "checkpoint.dir",
            cfg.checkpoint.dir or str(root),
            f"has {free / 2**30:.2f} GiB free; one checkpoint of {params:,} parameters "
            f"needs about {need / 2**30:.2f} GiB",
            "a directory on a disk with room",
        )
