"""Data-parallel ranks see disjoint samples that together make the global batch; TP peers
(same dp rank) see identical data. Checked in real gloo processes on a real DeviceMesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshrun.core.layout import Layout, dp_rank
from meshrun.rank.mesh import build_mesh, init_distributed
from meshrun.rank.train.data import LocalBatches, SyntheticTokens, dp_sample_range

GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3


def batches_for(dp: int, dp_size: int) -> LocalBatches:
    dataset = SyntheticTokens(vocab_size=256, seed=7)
    return LocalBatches(dataset, GLOBAL_BATCH, SEQ, dp, dp_size, torch.device("cpu"))


def rank_tokens(layout: Layout) -> dict:
    """One rank: its dp rank from the mesh and from dp_rank, and the tokens it trains on."""
    init_distributed("gloo", timeout_s=30)
    try:
        mesh = build_mesh(layout, "cpu")
        rank = dist.get_rank()
        mesh_dp = mesh.get_local_rank("dp_replicate") * layout.dp_shard + mesh.get_local_rank(
            "dp_shard"
        )
        dp = dp_rank(layout, rank)
        steps = [batches_for(dp, layout.dp_size).for_step(s)[0] for s in range(STEPS)]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"dp": dp, "mesh_dp": mesh_dp, "steps": steps})
        return {"ranks": gathered}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout",
    [Layout(dp_replicate=2, dp_shard=2), Layout(dp_shard=2, tp=2)],
    ids=lambda layout: layout.describe(),
)
def test_dp_ranks_split_the_global_batch_and_tp_peers_share_it(rank_pool, layout):
    ranks = rank_pool.run(rank_tokens, layout, layout.world_size)[0]["ranks"]
    assert all(r["dp"] == r["mesh_dp"] for r in ranks), "dp_rank disagrees with the mesh"
    whole = batches_for(0, 1)
    for step in range(STEPS):
        global_batch = whole.for_step(step)[0]
        by_dp: dict[int, torch.Tensor] = {}
        for r in ranks:
            seen = r["steps"][step]
            assert torch.equal(by_dp.setdefault(r["dp"], seen), seen), "TP peers differ"
        assert sorted(by_dp) == list(range(layout.dp_size))
        ordered = torch.cat([by_dp[d] for d in range(layout.dp_size)])
        assert torch.equal(ordered, global_batch)  # disjoint slices covering the batch


def test_sample_ranges_are_disjoint_and_cover_each_step():
    for step in range(4):
        ranges = [dp_sample_range(step, 12, dp, 3) for dp in range(3)]
        assert sorted(i for r in ranges for i in r) == list(range(step * 12, step * 12 + 12))


def test_local_batch_is_the_ranks_share_with_shifted_targets():
    inputs, targets = batches_for(1, 2).for_step(0)
    assert inputs.shape == targets.shape == (GLOBAL_BATCH // 2, SEQ)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
