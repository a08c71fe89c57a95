"""Every layout (data, tensor, context, pipeline parallel and their compositions, every
schedule and CP method) trains the same model on the same global batch as a single device:
per-step losses and global gradient norms agree to 1e-4 (relative, fp32), each run in real
gloo processes (the session's rank pool). The norms are compared apart: under AdamW a norm
that misses a shard leaves the losses alone (clipping by a wrong factor scales the whole
gradient, which Adam's update divides out), so only the norm shows it.

Layouts with TP and no pipeline run two micro-batches a step (per DP rank: one), not four:
a TP micro-batch costs ~0.15 s of CPU per rank here (every op a DTensor dispatch, every
block's all-reduces), and accumulation is already proven by ddp, fsdp and the single-device
reference."""

from __future__ import annotations

import pytest

from meshrun.core.layout import Layout
from meshrun.driver.experiment import measure
from tests.ranks import assert_steps_match, config_in, losses
from tests.tiers import tiered

STEPS = 4
MICRO4 = "train.micro_batch_size=4"
COMMON = (
    "model=tiny",
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "train.precision=fp32",
    "train.seed=3",
    "metrics.baseline=off",
)
LAYOUTS = {
    "ddp": ("parallel=ddp",),
    "ddp_bucket_view": ("parallel=ddp_bucket_view",),
    "fsdp": ("parallel=fsdp",),
    "hsdp": ("parallel=hsdp", "launcher.nproc_per_node=4"),
    "tp2": ("parallel=tp2", MICRO4),
    "tp2_sequence_parallel": ("parallel=tp2", "parallel.sequence_parallel=true", MICRO4),
    "tp4": ("parallel=tp4", MICRO4),
    "pp2_1f1b": ("parallel=pp2",),
    "pp2_gpipe": ("parallel=pp2", "parallel.schedule=gpipe"),
    # the whole global batch as one micro-batch: no pipelining at all
    "pp2_naive_one_microbatch": (
        "parallel=pp2",
        "parallel.schedule=gpipe",
        "train.micro_batch_size=8",
    ),
    "pp4": ("parallel=pp4",),
    "pp4_gpipe_prefetching_receives": ("parallel=pp4", "parallel.schedule=gpipe"),
    "pp2_interleaved": ("parallel=pp2_interleaved",),
    "pp2_interleaved_zero_bubble": ("parallel=pp2_interleaved", "parallel.schedule=interleaved_zb"),
    "pp2_uneven_split": ("parallel=pp2", "parallel.pp_layers=[3,1]"),
    "pp2_split_by_measured_cost": ("parallel=pp2", "parallel.pp_layers=auto"),
    "tp2_pp2": ("parallel=tp2_pp2",),
    "dp2_tp2": ("parallel=dp2_tp2", MICRO4),
    "dp2_pp2": ("parallel=dp2_pp2",),
    "fsdp2_tp2": ("parallel=fsdp2_tp2", MICRO4),
    "fsdp2_tp2_sequence_parallel": (
        "parallel=fsdp2_tp2",
        "parallel.sequence_parallel=true",
        MICRO4,
    ),
    "dp2_tp2_pp2": ("parallel=dp2_tp2_pp2",),
    "cp2_ring": ("parallel=cp2", MICRO4),
    "cp2_allgather": ("parallel=cp2", "parallel.cp_method=allgather", MICRO4),
    "cp2_alltoall": ("parallel=cp2", "parallel.cp_method=alltoall", MICRO4),
    "fsdp2_cp2": ("parallel=fsdp2_cp2", MICRO4),
    "tp2_cp2_sequence_parallel": ("parallel=tp2_cp2", MICRO4),
    "pp2_cp2": ("parallel=cp2", "parallel.pp=2"),
    # the recompute of a checkpointed block runs inside the CP attention too
    "cp2_full_checkpointing": ("parallel=cp2", "parallel.activation_checkpointing=full", MICRO4),
    "ddp_full_checkpointing": ("parallel=ddp", "parallel.activation_checkpointing=full"),
    "fsdp_selective_checkpointing": (
        "parallel=fsdp",
        "parallel.activation_checkpointing=selective",
    ),
    # torchtitan's op policy: the TP collectives between kept and recomputed matmuls
    "tp2_op_checkpointing": ("parallel=tp2", "parallel.activation_checkpointing=op"),
    "fsdp2_tp2_sequence_parallel_op_checkpointing": (
        "parallel=fsdp2_tp2",
        "parallel.sequence_parallel=true",
        "parallel.activation_checkpointing=op",
        MICRO4,
    ),
}


