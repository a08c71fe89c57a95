"""Rank order: row-major over (pp, dp_replicate, dp_shard, tp), tp fastest, like DeviceMesh."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch
import torch.distributed as dist

from meshrun.core.config import LauncherConfig, ParallelConfig
from meshrun.core.errors import ConfigError
from meshrun.core.layout import DIMENSIONS, MESH_DIMS, Layout, cp_rank, dp_rank, rank_coords
from meshrun.rank.mesh import build_mesh, cuda_index, dp_group, init_distributed
from meshrun.rank.watchdog import step_collectives
from meshrun.validate.launcher import check_placement

LAYOUTS = [
    Layout(),
    Layout(dp_replicate=4),
    Layout(dp_shard=3),
    Layout(tp=2),
    Layout(dp_shard=2, tp=2),
    Layout(dp_replicate=2, dp_shard=3),
    Layout(pp=2, dp_replicate=1, dp_shard=2, tp=2),
    Layout(pp=3, dp_replicate=2, dp_shard=1, tp=2),
    Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2),
    Layout(cp=2, tp=2),
    Layout(pp=2, dp_shard=2, cp=3, tp=2),
]


def shape(layout: Layout) -> tuple[int, ...]:
    return tuple(getattr(layout, dim) for dim in MESH_DIMS)


def test_layout_world_size_is_the_product_of_all_degrees():
    assert Layout().world_size == 1
    assert Layout(dp_shard=4).world_size == 4
    assert Layout(pp=2, dp_replicate=3, dp_shard=2, tp=4).world_size == 48


def test_layout_dp_size_spans_both_data_parallel_dims_only():
    assert Layout(pp=2, tp=4).dp_size == 1
    assert Layout(dp_replicate=2, dp_shard=3, tp=2, pp=2).dp_size == 6


def test_layout_describe_names_the_non_trivial_dims_in_mesh_order():
    assert Layout().describe() == "single"
    assert Layout(dp_replicate=2).describe() == "dp_replicate2"
    assert Layout(dp_shard=2, tp=2).describe() == "dp_shard2 x tp2"
    assert Layout(pp=2, dp_replicate=2, dp_shard=4, tp=8).describe() == (
        "pp2 x dp_replicate2 x dp_shard4 x tp8"
    )


def test_layout_degrees_are_in_mesh_order():
    layout = Layout(pp=2, dp_replicate=3, dp_shard=4, cp=6, tp=5)
    assert list(layout.degrees().items()) == [
        ("pp", 2),
        ("dp_replicate", 3),
        ("dp_shard", 4),
        ("cp", 6),
        ("tp", 5),
    ]


def test_each_dimension_of_the_table_is_a_layout_degree_and_a_parallel_key():
    """core/layout.DIMENSIONS is the one declaration the mesh, the degree rules, the watchdog
    and meshrun-plan's preset keys read: each row a Layout degree, its settings config keys."""
    degrees = {f.name for f in dataclasses.fields(Layout)}
    keys = {f.name for f in dataclasses.fields(ParallelConfig)}
    for dim in DIMENSIONS:
        assert dim.name in degrees & keys
        assert set(dim.settings) <= keys
        assert dim.collectives in step_collectives({dim.name: 2})


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.describe)
def test_rank_coords_is_row_major_with_tp_fastest(layout):
    enumeration = itertools.product(*(range(n) for n in shape(layout)))
    for rank, coords in enumerate(enumeration):
        assert rank_coords(layout, rank) == dict(zip(MESH_DIMS, coords, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.describe)
def test_rank_coords_index_the_device_mesh_grid_at_that_rank(layout):
    # DeviceMesh lays ranks out as arange(world).reshape(shape): its coordinate of a rank is
    # where that rank sits in this grid.
    grid = torch.arange(layout.world_size).reshape(shape(layout))
    for rank in range(layout.world_size):
        coords = rank_coords(layout, rank)
        assert grid[tuple(coords[dim] for dim in MESH_DIMS)].item() == rank


def test_tensor_parallel_peers_are_adjacent_ranks():
    layout = Layout(dp_shard=2, tp=4)
    peers = [r for r in range(layout.world_size) if rank_coords(layout, r)["dp_shard"] == 1]
    assert peers == [4, 5, 6, 7]


def test_context_parallel_peers_are_next_beyond_tensor_parallel_ones():
    """tp innermost, then cp (Megatron's tp-cp-dp-pp): a CP group's ranks are tp apart."""
    layout = Layout(dp_shard=2, cp=2, tp=2)
    groups = {}
    for rank in range(layout.world_size):
        c = rank_coords(layout, rank)
        groups.setdefault((c["dp_shard"], c["tp"]), []).append(rank)
        assert cp_rank(layout, rank) == c["cp"]
    assert sorted(groups.values()) == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.describe)
def test_tp_cp_and_pp_peers_share_their_dp_rank(layout):
    by_dp_coords: dict[tuple[int, int], set[int]] = {}
    for rank in range(layout.world_size):
        c = rank_coords(layout, rank)
        by_dp_coords.setdefault((c["dp_replicate"], c["dp_shard"]), set()).add(
            dp_rank(layout, rank)
        )
    assert all(len(ranks) == 1 for ranks in by_dp_coords.values())


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.describe)
def test_dp_rank_is_a_bijection_onto_range_dp_size_within_each_pp_cp_tp_slice(layout):
    slices: dict[tuple[int, int, int], list[int]] = {}
    for rank in range(layout.world_size):
        c = rank_coords(layout, rank)
        slices.setdefault((c["pp"], c["cp"], c["tp"]), []).append(dp_rank(layout, rank))
    assert len(slices) == layout.pp * layout.cp * layout.tp
    for dp_ranks in slices.values():
        assert sorted(dp_ranks) == list(range(layout.dp_size))


