"""train.precision=auto: bf16 on CUDA where every device has it (sm80+), else fp32; fp32 on
CPU; a plan against a profile by its datasheet. fp32 on CUDA runs its matmuls on TF32 tensor
cores where train.tf32 (the default) allows them, and the planner's rate, the MFU's peak and
the rank's torch flags agree on it."""

from __future__ import annotations

import pytest
import torch

from meshrun.core.config import DeviceSpec, HardwareConfig
from meshrun.core.hardware import CudaDevice, HostFacts, load_profile
from meshrun.core.precision import auto_precision, matmul_precision
from meshrun.driver.resolution import resolved_config
from meshrun.driver.results import flops_fields
from meshrun.plan import predict
from meshrun.plan.candidate import host_flops
from meshrun.plan.stage_time import device_peak
from meshrun.rank.device import set_fp32_matmul
from tests.helpers import compose_config

# torch's name, memory and (major, minor) for these cards
H100 = CudaDevice("NVIDIA H100 80GB HBM3", 79.11, (9, 0))
A100 = CudaDevice("NVIDIA A100-SXM4-80GB", 79.15, (8, 0))
T4 = CudaDevice("Tesla T4", 14.58, (7, 5))
CUDA = HardwareConfig(name="gpus", device_type="cuda")


def host(*devices: CudaDevice) -> HostFacts:
    return HostFacts(cuda_devices=list(devices), cpu_count=64, memory_gib=1000.0)


@pytest.mark.parametrize(
    ("hardware", "capabilities", "expected"),
    [
        (HardwareConfig(name="cpu"), [], ("fp32", "CPU")),
        (CUDA, [(9, 0)] * 8, ("bf16", "sm90")),
        (CUDA, [(9, 0), (8, 0)], ("bf16", "sm80")),  # every device has it
        (CUDA, [(7, 5)], ("fp32", "sm75, no bf16")),
        (CUDA, [(8, 6), (7, 0)], ("fp32", "sm70, no bf16")),  # one without is enough
        (load_profile("h100-80g"), [None] * 8, ("bf16", "h100-80g's datasheet bf16 peak")),
        (
            HardwareConfig(
                name="old",
                device_type="cuda",
                devices=[DeviceSpec(name="V100", memory_gib=32, peak_tflops={"fp32": 15.7})],
            ),
            [None],
            ("fp32", "no bf16 peak for V100"),
        ),
    ],
)
def test_auto_precision_is_bf16_where_every_device_has_it(hardware, capabilities, expected):
    assert auto_precision(hardware, capabilities) == expected


def test_the_default_experiment_on_eight_h100s_runs_bf16_and_says_why():
    cfg = resolved_config(compose_config(), host(*[H100] * 8))
    assert (cfg.train.precision, cfg.resolved.precision_auto) == ("bf16", "sm90")
    assert cfg.train.global_batch_size == 16 and cfg.backend.name == "nccl"


def test_a_gpu_without_bf16_runs_fp32_and_a_cpu_run_fp32():
    on_t4 = resolved_config(compose_config(), host(T4))
    assert (on_t4.train.precision, on_t4.resolved.precision_auto) == ("fp32", "sm75, no bf16")
    on_cpu = resolved_config(compose_config("hardware=cpu", "backend=gloo"), host(H100))
    assert (on_cpu.train.precision, on_cpu.resolved.precision_auto) == ("fp32", "CPU")


def test_a_given_precision_is_kept():
    cfg = resolved_config(compose_config("train.precision=fp32"), host(H100))
    assert cfg.train.precision == "fp32" and cfg.resolved.precision_auto is None


def _on_h100(*overrides: str):
    given = ("hardware=h100-80g", "parallel=single", "train.precision=fp32", *overrides)
    return resolved_config(compose_config(*given), host(H100))


def test_fp32_on_cuda_is_planned_at_the_tf32_peak_unless_tf32_is_off():
    spec = load_profile("h100-80g").devices[0]
    tf32, full = _on_h100(), _on_h100("train.tf32=false")
    assert (matmul_precision(tf32), matmul_precision(full)) == ("tf32", "fp32")
    assert device_peak(tf32, spec) == pytest.approx(494.7e12)
    assert device_peak(full, spec) == pytest.approx(67.0e12)
    slower = predict.speed(full, host_flops(full)).step_time_s
    assert slower > 2 * predict.speed(tf32, host_flops(tf32)).step_time_s
    cpu = resolved_config(compose_config("hardware=cpu", "train.precision=fp32"), host())
    assert matmul_precision(cpu) == "fp32"  # TF32 is CUDA's


def test_the_mfu_counts_the_peak_the_planner_plans_at():
    tf32, full = _on_h100(), _on_h100("train.tf32=false")
    ratio = flops_fields(full, 1000.0)["mfu"] / flops_fields(tf32, 1000.0)["mfu"]
    assert ratio == pytest.approx(494.7 / 67.0)


@pytest.fixture
def torch_flags():
    """torch's process-wide fp32 matmul flags, restored after the test."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


def test_a_cpu_rank_leaves_torchs_matmul_flags_alone(torch_flags):
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    set_fp32_matmul(torch.device("cpu"), "fp32", True)
    set_fp32_matmul(torch.device("cpu"), "fp32", False)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_an_fp32_cuda_rank_sets_tf32_as_train_tf32_says(torch_flags):
    """The flags are process-wide settings: set here without a GPU."""
    cuda = torch.device("cuda", 0)
    set_fp32_matmul(cuda, "bf16", False)  # autocast's matmuls: nothing to set
    assert torch.backends.cudnn.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    set_fp32_matmul(cuda, "fp32", True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"
    set_fp32_matmul(cuda, "fp32", False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