# In CI: each dimension alone (ddp, fsdp, hsdp, tp2, pp2, cp2's ring), the most involved
# schedule (interleaved zero bubble), and compositions holding every pair of dimensions (dp x
# tp x pp, fsdp x tp with SP, fsdp x cp) and checkpointing. The rest with -m slow: their parts
# are in these (CP's other methods also in test_context_attention.py, against SDPA).
FAST = {
    "ddp",
    "fsdp",
    "hsdp",
    "tp2",
    "pp2_1f1b",
    "pp2_interleaved_zero_bubble",
    "dp2_tp2_pp2",
    "fsdp2_tp2_sequence_parallel",
    "fsdp2_cp2",
    "fsdp_selective_checkpointing",
}


def _single_device_steps(tmp_path_factory, rank_pool, *overrides: str) -> list[dict]:
    cfg = config_in(tmp_path_factory.mktemp("single"), "parallel=single", *COMMON, *overrides)
    measured = measure(cfg, "run", rank_pool.launch)
    assert measured.ok, measured.meta.error
    return measured.steps


@pytest.fixture(scope="session")
def single_steps(tmp_path_factory, rank_pool) -> list[dict]:
    return _single_device_steps(tmp_path_factory, rank_pool)


@pytest.mark.parametrize("layout", tiered(LAYOUTS, FAST))
def test_layout_losses_and_grad_norms_match_single_device(experiment, single_steps, layout):
    cfg, measured = experiment(*COMMON, *LAYOUTS[layout])
    assert measured.ok, measured.meta.error
    resolved = Layout.of(cfg.parallel)
    assert resolved.world_size == cfg.launcher.nproc_per_node > 1  # really distributed
    assert len(measured.report.memory_per_rank) == resolved.world_size  # every rank reported back
    assert len(single_steps) == STEPS
    assert_steps_match(measured.steps, single_steps)
    got = losses(measured)
    assert got[-1] < got[0]  # it trains, not just agrees


# A tied embedding and head (Llama 3.2 1B's) under a pipeline: the last stage trains a copy
# of the first stage's embedding weight, their gradients summed each step (rank/parallel/
# tied.py). In CI: TP's vocabulary-sharded ends, FSDP2's, and a pipeline whose ends form a
# group of their own (pp4); with -m slow the rest.
TIED = "model.tie_embeddings=true"
TIED_LAYOUTS = {
    "pp2": ("parallel=pp2",),
    "pp4_ends_in_a_group_of_their_own": ("parallel=pp4",),
    "tp2_pp2": ("parallel=tp2_pp2",),
    "tp2_pp2_sequence_parallel": ("parallel=tp2_pp2", "parallel.sequence_parallel=true"),
    "fsdp2_pp2_interleaved": (
        "parallel=pp2_interleaved",
        "parallel.dp_shard=2",
        "launcher.nproc_per_node=4",
    ),
    "dp2_tp2_pp2": ("parallel=dp2_tp2_pp2",),
    "tp2_pp4_two_pairs_of_ends": (
        "parallel=tp2_pp2",
        "parallel.pp=4",
        "launcher.nproc_per_node=8",
    ),
}
TIED_FAST = {"fsdp2_pp2_interleaved"}


@pytest.fixture(scope="session")
def single_tied_steps(tmp_path_factory, rank_pool) -> list[dict]:
    return _single_device_steps(tmp_path_factory, rank_pool, TIED)


@pytest.mark.parametrize("layout", tiered(TIED_LAYOUTS, TIED_FAST))
def test_a_tied_embedding_trains_across_pipeline_stages_as_on_one_device(
    experiment, single_tied_steps, layout
):
    _, measured = experiment(*COMMON, TIED, *TIED_LAYOUTS[layout])
    assert measured.ok, measured.meta.error
    assert_steps_match(measured.steps, single_tied_steps)
