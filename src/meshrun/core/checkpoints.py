"""Where a run's checkpoints live and which of them are complete.

A checkpoint is a directory `step-<8 digits>` (the number of steps trained) holding DCP's
files, each rank's RNG state and, written last and atomically by rank 0 once every rank's
data and DCP's `.metadata` are on disk, `manifest.json`. A directory without a manifest was
cut off mid-write: it is never loaded, and the next save of the same step replaces it.

A run dir names its checkpoints too: those in the checkpoint dir its run recorded (run.json,
written as the run starts; results.json's `checkpoint_dir` for runs of older meshruns), or
its `checkpoints/`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from meshrun.core.atomic_write import write_atomic
from meshrun.core.config import CheckpointConfig
from meshrun.core.errors import fail

MANIFEST = "manifest.json"
AUTO = "auto"  # checkpoint.every_steps=auto: the plan's interval (driver/run_plan.py)
PREFIX = "step-"
RUN_FILE = "run.json"  # a run's identity (driver/experiment.begin), which its resumes keep
RESULTS_FILE = "results.json"
# fp32 weights and AdamW's two moments; optimizer steps and RNG states are noise beside them.
BYTES_PER_PARAM = 12


@dataclass
class Manifest:
    """What a checkpoint is of: the run it continues, the model, the layout that saved it."""

    step: int  # steps trained: the step a resume starts at
    run_dir: str
    model: str  # the model config as JSON (models.model_key), checked on resume
    layout: str
    degrees: dict[str, int]
    vocab_rows: int  # the embedding's rows, padded to a multiple of tp
    lr_schedule: dict[str, Any]
    saved_at: str
    seconds_blocked: float  # training waited this long (staging, or the whole sync save)
    seconds_total: float  # staging to the last byte on disk
    bytes: int = 0
    ranks: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_root(cfg: CheckpointConfig, run_dir: str) -> Path:
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def read_manifest(path: Path) -> Manifest:
    return Manifest(**json.loads((path / MANIFEST).read_text()))


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Atomic: a reader sees no manifest or the whole of it."""
    write_atomic(path / MANIFEST, json.dumps(asdict(manifest), indent=2))


def find_resume(cfg: CheckpointConfig, run_dir: str) -> Path | None:
    """The checkpoint `checkpoint.resume` names (None: start fresh), or ConfigError."""
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        found = complete(checkpoint_root(cfg, run_dir))
        return found[-1] if found else None
    path = Path(cfg.resume)
    if path.name.startswith(PREFIX):
        if not path.is_dir():
            fail(
                "checkpoint.resume",
                cfg.resume,
                "no such checkpoint",
                "auto, a step-* checkpoint directory, a checkpoints directory or a run dir",
            )
        if not is_complete(path):
            fail(
                "checkpoint.resume",
                cfg.resume,
                f"has no {MANIFEST}: it was cut off mid-write and is never loaded",
                f"an earlier complete checkpoint: {_listing(path.parent)}",
            )
        return path
    found = complete(path) or complete(run_checkpoints(path))
    if not found:
        fail(
            "checkpoint.resume",
            cfg.resume,
            f"holds no complete checkpoint (step-* with a {MANIFEST}), nor does a run dir's "
            f"checkpoint dir there ({run_checkpoints(path)})",
            "auto, or the path of a run dir, of its checkpoints or of one of them",
        )
    return found[-1]


def run_checkpoints(run_dir: Path) -> Path:
    """Where a run dir's checkpoints are: the checkpoint dir its run recorded, else its
    `checkpoints/`."""
    for name in (RUN_FILE, RESULTS_FILE):
        try:
            recorded = json.loads((run_dir / name).read_text()).get("checkpoint_dir")
        except (OSError, ValueError, AttributeError):
            continue
        if recorded:
            return Path(recorded)
    return run_dir / "checkpoints"


def same_dir(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def find_restore(cfg: CheckpointConfig, run_dir: str, requeued: bool) -> Path | None:
    """The checkpoint a rank loads: the one `checkpoint.resume` names. In a job SLURM
    requeued, the run's own latest save where it saved one since (`auto`: a run that names
    none; a run resumed from a path that saves: a later checkpoint in its checkpoint dir is
    its own, as the resume was refused where one was there before)."""
    named = find_resume(cfg, run_dir)
    if not requeued:
        return named
    own = find_resume(replace(cfg, resume="auto"), run_dir)
    if named is None or (
        cfg.every_steps and own is not None and read_manifest(own).step > read_manifest(named).step
    ):
        return own
    return named


def _listing(root: Path) -> str:
    names = [p.name for p in complete(root)]
    return ", ".join(names) if names else "none here"


def resumed_checkpoint(
    c: CheckpointConfig, run_dir: str, path: Path, manifest: Manifest
) -> CheckpointConfig:
    """The run a resume continues saves on where it saved (the `checkpoint.dir` it used,
    unless another is given). A new run (another run dir) loads this very checkpoint and
    saves into a checkpoint dir of its own: the one given, unless the checkpoint is in it,
    else its run dir's `checkpoints/`."""
    saved_in = path.parent
    if same_dir(manifest.run_dir, run_dir):
        if c.dir is None and not same_dir(saved_in, checkpoint_root(c, run_dir)):
            return replace(c, dir=str(saved_in))
        return c
    own = None if same_dir(checkpoint_root(c, run_dir), saved_in) else c.dir
    return replace(c, resume=str(path.absolute()), dir=own)