def test_dp_rank_orders_replicas_outside_shards():
    layout = Layout(dp_replicate=2, dp_shard=3)
    assert [dp_rank(layout, r) for r in range(6)] == [0, 1, 2, 3, 4, 5]
    layout = Layout(dp_replicate=2, dp_shard=2, tp=2)
    assert [dp_rank(layout, r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    "layout",
    [Layout(dp_shard=2, tp=2), Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)],
    ids=Layout.describe,
)
def test_build_mesh_and_dp_group_agree_with_rank_coords_and_dp_rank(layout):
    """The real DeviceMesh, on torch's in-process fake backend (one process plays each rank)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    assert not dist.is_initialized()
    for rank in range(layout.world_size):
        dist.init_process_group(
            "fake", store=fake_pg.FakeStore(), rank=rank, world_size=layout.world_size
        )
        try:
            mesh = build_mesh(layout, "cpu")
            assert mesh.mesh_dim_names == MESH_DIMS
            coords = rank_coords(layout, rank)
            assert tuple(mesh.get_coordinate()) == tuple(coords[dim] for dim in MESH_DIMS)
            group = dp_group(mesh)
            assert dist.get_world_size(group) == layout.dp_size
            assert dist.get_rank(group) == dp_rank(layout, rank)
            members = dist.get_process_group_ranks(group)
            assert all(
                rank_coords(layout, m)["pp"] == coords["pp"]
                and rank_coords(layout, m)["tp"] == coords["tp"]
                for m in members
            )
        finally:
            dist.destroy_process_group()


RUN_TIMEOUT_S = 3
ABSENT_PEER_S = 15


def _tp_all_reduce_without_rank_1(_) -> tuple[str, float]:
    """Ranks of a tp2 x pp2 mesh with the run's timeout; rank 1 never joins its TP group's
    all-reduce (it outlasts the timeout asleep), rank 0 waits in it."""
    init_distributed("gloo", RUN_TIMEOUT_S)
    mesh = build_mesh(Layout(pp=2, tp=2), "cpu")
    rank = dist.get_rank()
    started = time.monotonic()
    if rank == 1:
        time.sleep(ABSENT_PEER_S)
        return "absent", time.monotonic() - started
    if rank != 0:
        return "idle", 0.0
    try:
        dist.all_reduce(torch.ones(1), group=mesh["tp"].get_group())
    except RuntimeError as err:
        return f"raised: {err}"[:200], time.monotonic() - started
    return "completed", time.monotonic() - started


@pytest.mark.waits  # on backend.timeout_s
def test_a_sub_mesh_collective_times_out_at_the_runs_timeout(rank_pool):
    """A TP group of a 2-D mesh is a group of its own, not the default one: it must keep the
    run's timeout (torch's default for it would be 30 minutes)."""
    (outcome, waited), *_ = rank_pool.run(_tp_all_reduce_without_rank_1, None, world_size=4)
    assert outcome.startswith("raised") and "Timed out" in outcome, outcome
    assert waited < RUN_TIMEOUT_S + 3 < ABSENT_PEER_S


@pytest.mark.parametrize(
    ("local_rank", "visible", "index"),
    [(3, 8, 3), (0, 8, 0), (3, 1, 0), (0, 1, 0), (7, 1, 0)],
    ids=["node's GPUs", "first", "one per task", "one per task, rank 0", "last, one per task"],
)
def test_a_rank_takes_its_local_rank_among_the_nodes_gpus_or_the_one_it_was_given(
    local_rank, visible, index
):
    """A SLURM task bound to one GPU (--gpus-per-task=1) sees it as cuda:0 whatever its
    LOCAL_RANK; one that sees the node's takes its own."""
    assert cuda_index(local_rank, visible) == index


@pytest.mark.parametrize(("local_rank", "visible"), [(2, 2), (5, 4), (0, 0)])
def test_a_rank_beyond_the_gpus_it_sees_is_an_error_naming_both(local_rank, visible):
    with pytest.raises(
        RuntimeError, match=f"LOCAL_RANK={local_rank}, and this process sees {visible}"
    ):
        cuda_index(local_rank, visible)


@pytest.mark.parametrize(("local_rank", "visible", "index"), [(1, 1, 0), (2, 2, 0), (5, 4, 1)])
def test_ranks_sharing_gpus_under_gloo_take_them_in_turn(local_rank, visible, index):
    """backend=gloo may put more ranks than GPUs on a node (NCCL refuses a duplicate GPU):
    the GPU checks run multi-rank layouts on a box of one GPU so."""
    assert cuda_index(local_rank, visible, shared=True) == index


def test_more_ranks_than_gpus_are_refused_but_under_gloo():
    launcher = LauncherConfig(nproc_per_node=2)
    with pytest.raises(ConfigError, match="only 1 CUDA devices are visible") as refused:
        check_placement(launcher, 2, 1, "parallel=ddp")
    assert "backend=gloo (its ranks may share a GPU" in str(refused.value)
    check_placement(launcher, 2, 1, "parallel=ddp", shared=True)
