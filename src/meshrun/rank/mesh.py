"""Process groups and the DeviceMesh of a rank, in the rank order of core/layout.py."""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from meshrun.core.layout import MESH_DIMS, Layout
from meshrun.rank.control_collectives import control_all_reduce


def init_distributed(backend: str, timeout_s: float) -> None:
    """Default process group from torchrun-style env vars, with the run's collective timeout,
    and so every group made after it: torch gives a group that `new_group` or `split_group`
    makes its own default (30 min; NCCL 10) unless a timeout is passed, and DeviceMesh,
    `_flatten` and FSDP2 pass none. A peer that never joined a TP all-reduce of a 2-D mesh
    held the other rank 20 s where the run's timeout was 5 (measured, gloo); the default
    group's timeout covered only 1-D meshes, which reuse it."""
    timeout = timedelta(seconds=timeout_s)
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    dist.init_process_group(backend=backend, timeout=timeout)


COLLECTIONS = 4  # at most; an FSDP2 run's groups took two


def end_distributed() -> None:
    """Every process group destroyed and collected with what holds them (the caller drops
    its own references first): their gloo threads end while the interpreter runs. Left to
    the interpreter's exit, one aborted a torchrun rank after a completed run ("terminate
    called without an active exception", SIGABRT); left in a process that runs again (the
    test suite's rank pool), every run's groups kept their threads and sockets."""
    if dist.is_initialized():
        dist.destroy_process_group()
    # DTensor's caches, whose specs and redistribution planners hold their meshes (and so
    # every group of a run: a TP run's 6 gloo groups, 18 threads, outlived it in the pool);
    # loss_parallel's tensor metadata, cached per op schema on the propagator's class
    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    for _ in range(COLLECTIONS):  # a collection's finalizers can leave the next one cycles
        if not gc.collect():
            break


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, tuple(layout.degrees().values()), mesh_dim_names=MESH_DIMS)


EXPERT_MESH_DIMS = ("pp", "dp_replicate", "expert_shard", "ep", "tp")


def build_expert_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The mesh experts are laid out on: the same ranks, with dp_shard x cp split into
    (expert_shard, ep), ep innermost, so an ep group is CP peers first, then neighbouring
    dp_shard ranks (torchtitan's dp_shard_in_ep x cp). Its own root, so that FSDP2 can
    shard the ep-sharded experts over expert_shard (both must share one)."""
    sizes = (layout.pp, layout.dp_replicate, layout.expert_shard_size, layout.ep, layout.tp)
    return init_device_mesh(device_type, sizes, mesh_dim_names=EXPERT_MESH_DIMS)


def dp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """One group spanning both data-parallel dims and CP (for averaging metrics like the
    loss: CP peers hold equal shares of a sequence's tokens, so the mean of their means is
    the sequence's)."""
    if mesh is None:
        return None
    return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp").get_group()


def cp_group(mesh: DeviceMesh | None, layout: Layout) -> dist.ProcessGroup | None:
    """This rank's context-parallel group, which shares its sequences' attention."""
    return mesh["cp"].get_group() if mesh is not None and layout.cp > 1 else None


def pp_group(mesh: DeviceMesh | None, layout: Layout) -> dist.ProcessGroup | None:
    """The pipeline stages of this rank's (dp, tp) coordinate, when there is a pipeline."""
    return mesh["pp"].get_group() if mesh is not None and layout.pp > 1 else None


def mean_over_ranks(
    losses: torch.Tensor, dp_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Losses as every rank of the run sees them: the last pipeline stage's (they are zero on
    the other stages), averaged over data-parallel ranks (equal shares of the batch)."""
    if pp_group is not None:
        control_all_reduce(losses, pp_group)
    if dp_group is not None:
        control_all_reduce(losses, dp_group)  # gloo has no AVG
        losses /= dist.get_world_size(dp_group)
    return losses


def select_device(device_type: str, local_rank: int, shared: bool = False) -> torch.device:
    """Rank -> device; CUDA indices follow PCI bus order (set by the driver) like nvidia-smi.
    `shared`: more ranks than GPUs may share them (gloo)."""
    if device_type == "cuda":
        index = cuda_index(local_rank, torch.cuda.device_count(), shared)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def cuda_index(local_rank: int, visible: int, shared: bool = False) -> int:
    """The CUDA device of a node's `local_rank`-th rank that sees `visible` devices: the one
    it sees where it was given one (SLURM's --gpus-per-task=1, or any binding that leaves a
    task a single device in CUDA_VISIBLE_DEVICES: cuda:0, whatever its LOCAL_RANK), else
    its own among the node's; where ranks may share devices (`shared`), in turn."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    if shared and visible > 1:
        return local_rank % visible
    shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    raise RuntimeError(
        f"LOCAL_RANK={local_rank}, and this process sees {visible} CUDA devices "
        f"(CUDA_VISIBLE_DEVICES={shown}): give each rank one GPU (SLURM: --gpus-per-task=1) "
        "or each rank all of its node's (--gpus-per-node)"
    )
