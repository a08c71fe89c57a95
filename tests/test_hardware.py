"""Hardware profiles: detection from device names, per-rank devices, peak FLOP/s and MFU."""

from __future__ import annotations

import dataclasses

import pytest

from meshrun.core.config import (
    DeviceSpec,
    HardwareConfig,
    LinkConfig,
    LlamaModelConfig,
    NetworkConfig,
)
from meshrun.core.flops import flops_per_token, mfu, peak_flops
from meshrun.core.hardware import (
    CudaDevice,
    HostFacts,
    detect_profile,
    device_for_rank,
    load_profile,
    profile_names,
    resolve_hardware,
)
from meshrun.core.model_shape import llama_shape
from meshrun.core.paths import CONF_DIR
from meshrun.validate import validate
from tests.helpers import compose_config

# What torch reports (props.total_memory / 2**30) for these cards, give or take.
A100_80 = CudaDevice("NVIDIA A100-SXM4-80GB", 79.15)
A100_40 = CudaDevice("NVIDIA A100-SXM4-40GB", 39.39)
H100 = CudaDevice("NVIDIA H100 80GB HBM3", 79.11)
H200 = CudaDevice("NVIDIA H200", 139.8)
A6000 = CudaDevice("NVIDIA RTX A6000", 47.54)


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
        ([A100_80] * 2 + [A6000] * 6, "2xa100-6xa6000"),
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
    cfg = validate(compose_config("hardware=cpu", "backend=gloo", "parallel=pp2"), one_gpu)
    assert cfg.launcher.nproc_per_node == 2 and cfg.hardware.device_type == "cpu"
