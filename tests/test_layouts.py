"""Every data-parallel layout trains the same model on the same global batch as a single
device: per-step losses agree to 1e-4 (relative, fp32), each run in real gloo processes."""

from __future__ import annotations

import pytest

from tests.cli import run_meshrun

STEPS = 10
COMMON = (
    "model=tiny", f"train.steps={STEPS}", "train.warmup_steps=1", "train.global_batch_size=8",
    "train.micro_batch_size=2", "train.seq_len=64", "train.precision=fp32", "train.seed=3",
    "metrics.baseline=false",
)  # fmt: skip
LAYOUTS = {
    "ddp": ("parallel=ddp",),
    "ddp_bucket_view": ("parallel=ddp_bucket_view",),
    "fsdp": ("parallel=fsdp",),
    "hsdp": ("parallel=hsdp", "launcher.nproc_per_node=4"),
}


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("single")
    run = run_meshrun(tmp / "run", tmp / "meshrun.db", "parallel=single", *COMMON)
    assert run.returncode == 0, run.output
    return run.results["losses"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_losses_match_single_device(meshrun, single_losses, layout):
    run = meshrun(*LAYOUTS[layout], *COMMON)
    assert run.returncode == 0, run.output
    results = run.results
    assert results["world_size"] == (4 if layout == "hsdp" else 2)
    losses = results["losses"]
    assert len(losses) == len(single_losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, single_losses, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} vs {want}"
    assert losses[-1] < losses[0]  # it trains, not just agrees
