"""Hardware profiles: detection from device names, per-rank devices, peak FLOP/s and MFU."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from meshrun.core.config import (
    DeviceSpec,
    HardwareConfig,
    LinkConfig,
    LlamaModelConfig,
    NetworkConfig,
)
from meshrun.core.errors import ConfigError
from meshrun.core.flops import flops_per_token, mfu, peak_flops
from meshrun.core.hardware import (
    CudaDevice,
    HostFacts,
    detect_profile,
    device_for_rank,
    is_model,
    load_profile,
    profile_names,
    resolve_hardware,
    unknown_device_note,
)
from meshrun.core.model_shape import llama_shape
from meshrun.core.nvidia_smi import DriverView
from meshrun.core.paths import CONF_DIR
from meshrun.driver.resolution import resolved_config
from meshrun.driver.resolve import resolve
from tests.cli import run_meshrun
from tests.helpers import compose_config
from tests.nvidia_smi_stub import H100 as H100_SMI
from tests.nvidia_smi_stub import R550_CUDA_12_4, stub_nvidia_smi

# What torch reports (props.total_memory / 2**30) for these cards, give or take.
A100_80 = CudaDevice("NVIDIA A100-SXM4-80GB", 79.15)
A100_40 = CudaDevice("NVIDIA A100-SXM4-40GB", 39.39)
H100 = CudaDevice("NVIDIA H100 80GB HBM3", 79.11)
H200 = CudaDevice("NVIDIA H200", 139.8)
A6000 = CudaDevice("NVIDIA RTX A6000", 47.54)
A100_80_PCIE = CudaDevice("NVIDIA A100 80GB PCIe", 79.15)
# torch's names for real devices (as get_device_properties(i).name reports them in issue
# threads and MAMF tables), their memory as torch reports it, and the profile each must get:
# None, no profile (the unknown box: torch's memory, MFU n/a).
REAL_DEVICES = [
    ("NVIDIA H100 80GB HBM3", 79.11, "h100-80g"),
    ("NVIDIA H100 PCIe", 79.11, "h100-pcie"),
    ("NVIDIA H100 NVL", 93.1, "h100-nvl"),
    ("NVIDIA GH200 480GB", 94.5, "gh200"),
    ("NVIDIA GH200 144G HBM3e", 140.0, None),
    ("NVIDIA H200", 139.8, "h200"),
    ("NVIDIA H200 NVL", 139.8, None),
    ("NVIDIA A100-SXM4-80GB", 79.15, "a100-80g"),
    ("A100-SXM4-40GB", 39.39, "a100-40g"),  # drivers before R470 left out "NVIDIA"
    ("NVIDIA A100-SXM4-40GB", 39.39, "a100-40g"),
    ("NVIDIA A100 80GB PCIe", 79.15, "a100-80g-pcie"),
    ("NVIDIA RTX A6000", 47.54, "a6000"),
    ("NVIDIA L40S", 44.42, "l40s"),
    ("NVIDIA A10G", 22.2, "a10g"),
    ("NVIDIA GeForce RTX 4090", 23.64, "rtx4090"),
    ("NVIDIA B200", 178.35, "b200"),
    ("Tesla V100-SXM2-32GB", 31.74, None),
]


def host(*devices: CudaDevice) -> HostFacts:
    return HostFacts(cuda_devices=list(devices), cpu_count=64, memory_gib=1000.0)


def test_profile_names_are_every_yaml_but_auto():
    files = {p.stem for p in (CONF_DIR / "hardware").glob("*.yaml")}
    assert set(profile_names()) == files - {"auto"}
    assert {"cpu", "a100-80g", "a100-40g", "h100-80g", "h200", "2xa100-6xa6000"} <= files


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_loads_with_devices(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.device_type in ("cpu", "cuda")
    assert profile.devices
    assert all(spec.count >= 1 for spec in profile.devices)


@pytest.mark.parametrize(
    "name", [n for n in profile_names() if load_profile(n).device_type == "cuda"]
)
def test_every_cuda_profile_has_fp32_and_bf16_peaks_memory_and_match_strings(name):
    for spec in load_profile(name).devices:
        assert spec.memory_gib > 0
        assert spec.peak_tflops["fp32"] > 0
        assert spec.peak_tflops["bf16"] > 0
        assert spec.match


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([dataclasses.replace(A100_80, memory_gib=80.0)] * 8, "a100-80g"),
        ([A100_80] * 8, "a100-80g"),
        ([dataclasses.replace(A100_40, memory_gib=40.0)] * 8, "a100-40g"),
        ([A100_40] * 8, "a100-40g"),
        ([H200] * 8, "h200"),
        ([H100] * 8, "h100-80g"),
        ([A100_80_PCIE] * 2 + [A6000] * 6, "2xa100-6xa6000"),
        ([A6000] * 4, "a6000"),
    ],
    ids=[
        "8xa100-80GiB",
        "8xa100-80g",
        "8xa100-40GiB",
        "8xa100-40g",
        "h200",
        "h100",
        "mixed",
        "a6000",
    ],
)
def test_detect_profile_matches_device_names(devices, expected):
    assert detect_profile(host(*devices)).name == expected


@pytest.mark.parametrize("count", [1, 2])
def test_detect_profile_of_a_few_a100_80g_is_the_a100_80g_profile(count):
    assert detect_profile(host(*[A100_80] * count)).name == "a100-80g"


@pytest.mark.parametrize(("name", "memory", "expected"), REAL_DEVICES, ids=str)
def test_a_device_gets_its_own_models_profile_or_none(name, memory, expected):
    """By the whole model name: a GH200 is not an H200, an H100 PCIe or NVL not the SXM5
    part; a device no profile names gets torch's memory and no peaks, never another's."""
    profile = detect_profile(host(CudaDevice(name, memory)))
    if expected is not None:
        assert profile.name == expected
        return
    assert profile.name == f"unknown ({name})"
    [spec] = profile.devices
    assert (spec.name, spec.memory_gib, spec.peak_tflops) == (name, round(memory, 1), {})


# The profiles that hold a model's devices besides its own: cluster presets, the mixed box.
ALSO_HOLD = {
    "a100-80g": {"a100-80g-25gbe"},
    "a100-40g": {"aws-p4d"},
    "a6000": {"2xa100-6xa6000"},
    "a100-80g-pcie": {"2xa100-6xa6000"},
}


def test_no_profile_takes_another_models_name():
    """Each real name is taken by its own model's profiles alone: detection never picks the
    right one by a memory tie-break over a wrong model (a substring took GH200 for H200)."""
    profiles = list(map(load_profile, profile_names()))
    for name, _, expected in REAL_DEVICES:
        takers = {p.name for p in profiles if any(is_model(spec, name) for spec in p.devices)}
        own = {expected} | ALSO_HOLD.get(expected, set()) if expected else set()
        assert takers <= own, (name, takers)


def test_a_box_no_profile_describes_keeps_each_devices_own_memory():
    profile = detect_profile(host(A100_80, A100_80, CudaDevice("NVIDIA H200 NVL", 139.8)))
    assert profile.name == "unknown (NVIDIA A100-SXM4-80GB, NVIDIA H200 NVL)"
    assert [(s.name, s.count, s.memory_gib) for s in profile.devices] == [
        ("NVIDIA A100-SXM4-80GB", 2, 79.2),
        ("NVIDIA H200 NVL", 1, 139.8),
    ]
    assert peak_flops([device_for_rank(profile.devices, r) for r in range(3)], "bf16") is None


def test_an_unknown_device_is_named_once_with_how_to_add_its_profile():
    notes: list[str] = []
    unknown = host(CudaDevice("NVIDIA H200 NVL", 139.8))
    resolve(compose_config("parallel=single", "metrics.baseline=off"), unknown, say=notes.append)
    [note] = [n for n in notes if "profile" in n]
    assert note.startswith(
        "warning: no hardware profile describes this box (1 x 'NVIDIA H200 NVL')"
    )
    assert 'match: ["NVIDIA H200 NVL"]' in note
    assert unknown_device_note(detect_profile(host(H100))) is None


def test_unknown_device_gets_a_profile_without_peak_so_mfu_is_unknown():
    profile = detect_profile(host(*[CudaDevice("Tesla V100-SXM2-32GB", 31.7)] * 4))
    assert profile.device_type == "cuda"
    assert "Tesla V100-SXM2-32GB" in profile.name
    assert [spec.count for spec in profile.devices] == [4]
    assert profile.devices[0].memory_gib == pytest.approx(31.7)
    assert all(not spec.peak_tflops for spec in profile.devices)
    specs = [device_for_rank(profile.devices, r) for r in range(4)]
    peak = peak_flops(specs, "bf16")
    assert peak is None
    assert mfu(1e5, 1e9, peak) is None


def test_no_cuda_gives_the_cpu_profile_with_the_host_memory():
    profile = detect_profile(HostFacts(cuda_devices=[], cpu_count=2, memory_gib=23.456))
    assert profile.name == "cpu"
    assert profile.device_type == "cpu"
    assert len(profile.devices) == 1
    assert profile.devices[0].memory_gib == pytest.approx(23.5)


def test_link_figures_given_beside_auto_win_over_the_detected_profile():
    facts = HostFacts(cuda_devices=[], cpu_count=2, memory_gib=8.0)
    given = HardwareConfig(
        name="auto", intra_node=LinkConfig(bw_gbs=5.0), network=NetworkConfig(nic_gbps=25.0)
    )
    profile = resolve_hardware(given, facts)
    detected = detect_profile(facts)
    assert profile.name == "cpu"
    # the figures given win, the detected profile's others stay
    assert profile.intra_node == dataclasses.replace(detected.intra_node, bw_gbs=5.0)
    assert profile.network.nic_gbps == 25.0
    assert resolve_hardware(HardwareConfig(name="auto"), facts) == detect_profile(facts)


def test_device_for_rank_follows_pci_order_on_the_mixed_box():
    devices = load_profile("2xa100-6xa6000").devices
    names = [device_for_rank(devices, r).name for r in range(8)]
    assert names == ["A100-80G"] * 2 + ["A6000"] * 6
    assert device_for_rank(devices, 8) is None


def spec(name: str, count: int = 1, **peaks: float) -> DeviceSpec:
    return DeviceSpec(name=name, count=count, memory_gib=10.0, peak_tflops=peaks)


def test_peak_flops_sums_the_devices_a_run_uses():
    devices = load_profile("2xa100-6xa6000").devices
    used = [device_for_rank(devices, r) for r in range(4)]  # 2 x A100 + 2 x A6000
    assert peak_flops(used, "bf16") == pytest.approx((2 * 312.0 + 2 * 154.8) * 1e12)
    assert peak_flops(used[:1], "fp32") == pytest.approx(19.5e12)


def test_peak_flops_is_none_when_any_device_lacks_the_precision():
    fast, partial = spec("fast", fp32=10.0, bf16=100.0), spec("partial", fp32=5.0)
    assert peak_flops([fast, partial], "fp32") == pytest.approx(15e12)
    assert peak_flops([fast, partial], "bf16") is None
    assert peak_flops([fast, None], "fp32") is None


def test_mfu_is_achieved_over_peak_and_none_for_unknown_peak():
    assert mfu(1000.0, 1e9, 4e12) == pytest.approx(0.25)
    assert mfu(1000.0, 1e9, None) is None
    assert mfu(1000.0, 1e9, 0.0) is None


def test_flops_per_token_is_6n_plus_12_layers_dim_seq():
    cfg = LlamaModelConfig(name="m", dim=512, n_layers=6, n_heads=8, vocab_size=1000)
    shape, n = llama_shape(cfg), 12_345_678
    assert flops_per_token(shape, n, 256) == 6 * n + 12 * 6 * 512 * 256
    assert flops_per_token(shape, n, 1024) - flops_per_token(shape, n, 512) == 12 * 6 * 512 * 512
    # heads wider than dim / n_heads (Qwen3): attention over the queries' width, 8 x 128
    wide = llama_shape(dataclasses.replace(cfg, head_dim=128))
    assert flops_per_token(wide, n, 256) == 6 * n + 12 * 6 * 1024 * 256


def test_cpu_profile_on_a_gpu_host_runs_ranks_on_the_cpu_whatever_the_gpu_count():
    one_gpu = HostFacts([CudaDevice("NVIDIA H200", 139.8)], cpu_count=16, memory_gib=128)
    cfg = resolved_config(compose_config("hardware=cpu", "backend=gloo", "parallel=pp2"), one_gpu)
    assert cfg.launcher.nproc_per_node == 2 and cfg.hardware.device_type == "cpu"


# nvidia-smi lists 8 H100s (driver 550: CUDA 12.4) that torch does not see.
EIGHT_UNSEEN = DriverView(8, ("NVIDIA H100 80GB HBM3",) * 8, (12, 4), ((9, 0),) * 8)


def test_auto_refuses_cpu_ranks_where_nvidia_smi_lists_gpus_torch_cannot_see():
    facts = HostFacts(cuda_devices=[], cpu_count=16, memory_gib=128, unseen=EIGHT_UNSEEN)
    with pytest.raises(ConfigError) as refused:
        resolve_hardware(HardwareConfig(name="auto"), facts)
    assert refused.value.key == "hardware"
    assert f"nvidia-smi lists 8 GPUs, torch {torch.__version__} sees none" in str(refused.value)
    assert (
        "MESHRUN_TORCH_SPEC='torch>=2.11 --index-url https://download.pytorch.org/whl/cu126'"
        in str(refused.value)
    )
    assert "hardware=cpu to train on CPU on purpose" in str(refused.value)
    with pytest.raises(ConfigError, match="this profile describes CUDA devices"):
        resolve_hardware(load_profile("h100-80g"), facts)
    # on purpose: the CPU
    cfg = resolved_config(compose_config("hardware=cpu", "backend=gloo", "parallel=pp2"), facts)
    assert cfg.hardware.device_type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host: torch sees its GPUs")
@pytest.mark.slow
def test_meshrun_on_a_gpu_host_with_a_cpu_torch_exits_2_saying_what_to_install(tmp_path):
    """The real console script, with nvidia-smi listing 8 H100s on PATH: refused before any
    rank starts; hardware=cpu trains on the CPU as asked."""
    bin_dir = stub_nvidia_smi(tmp_path / "bin", R550_CUDA_12_4, [H100_SMI] * 8)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = run_meshrun(tmp_path / "auto", tmp_path / "meshrun.db", env=env)
    assert run.returncode == 2, run.output
    assert (
        f"config error hardware='auto': nvidia-smi lists 8 GPUs, torch {torch.__version__} "
        "sees none"
    ) in run.output
    assert not (tmp_path / "meshrun.db").exists()
    small = ("parallel=single", "train.steps=2", "train.untimed_steps=1", "metrics.baseline=off")
    run = run_meshrun(tmp_path / "cpu", tmp_path / "meshrun.db", "hardware=cpu", *small, env=env)
    assert run.returncode == 0, run.output
    assert run.results["hardware"] == "cpu"
