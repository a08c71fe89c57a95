"""GPU checks of DataParallel and the CUDA memory figures: DataParallel's replicas compute in
the run's bf16 and its memory is each device's beside the plan (2 GPUs), the reserved peak
survives the breakdown's resets, a memory snapshot's peak leaves the baseline beside the run out (2
GPUs). Skipped where the CUDA devices are missing."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from meshrun.driver.tool_config import TOLERANCES
from meshrun.rank.metrics.memory import FWD_BWD_END, STEP_START, MemoryMeter, ModelState
from meshrun.rank.parallel.dataparallel import apply_dataparallel

MIB = 2**20
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
TINY = (
    "model=tiny",
    "train.steps=6",
    "train.untimed_steps=2",
    "train.precision=bf16",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
)


@TWO_GPUS
def test_dataparallel_replicas_compute_in_the_runs_bf16():
    """A forward hook on every Linear records each replica's output dtype, per device."""
    seen: list[tuple[int, torch.dtype]] = []
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).cuda()
    for layer in (model[0], model[2]):
        layer.register_forward_hook(lambda _, __, out: seen.append((out.device.index, out.dtype)))
    x = torch.randn(8, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        nn.DataParallel(model, device_ids=[0, 1])(x)
        torchs = sorted(set(seen), key=str)
        seen.clear()
        apply_dataparallel(model, 2)(x)
    print(f"torch's DataParallel alone under bf16 autocast: {torchs}")
    assert set(seen) == {(0, torch.bfloat16), (1, torch.bfloat16)}


@TWO_GPUS
def test_dataparallel_bf16_trains_as_one_gpu_and_reports_each_device(meshrun):
    single = meshrun("parallel=single", *TINY, "metrics.baseline=off")
    dataparallel = meshrun(
        "parallel=dataparallel", "parallel.dataparallel_devices=2", *TINY, "metrics.baseline=off"
    )
    assert single.returncode == dataparallel.returncode == 0, single.output + dataparallel.output
    results = dataparallel.results
    assert results["losses"] == pytest.approx(single.results["losses"], rel=4 * TOLERANCES["bf16"])
    first, replica = results["memory_per_rank"]
    assert first["params"] > 0 and replica["params"] == 0 and replica["peak"] > 0
    for measured, predicted in zip(
        results["memory_per_rank"], results["memory_predicted"], strict=True
    ):
        print(f"device {measured['rank']}: measured {measured}\n  predicted {predicted}")


def test_the_reserved_peak_survives_a_breakdown_mark_after_the_cache_shrank():
    torch.cuda.empty_cache()
    meter = MemoryMeter([torch.device("cuda", 0)])
    meter.start()
    held = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    del held
    torch.cuda.empty_cache()  # the reserved bytes fall back
    meter.mark(STEP_START)
    small = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    meter.mark(FWD_BWD_END)
    meter.hold()
    [split] = meter.breakdowns(ModelState(0, 0, 0))
    print(f"reserved {split['reserved'] / MIB:.0f} MiB, torch's since the last reset "
          f"{torch.cuda.max_memory_reserved() / MIB:.0f} MiB")  # fmt: skip
    assert split["reserved"] >= 256 * MIB > torch.cuda.max_memory_reserved()
    assert split["peak"] >= 256 * MIB
    del small


def _frame_files(snapshot: dict) -> set[str]:
    """Every source file in the snapshot's stacks: its live blocks' and its history's."""
    frames = [f for s in snapshot["segments"] for b in s["blocks"] for f in b.get("frames", [])]
    frames += [f for trace in snapshot["device_traces"] for e in trace for f in e.get("frames", [])]
    return {f["filename"] for f in frames}


@TWO_GPUS
def test_a_memory_snapshots_peak_leaves_the_baseline_out(meshrun):
    """Rank 0 trains the baseline beside the run, between its timed steps: the peak file holds
    none of its allocations (written where the run's own peak rose, before the baseline)."""
    run = meshrun(
        "parallel=ddp", "launcher.nproc_per_node=2", *TINY, "train.steps=8",
        "debug.memory_snapshot=true", "metrics.baseline=fresh",
    )  # fmt: skip
    assert run.returncode == 0, run.output
    assert run.results["baseline_mode"] == "fresh"  # the baseline trained beside the run
    with open(run.run_dir / "memory_snapshot" / "rank0.peak.pickle", "rb") as f:
        files = _frame_files(pickle.load(f))
    assert any(name.endswith("meshrun/rank/train/loop.py") for name in files)
    assert not any(name.endswith("meshrun/rank/train/baseline_beside.py") for name in files)
