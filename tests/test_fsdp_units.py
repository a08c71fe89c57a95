"""What FSDP2 keeps gathered between forward and backward (rank/parallel/fsdp.py), and how
often it syncs replicas (rank/parallel's gradient_sync)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshrun.core.layout import Layout
from meshrun.models import build_model
from meshrun.rank.mesh import build_mesh
from meshrun.rank.parallel import gradient_sync, parallelize
from meshrun.rank.parallel.fsdp import apply_fsdp
from tests.helpers import resolved_config


def _gathered_after_forward(_) -> dict[str, bool]:
    """Which units hold whole parameters after a forward: FSDP2 swaps a unit's sharded
    DTensor parameters for plain tensors while it is gathered."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    cfg = resolved_config("model=tiny")
    model = build_model(cfg.model, cfg.train.seq_len, torch.device("cpu"))
    model.init_weights(0)
    apply_fsdp(
        model, mesh, Layout(dp_shard=2), reshard_after_forward=True, param_dtype=torch.float32
    )
    model(torch.zeros(1, 8, dtype=torch.long))
    blocks = list(model.layers.values())
    gathered = {
        "root": model.output.weight,
        "first block": blocks[0].attention.wq.weight,
        "last block": blocks[-1].attention.wq.weight,
    }
    dist.destroy_process_group()
    return {unit: not isinstance(weight, DTensor) for unit, weight in gathered.items()}


def test_root_and_last_block_stay_gathered_for_backward(rank_pool):
    """The root and the last block are the first backward needs: resharding them would
    cost an all-gather with nothing to overlap it; the other blocks are resharded."""
    for rank in rank_pool.run(_gathered_after_forward, None, world_size=2):
        assert rank == {"root": True, "first block": False, "last block": True}


def _replica_syncs(micro_batches: int) -> dict[str, object]:
    """dp2_tp2 (FSDP2 replicating beside TP): the gradient all-reduces over the replicas in
    one step of `micro_batches`, with meshrun's gradient_sync and with a sync every one, and
    the gradients each way."""
    dist.init_process_group("gloo")
    cfg = resolved_config("model=tiny", "parallel=dp2_tp2", "launcher.nproc_per_node=4")
    layout = Layout.of(cfg.parallel)
    mesh = build_mesh(layout, "cpu")
    replicas = dist.get_process_group_ranks(mesh["dp_replicate"].get_group())
    model = parallelize(
        build_model(cfg.model, 16, "meta", vocab_multiple=2),
        mesh,
        layout,
        cfg.parallel,
        torch.device("cpu"),
        seed=0,
        param_dtype=torch.float32,
    ).parts[0]
    calls = [0]
    all_reduce = dist.all_reduce

    def counted(tensor, *args, group=None, **kwargs):
        if group is not None and dist.get_process_group_ranks(group) == replicas:
            calls[0] += 1
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counted
    got = {}
    try:
        for way in ("once", "every"):
            calls[0] = 0
            for index in range(micro_batches):
                last = index == micro_batches - 1
                with gradient_sync(model, enabled=last or way == "every"):
                    tokens = torch.arange(32).view(2, 16) + index + dist.get_rank()
                    model(tokens).float().square().mean().backward()
            grads = [p.grad.to_local().clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            got[way] = (calls[0], grads)
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
    same = all(torch.allclose(a, b) for a, b in zip(got["once"][1], got["every"][1], strict=True))
    return {"once": got["once"][0], "every": got["every"][0], "same": same}


@pytest.mark.slow
def test_replicas_sync_gradients_once_a_step_however_many_micro_batches(rank_pool):
    """4 micro-batches: one all-reduce over the replicas for each FSDP2 unit (tiny's 4 blocks
    and the root) a step, not one a micro-batch, and the same gradients."""
    for rank in rank_pool.run(_replica_syncs, 4, world_size=4):
        assert rank == {"once": 5, "every": 20, "same": True}
