"""Every rule about a legal experiment, checked in the driver before any process starts.

`validate` turns a composed config with a concrete layout into a fully resolved one (no
`auto` backend or hardware, no -1 degrees) or raises ConfigError naming the key, the bad
value and what would be valid. Choosing a layout (`parallel=auto`) and the memory check are
predictions, one layer up (plan/, composed by driver/resolve.py). Shapes of values (types,
unknown keys, unknown presets) are checked at compose time (driver/compose.py).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch.distributed as dist

from meshrun.core.calibration import read_calibration
from meshrun.core.config import (
    AttentionKernel,
    ExperimentConfig,
    HardwareConfig,
    LoggerConfig,
    resolved_of,
)
from meshrun.core.errors import choice, fail, positive
from meshrun.core.hardware import HostFacts, resolve_hardware
from meshrun.core.layout import Layout
from meshrun.core.wandb_key import has_wandb_key, wandb_host
from meshrun.validate.box_defaults import with_batch, with_precision
from meshrun.validate.checkpoint import check_checkpoint
from meshrun.validate.context import check_context_parallel
from meshrun.validate.custom import check_custom_layout, check_staged
from meshrun.validate.data import check_data, check_text_heldout
from meshrun.validate.experts import check_expert_layout, check_experts
from meshrun.validate.fault_tolerance import check_fault_tolerance
from meshrun.validate.float8 import check_float8
from meshrun.validate.guard import check_guard
from meshrun.validate.inspection import check_inspection
from meshrun.validate.launcher import check_debug
from meshrun.validate.layout import (
    check_batch,
    check_pipeline,
    check_tensor_parallel,
    resolve_layout,
)
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


def validate(cfg: ExperimentConfig, facts: HostFacts) -> ExperimentConfig:
    return validate_run(validate_layout(cfg, facts))


def validate_layout(cfg: ExperimentConfig, facts: HostFacts) -> ExperimentConfig:
    """Backend, hardware, degrees and ranks resolved, and with them the global batch and
    precision left to the box; the pipeline checked: enough to predict memory."""
    check_experiment(cfg)
    hardware = resolve_hardware(cfg.hardware, facts)
    backend = resolve_backend(cfg, hardware, facts)
    parallel, launcher = resolve_layout(dataclasses.replace(cfg, hardware=hardware), facts)
    resolved = dataclasses.replace(
        cfg, backend=backend, hardware=hardware, parallel=parallel, launcher=launcher
    )
    resolved = with_precision(with_batch(resolved, Layout.of(parallel).dp_size), hardware, facts)
    check_tensor_parallel(resolved)
    check_context_parallel(resolved)
    check_expert_layout(resolved)
    check_custom_layout(resolved)
    check_pipeline(resolved)
    check_float8(resolved, facts)
    return resolved


def validate_run(resolved: ExperimentConfig) -> ExperimentConfig:
    """The rest of the rules, on a config from `validate_layout`."""
    check_batch(resolved)
    check_text_heldout(resolved)
    world = resolved.launcher.nproc_per_node * resolved.launcher.nnodes
    check_debug(resolved.debug, world, resolved.train.steps)
    check_inspection(resolved, world)
    check_guard(resolved)
    check_fault_tolerance(resolved)
    check_staged(resolved)
    return check_checkpoint(resolved)


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
        _check_calibration_file(cfg.plan.calibration, cfg.hardware.device_type)
    _check_hardware(cfg.hardware)
    check_run_plan(cfg)


def _check_calibration_file(path: str, device_type: str) -> None:
    """A profile named by path is used as it is: it must be one, measured on this kind."""
    valid = (
        "auto (this host's, beside the results store), none, or the path of a "
        "calibration.json that `meshrun-plan calibrate` wrote"
    )
    if not Path(path).is_file():
        fail("plan.calibration", path, "names no calibration profile (no such file)", valid)
    try:
        profile = read_calibration(Path(path))
    except (ValueError, TypeError) as error:
        fail("plan.calibration", path, f"is not a calibration profile ({error})", valid)
    if profile is not None and profile.device_type != device_type:
        fail(
            "plan.calibration",
            path,
            f"was measured on {profile.device_type} devices; this run's hardware is {device_type}",
            f"a profile `meshrun-plan calibrate` measured on {device_type} devices, or {valid}",
        )


def _check_hardware(hw: HardwareConfig) -> None:
    """The figures the speed model divides by or adds (plan/speed.py)."""
    positive("hardware.intra_node.bw_gbs", hw.intra_node.bw_gbs, allow_none=True)
    positive("hardware.network.nic_gbps", hw.network.nic_gbps, allow_none=True)
    positive("hardware.network.nics", hw.network.nics)
    for key, value in (
        ("intra_node", hw.intra_node.latency_us),
        ("network", hw.network.latency_us),
    ):
        if value < 0:
            fail(
                f"hardware.{key}.latency_us",
                value,
                "is one hop's latency",
                "a number >= 0 (0: not modelled)",
            )
    for index, spec in enumerate(hw.devices):
        key = f"hardware.devices.{index}"
        positive(f"{key}.memory_bw_gbs", spec.memory_bw_gbs, allow_none=True)
        positive(f"{key}.sms", spec.sms, allow_none=True)
        for name in ("matmul_efficiency", "fp8_matmul_efficiency"):
            if not 0 < getattr(spec, name) <= 1:
                fail(
                    f"{key}.{name}",
                    getattr(spec, name),
                    "is the fraction of the peak the best large matmul reaches",
                    "a number in (0, 1], e.g. 0.8",
                )
        _check_attention_kernel(f"{key}.attention", spec.attention)
        for pattern in spec.match:
            try:
                re.compile(pattern)
            except re.error as err:
                fail(
                    f"{key}.match",
                    pattern,
                    f"is not a regular expression ({err})",
                    'torch\'s whole device name, e.g. "NVIDIA H100 80GB HBM3"',
                )


def _check_attention_kernel(key: str, kernel: AttentionKernel) -> None:
    """The measured points plan/compute.kernel_rates interpolates between, if any."""
    given = [kernel.seq, kernel.forward_tflops, kernel.backward_tflops]
    if not any(given):
        return
    if not kernel.seq or kernel.seq != sorted(set(kernel.seq)) or kernel.seq[0] < 1:
        fail(
            f"{key}.seq",
            kernel.seq,
            "are the sequence lengths the kernel's rates were measured at",
            "positive integers in ascending order, e.g. [512, 1024, 2048]",
        )
    for name in ("forward_tflops", "backward_tflops"):
        rates = getattr(kernel, name)
        if len(rates) != len(kernel.seq) or min(rates, default=0) <= 0:
            fail(
                f"{key}.{name}",
                rates,
                f"are the kernel's TFLOP/s at each of {key}.seq ({len(kernel.seq)} lengths)",
                f"{len(kernel.seq)} positive numbers",
            )


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


def resolve_backend(cfg: ExperimentConfig, hardware: HardwareConfig, facts: HostFacts):
    b = cfg.backend
    positive("backend.timeout_s", b.timeout_s)
    on_cuda = hardware.device_type == "cuda"
    name = b.name if b.name != "auto" else ("nccl" if on_cuda else "gloo")
    if name == "nccl" and not (on_cuda and facts.cuda_devices):
        fail(
            "backend",
            "nccl",
            f"nccl needs CUDA devices ({len(facts.cuda_devices)} visible, "
            f"hardware={hardware.name})",
            "gloo (CPU), or auto",
        )
    if name == "mpi" and not dist.is_mpi_available():
        fail(
            "backend",
            "mpi",
            "this torch build has no MPI support (torch.distributed.is_mpi_available() is False)",
            "gloo | nccl | auto",
        )
    return dataclasses.replace(b, name=name)
