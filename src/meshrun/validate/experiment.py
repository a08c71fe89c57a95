"""The rules that hold whatever the layout: training, model, sequence, data, the plan's
figures, the logger; checked before a layout is searched for."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig, LoggerConfig, resolved_of
from meshrun.core.errors import choice, fail, positive
from meshrun.core.wandb_key import has_wandb_key, wandb_host
from meshrun.validate.data import check_data
from meshrun.validate.experts import check_experts
from meshrun.validate.hardware import check_calibration_file, check_hardware
from meshrun.validate.model import check_model, check_sequence
from meshrun.validate.run_plan import check_run_plan


def check_experiment(cfg: ExperimentConfig, model_read_from: str | None = None) -> None:
    """The rules that hold whatever the layout (checked before one is searched for);
    `model_read_from` as read_pretrained returns it, where not resolved in `cfg`."""
    _check_train(cfg)
    check_experts(cfg.model)
    check_model(cfg.model, model_read_from or resolved_of(cfg).model_read_from)
    check_sequence(cfg)
    check_data(cfg)
    _check_plan(cfg)
    positive("metrics.baseline_max_age_h", cfg.metrics.baseline_max_age_h)
    choice("logger.name", cfg.logger.name, ("wandb", "none"))
    check_logger(cfg.logger)


def check_logger(cfg: LoggerConfig) -> None:
    """Online W&B asked for where wandb has no key: the run would train and W&B refuse it
    at the first log, after the launch."""
    if cfg.name == "wandb" and cfg.mode == "online" and not has_wandb_key():
        fail(
            "logger.mode",
            "online",
            f"W&B has no API key here (WANDB_API_KEY, or `wandb login`'s netrc entry for "
            f"{wandb_host()})",
            "auto (online with a key, else offline: `wandb sync` uploads the run later), "
            "offline, or `wandb login` first",
        )


def _check_plan(cfg: ExperimentConfig) -> None:
    if cfg.plan.efficiency is not None and not 0 < cfg.plan.efficiency <= 1:
        fail(
            "plan.efficiency",
            cfg.plan.efficiency,
            "is the MFU a run reaches, a fraction",
            "a number in (0, 1], e.g. 0.4, or null for the device type's",
        )
    if cfg.plan.headroom_gib < 0:
        fail(
            "plan.headroom_gib",
            cfg.plan.headroom_gib,
            "is memory kept free on each device",
            "a number >= 0",
        )
    if not 0 <= cfg.plan.fragmentation < 1:
        fail(
            "plan.fragmentation",
            cfg.plan.fragmentation,
            "is the share of a GPU's memory the caching allocator is allowed to waste",
            "a fraction in [0, 1), e.g. 0.1",
        )
    if cfg.plan.calibration not in ("auto", "none"):
        check_calibration_file(cfg.plan.calibration, cfg.hardware.device_type)
    check_hardware(cfg.hardware)
    check_run_plan(cfg)


def _check_train(cfg: ExperimentConfig) -> None:
    t = cfg.train
    for key in ("steps", "micro_batch_size", "seq_len", "lr", "log_every"):
        positive(f"train.{key}", getattr(t, key))
    positive("train.global_batch_size", t.global_batch_size, allow_none=True)  # null: derived
    positive("train.grad_clip", t.grad_clip, allow_none=True)
    if not 1 <= t.untimed_steps < t.steps:
        fail(
            "train.untimed_steps",
            t.untimed_steps,
            f"needs 1 <= untimed_steps < train.steps ({t.steps}); they are left out of the "
            "step times and are where CPU memory is traced",
            f"an integer from 1 to {max(1, t.steps - 1)}",
        )
    s = t.lr_schedule
    if not 0 <= s.warmup_steps < t.steps:
        fail(
            "train.lr_schedule.warmup_steps",
            s.warmup_steps,
            f"needs 0 <= warmup_steps < train.steps ({t.steps})",
            f"an integer from 0 to {t.steps - 1}",
        )
    if not 0 <= s.min_lr_ratio <= 1:
        fail(
            "train.lr_schedule.min_lr_ratio",
            s.min_lr_ratio,
            "is the floor as a fraction of train.lr",
            "a number from 0 to 1",
        )
    if t.weight_decay < 0:
        fail("train.weight_decay", t.weight_decay, "must not be negative", "a number >= 0")
    if t.eval.every_steps < 0:
        fail(
            "train.eval.every_steps",
            t.eval.every_steps,
            "must not be negative",
            "0 (no evaluation) or the steps between two evaluations",
        )
    positive("train.eval.batches", t.eval.batches)
