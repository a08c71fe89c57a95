"""The global gradient norm and clipping on local shards (rank/train/optim.LocalGrads) equal
torch's on the full gradients, whatever each gradient's placement on a 2-D mesh: sharded on
one dim or both, replicated, partial (not yet reduced), or a plain tensor; after an fp16-style
unscaling too. Four real gloo ranks of the session's pool."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from meshrun.rank.train.optim import LocalGrads

PLACEMENTS = {
    "shard both dims": [Shard(0), Shard(1)],
    "shard dim 0, replicate": [Shard(0), Replicate()],
    "replicate, shard dim 1": [Replicate(), Shard(1)],
    "replicated": [Replicate(), Replicate()],
    "partial on dim 1": [Shard(0), Partial()],
}
MAX_NORM = 1.0
UNSCALE = 0.5


def _full_grads() -> dict[str, torch.Tensor]:
    """The same gradients on every rank (seeded), large enough that clipping applies."""
    generator = torch.Generator().manual_seed(0)
    return {name: 3 * torch.randn(4, 6, generator=generator) for name in [*PLACEMENTS, "plain"]}


def _local_norm_and_clip(_) -> dict[str, object]:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _full_grads()
    params = []
    for name, grad in full.items():
        param = nn.Parameter(torch.zeros_like(grad))
        if name in PLACEMENTS:
            placements = PLACEMENTS[name]
            if any(p.is_partial() for p in placements):  # the tp ranks' parts sum to `grad`
                tp_rank = mesh.get_local_rank("tp")
                local = distribute_tensor(grad, mesh, [placements[0], Replicate()]).to_local()
                part = local * (0.25 if tp_rank == 0 else 0.75)
                param.grad = DTensor.from_local(part, mesh, placements, run_check=False)
            else:
                param.grad = distribute_tensor(grad, mesh, placements)
        else:
            param.grad = grad.clone()
        params.append(param)
    grads = LocalGrads(params)
    grads.scale_(UNSCALE)  # as fp16's unscaling does, before the norm
    norm = grads.norm(None)
    grads.clip_(MAX_NORM, norm)
    clipped = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
               for name, p in zip(full, params, strict=True)}  # fmt: skip
    return {"norm": norm.item(), "clipped": clipped}


def test_norm_and_clipping_on_local_shards_equal_torchs_on_the_full_gradients(rank_pool):
    full = {name: grad * UNSCALE for name, grad in _full_grads().items()}
    want = torch.nn.utils.get_total_norm(list(full.values())).item()
    coef = min(1.0, MAX_NORM / (want + 1e-6))
    for rank in rank_pool.run(_local_norm_and_clip, None, world_size=4):
        assert abs(rank["norm"] - want) <= 1e-5 * want  # every rank has the same norm
        for name, grad in full.items():
            torch.testing.assert_close(rank["clipped"][name], grad * coef, rtol=1e-6, atol=1e-6)
