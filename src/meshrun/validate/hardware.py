"""The rules of the hardware profile's figures, a calibration profile named by path, and the
backend for the resolved hardware on this host."""

from __future__ import annotations

import re
from pathlib import Path

import torch.distributed as dist

from meshrun.core.calibration import read_calibration
from meshrun.core.config import AttentionKernel, ExperimentConfig, HardwareConfig
from meshrun.core.errors import fail, positive
from meshrun.core.hardware import HostFacts, backend_name


def check_calibration_file(path: str, device_type: str) -> None:
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


def check_hardware(hw: HardwareConfig) -> None:
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


def check_backend(cfg: ExperimentConfig, hardware: HardwareConfig, facts: HostFacts) -> None:
    """The backend `backend=auto` resolves to for `hardware` (resolved), usable on this host."""
    b = cfg.backend
    positive("backend.timeout_s", b.timeout_s)
    on_cuda = hardware.device_type == "cuda"
    name = backend_name(b, hardware)
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
