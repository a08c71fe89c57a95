"""Every layout (data, tensor, pipeline parallel and their compositions, every schedule)
trains the same model on the same global batch as a single device: per-step losses agree to
1e-4 (relative, fp32), each run in real gloo processes."""

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
    "tp2": ("parallel=tp2",),
    "tp2_sequence_parallel": ("parallel=tp2", "parallel.sequence_parallel=true"),
    "tp4": ("parallel=tp4",),
    "pp2_1f1b": ("parallel=pp2",),
    "pp2_gpipe": ("parallel=pp2", "parallel.schedule=gpipe"),
    "pp2_naive_one_microbatch": ("parallel=pp2", "parallel.schedule=gpipe",
                                 "train.micro_batch_size=8"),
    "pp4": ("parallel=pp4",),
    "pp4_gpipe_prefetching_receives": ("parallel=pp4", "parallel.schedule=gpipe"),
    "pp2_interleaved": ("parallel=pp2_interleaved",),
    "pp2_interleaved_zero_bubble": ("parallel=pp2_interleaved",
                                    "parallel.schedule=interleaved_zb"),
    "pp2_uneven_split": ("parallel=pp2", "parallel.pp_layers=[3,1]"),
    "tp2_pp2": ("parallel=tp2_pp2",),
    "dp2_tp2": ("parallel=dp2_tp2",),
    "dp2_pp2": ("parallel=dp2_pp2",),
    "fsdp2_tp2": ("parallel=fsdp2_tp2",),
    "fsdp2_tp2_sequence_parallel": ("parallel=fsdp2_tp2", "parallel.sequence_parallel=true"),
    "dp2_tp2_pp2": ("parallel=dp2_tp2_pp2",),
    "ddp_full_checkpointing": ("parallel=ddp", "parallel.activation_checkpointing=full"),
    "fsdp_selective_checkpointing": ("parallel=fsdp",
                                     "parallel.activation_checkpointing=selective"),
}  # fmt: skip


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("single")
    run = run_meshrun(tmp / "run", tmp / "meshrun.db", "parallel=single", *COMMON)
    assert run.returncode == 0, run.output
    return run.results["losses"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_losses_match_single_device(meshrun, single_losses, layout):
    run = meshrun(*LAYOUTS[layout], *COMMON, timeout=400)
    assert run.returncode == 0, run.output
    results = run.results
    layout_cfg = results["layout"]
    assert results["world_size"] == layout_cfg["dp_replicate"] * layout_cfg["dp_shard"] * (
        layout_cfg["tp"] * layout_cfg["pp"]
    )
    losses = results["losses"]
    assert len(losses) == len(single_losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, single_losses, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} vs {want}"
    assert losses[-1] < losses[0]  # it trains, not just agrees
