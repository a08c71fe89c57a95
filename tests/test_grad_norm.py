"""The global gradient norm, clipping (rank/train/optim.LocalGrads) and the AdamW step
(LocalAdamW, in each of torch's implementations) on local shards equal torch's on the full
tensors, whatever each gradient's placement on a 2-D mesh: sharded on one dim or both,
replicated, partial (not yet reduced), or a plain tensor; after an fp16-style unscaling too.
Four real gloo ranks of the session's pool. meshrun's step (clip, AdamW) reads nothing back
to the host."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshrun.core.config import TrainConfig
from meshrun.models import build_model
from meshrun.rank.train.optim import LocalAdamW, LocalGrads, build_optimizer
from tests.helpers import compose_config

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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _params_with_grads(mesh, full: dict[str, torch.Tensor]) -> list[nn.Parameter]:
    """A parameter per placement, its gradient laid out so (a partial one: its parameter
    replicated on that dim), holding `full`'s values; weights seeded alike on every rank."""
    generator = torch.Generator().manual_seed(1)
    params = []
    for name, grad in full.items():
        weight = torch.randn(grad.shape, generator=generator)
        if name not in PLACEMENTS:
            param = nn.Parameter(weight)
            param.grad = grad.clone()
            params.append(param)
            continue
        placements = PLACEMENTS[name]
        param_placements = [Replicate() if p.is_partial() else p for p in placements]
        param = nn.Parameter(distribute_tensor(weight, mesh, param_placements))
        if any(p.is_partial() for p in placements):  # the tp ranks' parts sum to `grad`
            tp_rank = mesh.get_local_rank("tp")
            local = distribute_tensor(grad, mesh, [placements[0], Replicate()]).to_local()
            part = local * (0.25 if tp_rank == 0 else 0.75)
            param.grad = DTensor.from_local(part, mesh, placements, run_check=False)
        else:
            param.grad = distribute_tensor(grad, mesh, placements)
        params.append(param)
    return params


def _local_norm_and_clip(_) -> dict[str, object]:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _full_grads()
    params = _params_with_grads(mesh, full)
    grads = LocalGrads(params)
    grads.scale_(UNSCALE)  # as fp16's unscaling does, before the norm
    norm = grads.norm(None)
    grads.clip_(MAX_NORM, norm)
    clipped = {name: _full(p.grad) for name, p in zip(full, params, strict=True)}
    return {"norm": norm.item(), "clipped": clipped}


def test_norm_and_clipping_on_local_shards_equal_torchs_on_the_full_gradients(rank_pool):
    full = {name: grad * UNSCALE for name, grad in _full_grads().items()}
    want = torch.nn.utils.get_total_norm(list(full.values())).item()
    coef = min(1.0, MAX_NORM / (want + 1e-6))
    for rank in rank_pool.run(_local_norm_and_clip, None, world_size=4):
        assert abs(rank["norm"] - want) <= 1e-5 * want  # every rank has the same norm
        for name, grad in full.items():
            torch.testing.assert_close(rank["clipped"][name], grad * coef, rtol=1e-6, atol=1e-6)


def _local_adamw_steps(kernels: dict[str, bool]) -> dict[str, object]:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    params = _params_with_grads(mesh, _full_grads())
    optimizer = LocalAdamW(params, lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, **kernels)
    for _ in range(2):  # the second step reads the state the first one left
        optimizer.step()
    states = [optimizer.state[p] for p in params]
    return {
        "params": [_full(p.detach()) for p in params],
        "states": [{key: _full(value) for key, value in state.items()} for state in states],
        # DTensors of their parameter's layout, as DCP saves and reshards them
        "states_as_params": [
            {
                isinstance(state[key], DTensor) == isinstance(p, DTensor)
                and getattr(state[key], "placements", None) == getattr(p, "placements", None)
                for key in ("exp_avg", "exp_avg_sq")
            }
            for p, state in zip(params, states, strict=True)
        ],
    }


KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}


@pytest.mark.parametrize("kernels", KERNELS.values(), ids=KERNELS)
def test_adamw_on_local_shards_equals_torchs_on_the_full_tensors(rank_pool, kernels):
    full = _full_grads()
    generator = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.randn(grad.shape, generator=generator)) for grad in full.values()]
    for param, grad in zip(params, full.values(), strict=True):
        param.grad = grad.clone()
    optimizer = torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(2):
        optimizer.step()
    for rank in rank_pool.run(_local_adamw_steps, kernels, world_size=4):
        for name, want, got, state in zip(
            full, params, rank["params"], rank["states"], strict=True
        ):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6, msg=name)
            for key, value in optimizer.state[want].items():
                torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=name)
        assert all(same == {True} for same in rank["states_as_params"])


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (`.item()` and the like):
    on a GPU, each one waits for the device to finish everything queued."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_clipping_and_optimizer_step_read_nothing_back_to_the_host():
    model = build_model(compose_config("model=tiny").model, 16, "cpu")
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, TrainConfig())
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second step runs on the state the first one created
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        with HostReads() as reads:
            grads = LocalGrads(list(model.parameters()))
            grads.clip_(1.0, grads.norm(None))
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        assert reads.count == 0
