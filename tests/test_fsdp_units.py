"""What FSDP2 keeps gathered between forward and backward (rank/parallel/fsdp.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshrun.core.layout import Layout
from meshrun.models import build_model
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
