"""train.float8's rules (rank/parallel/float8.py runs it): torchao installed, a device with
float8 tensor cores, a precision the recipe's scaled matmuls output, a layout torchao's
float8 composes with, and at least one linear the filter takes (models/float8.py)."""

from __future__ import annotations

import importlib.util

import torch
from packaging.version import Version

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.hardware import HostFacts
from meshrun.models import float8_coverage

INSTALL = "pip install 'meshrun[float8]' (make install installs it)"
KEY = "train.float8.enabled"
# torch._scaled_mm's float8 kernels: CUDA compute capability 8.9 (Ada) and newer
# (aten/src/ATen/native/cuda/Blas.cpp, _scaled_mm_out_cuda: "torch._scaled_mm is only
# supported on CUDA devices with compute capability >= 9.0 or 8.9"); CPUs run it too.
FLOAT8_CAPABILITY = (8, 9)
OFF = "train.float8.enabled=false"
# torch 2.11's CPU _scaled_mm takes one scale a tensor only (aten/src/ATen/native/Blas.cpp:
# "Now _scaled_mm only supports per-tensor scaling"); 2.12 takes a row's (checked here).
CPU_ROWWISE_TORCH = Version("2.12")


def cpu_scales_rows(torch_version: str) -> bool:
    """Whether this torch's CPU _scaled_mm takes the rowwise recipes' per-row scales."""
    return Version(Version(torch_version).base_version) >= CPU_ROWWISE_TORCH


def check_float8(cfg: ExperimentConfig, facts: HostFacts) -> None:
    """A resolved layout's float8, where enabled; ConfigError (exit 2) naming the key."""
    f8 = cfg.train.float8
    if not f8.enabled:
        return
    if importlib.util.find_spec("torchao") is None:
        fail(KEY, True, "needs torchao (float8 training), which is not installed", INSTALL)
    _check_devices(cfg, facts)
    _check_precision(cfg)
    _check_recipe(cfg)
    if cfg.parallel.data_parallel == "dataparallel":
        fail(
            "parallel",
            "dataparallel",
            "torchao's float8 training composes with DDP, FSDP2 and DTensor TP; "
            "DataParallel's replicas, copied from the module in every forward "
            "(torch.nn.parallel.replicate), are none of them",
            f"parallel=ddp (a process a device), or {OFF}",
        )
    linears, _ = float8_coverage(cfg.model, cfg.train.seq_len, f8.skip)
    if not linears:
        skipped = f", nor named in train.float8.skip={list(f8.skip)}" if f8.skip else ""
        fail(
            KEY,
            True,
            f"model={cfg.model.name} has no linear float8 takes (both dims multiples of 16, "
            f"not the output head or an MoE router{skipped})",
            f"{OFF}, or linears whose in and out features are multiples of 16",
        )


def _check_recipe(cfg: ExperimentConfig) -> None:
    """What the recipe needs of the layout and of this torch."""
    f8 = cfg.train.float8
    if f8.fsdp_all_gather and f8.recipe != "tensorwise":
        fail(
            "train.float8.fsdp_all_gather",
            True,
            f"torchao all-gathers float8 weights for the tensorwise recipe only (recipe "
            f"{f8.recipe}: one scale a row, computed after the gather)",
            "null or false, or train.float8.recipe=tensorwise",
        )
    cpu = cfg.hardware.device_type == "cpu"
    if cpu and f8.recipe != "tensorwise" and not cpu_scales_rows(torch.__version__):
        fail(
            "train.float8.recipe",
            str(f8.recipe),
            f"torch {torch.__version__}'s CPU _scaled_mm takes one scale a tensor only "
            f"(per-row scales from torch {CPU_ROWWISE_TORCH})",
            f"tensorwise, or torch >= {CPU_ROWWISE_TORCH} for {f8.recipe} on a CPU",
        )


def _check_devices(cfg: ExperimentConfig, facts: HostFacts) -> None:
    """Every CUDA device of the run has float8 tensor cores: by its capability where torch
    reports it, else (a profile's box, which a plan describes) by the profile's fp8 peak."""
    if cfg.hardware.device_type != "cuda":
        return
    seen = [d for d in facts.cuda_devices[: cfg.launcher.nproc_per_node] if d.capability]
    for device in seen:
        if device.capability < FLOAT8_CAPABILITY:
            major, minor = device.capability
            _no_float8(f"{device.name} is sm{major}{minor}")
    if seen:
        return
    for index, spec in enumerate(cfg.hardware.devices):
        if "fp8" not in spec.peak_tflops:
            _no_float8(
                f"{spec.name} has no float8 tensor cores (hardware.devices.{index}."
                "peak_tflops lists no fp8 peak)"
            )


def _no_float8(what: str) -> None:
    fail(
        KEY,
        True,
        f"float8 matmuls (torch._scaled_mm) need CUDA compute capability 8.9 or newer "
        f"(Ada, Hopper, Blackwell); {what}",
        f"{OFF} (bf16 on this GPU), or an sm89+ GPU (L40S, RTX 4090, H100, H200, B200)",
    )


def _check_precision(cfg: ExperimentConfig) -> None:
    """fp16 for no recipe: torchao trains float8 in bf16 or fp32 (its tests), and fp16's
    loss scale would scale the gradients float8 casts; fp32 for tensorwise only: CUDA's
    row-wise scaled matmul outputs bf16 (_scaled_mm_out_cuda: "Only bf16 high precision
    output types are supported for row-wise scaling" outside cuBLAS 12.9 on sm90), and
    rowwise_with_gw_hp's high-precision weight gradient multiplies bf16 by its input."""
    f8, precision = cfg.train.float8, cfg.train.precision
    if precision == "fp16" or (precision == "fp32" and f8.recipe != "tensorwise"):
        fail(
            "train.precision",
            str(precision),
            f"train.float8.recipe={f8.recipe} trains in "
            + ("bf16 or fp32" if f8.recipe == "tensorwise" else "bf16"),
            f"train.precision=bf16, or {OFF}",
        )
